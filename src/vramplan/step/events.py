"""One training step as an ordered list of tensor events, built from a StepPlan.

An event is `(kind, tensor, nbytes, term, phase)`: kind "alloc" or "free", a tensor id, its
bytes, the breakdown term it belongs to and the phase. The order follows what the real step
does (the same order timeline.walk takes its snapshots in):

- setup (once, before the first step): what lives across steps -- weights, the batch,
  and, where nothing says otherwise, the optimizer states -- one tensor per parameter where
  the parameter sizes are known;
- lazy (once, in the first step): what the first step makes and keeps (`Pieces.lazy`): the
  optimizer's states where its optimizer phase begins, each cuBLAS handle's workspace at
  its first matmul (step/pieces.py has the sources);
- forward: each stage's saved tensors, layer by layer (a checkpointed layer also makes and
  frees the tensors its recompute will make); then the logits and the loss's saved
  tensors, after which the logits themselves go;
- backward: the loss's gradients, then per stage, last first: the tensors it frees before
  its peak, its transients (recomputed layer, activation gradients), the parameter
  gradients it has made by its peak; then its saved tensors and transients go in reverse
  order, each after a transient gradient of its size where that stays under the peak
  (`_release_with_grads`), and its other gradients arrive (with gradient accumulation, a
  second micro-step runs with every gradient already allocated);
- optimizer: its temporaries come and go (a per-parameter loop's one parameter after
  another, StepPlan.optimizer_sequence), then the gradients are freed (zero_grad(set_to_none=True)).

The live-bytes maximum of the list equals timeline.walk's peak; identical layers' pieces are built once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count

from vramplan.breakdown import Breakdown
from vramplan.components.checkpoint_moments import CACHE_TERM
from vramplan.components.optimizer import ADAFACTOR_TERMS
from vramplan.timeline import StepPlan

ALLOC, FREE = "alloc", "free"
GRAD_TERM = "backward/activation_grad"
PHASE_OF = {"optimizer_update": "optimizer"}
"""A moment of the step (Pieces.lazy) that is not a phase's start -> its phase."""
UPCAST_GRAD = "logits/grad_logits"
"""The 16-bit logits' gradient, made by the fp32 upcast's backward from the carried one."""
Event = tuple  # (kind, tensor, nbytes, term, phase)


@dataclass(slots=True)
class Pieces:
    """How a term's bytes are split into tensors: per term of the persistent state and the
    optimizer temporaries, and per stage for the gradients made after the stage's backward
    peak (the one made by the peak is one tensor)."""

    static: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """term -> relative sizes of its tensors (parameter numels)."""
    grads_rest: list[tuple[int, ...]] | None = None
    transient: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """term of a stage's backward transients -> relative sizes of its tensors (the gated
    MLP's gradients are three tensors, not one)."""
    lazy: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Persistent terms the first step makes, not the setup -> the phase that makes them,
    or one phase per equal piece of the term (see step/pieces.py)."""
    trained: list[tuple[int, ...]] | None = None
    """Per stage, the numels of its trained parameters: the tensors autocast's weight cache
    holds for that stage."""


@dataclass(slots=True)
class StepEvents:
    setup: list[Event]
    """Allocated once, before the first step, never freed."""
    step: list[Event]
    """One step; every tensor it allocates it frees."""
    lazy: list[Event] = field(default_factory=list)
    """Allocated once, by the first step, never freed."""
    lazy_at: tuple[int, ...] = ()
    """For each `lazy` event, the index in `step` it goes before in the first step."""

    def compact(self) -> tuple[tuple, tuple]:
        """(setup, step) as (tensor, nbytes) ops, nbytes 0 for a free: what the allocator
        replay reads."""
        return (tuple((t, b) for _, t, b, _, _ in self.setup),
                tuple((t, b if k is ALLOC else 0) for k, t, b, _, _ in self.step))

    def first_step(self) -> tuple:
        """The first step's (tensor, nbytes) ops: `step` with each lazily made tensor where
        the first step makes it (StepEvents.first_events)."""
        return tuple((t, b if k is ALLOC else 0) for k, t, b, _, _ in self.first_events())

    def first_events(self) -> list[Event]:
        """The first step's events: `step` with each lazily made tensor where it is made."""
        before: dict[int, list] = {}
        for at, e in zip(self.lazy_at, self.lazy):
            before.setdefault(at, []).append(e)
        out: list[Event] = []
        for i, e in enumerate(self.step):
            out += before.get(i, ())
            out.append(e)
        out += before.get(len(self.step), ())
        return out

    def live_peak(self) -> tuple[int, int]:
        """(peak live bytes, index of the step event that reaches it), from the second step
        on (every lazily created tensor alive)."""
        live = sum(e[2] for e in self.setup) + sum(e[2] for e in self.lazy)
        best, at = live, -1
        for i, (kind, _, nbytes, _, _) in enumerate(self.step):
            live += nbytes if kind is ALLOC else -nbytes
            if live > best:
                best, at = live, i
        return best, at


def split_bytes(total: int, weights: tuple[int, ...]) -> list[int]:
    """`total` bytes in pieces proportional to `weights` (the last takes the remainder)."""
    if len(weights) <= 1:
        return [total]
    whole = sum(weights)
    out = [total * w // whole for w in weights[:-1]]
    out.append(total - sum(out))
    return [b for b in out if b > 0]


class _Builder:
    def __init__(self, plan: StepPlan, pieces: Pieces | None):
        self.plan, self.pieces = plan, pieces or Pieces()
        self.ids = count()
        self.memo: dict[tuple, list[tuple[str, int]]] = {}
        self.out: list[Event] = []
        self.live = 0

    def items(self, bd: Breakdown, split: dict | None = None) -> list[tuple[str, int]]:
        """(term, bytes) per tensor of a Breakdown; memoized per object (shared by layers)."""
        key = (id(bd), id(split))
        hit = self.memo.get(key)
        if hit is None:
            hit = [(t, b) for term, v in bd for t, b in
                   ((term, x) for x in (split_bytes(v, split[term]) if split and term in split else [v]))]
            self.memo[key] = hit
        return hit

    def alloc(self, items, phase: str) -> list[tuple[int, str, int]]:
        made, out, ids = [], self.out, self.ids
        for term, b in items:
            t = next(ids)
            out.append((ALLOC, t, b, term, phase))
            made.append((t, term, b))
            self.live += b
        return made

    def free(self, made, phase: str) -> None:
        out = self.out
        for t, term, b in made:
            out.append((FREE, t, b, term, phase))
            self.live -= b


def _grad_items(b: _Builder, i: int, grads: Breakdown, at_peak: Breakdown | None) -> tuple[list, list]:
    """(gradients made by stage i's backward peak, the rest) as (term, bytes) tensors."""
    p = b.pieces
    first = [] if at_peak is None else list(at_peak)
    made = dict(at_peak.terms) if at_peak is not None else {}
    rest_bd = Breakdown()
    for term, v in grads:
        rest_bd.add(term, v - made.get(term, 0))
    rest = _split_terms(rest_bd, p.grads_rest[i] if p.grads_rest else ())
    return first, rest


def _split_terms(bd: Breakdown, weights: tuple[int, ...]) -> list[tuple[str, int]]:
    terms = list(bd)
    if len(terms) == 1 and weights:
        term, v = terms[0]
        return [(term, x) for x in split_bytes(v, weights)]
    return terms


def _release_with_grads(made: list, b: _Builder) -> None:
    """After a stage's backward peak, its saved tensors and transients go in reverse order;
    autograd computes the gradient of each before releasing it (a node's grad_input is
    allocated while its saved inputs live, then the node is released). Each gets one
    transient gradient of its size, kept only where it does not lift the live bytes above
    the stage's peak already walked -- the peak stays timeline.walk's, while the allocator
    sees the sizes that churn through backward."""
    level, ceiling = b.live, b.live
    for t, term, nbytes in reversed(made):
        if level + nbytes <= ceiling:
            g = next(b.ids)
            b.out.append((ALLOC, g, nbytes, GRAD_TERM, "backward"))
            b.out.append((FREE, t, nbytes, term, "backward"))
            b.out.append((FREE, g, nbytes, GRAD_TERM, "backward"))
        else:
            b.out.append((FREE, t, nbytes, term, "backward"))
        level -= nbytes
    b.live = level


def _carried(b: _Builder, loss_bwd: list, head: Breakdown | None) -> list:
    """The loss's backward tensors the head's backward goes on using: log_softmax's backward
    output (`logits/grad_logits_fp32`) is the input gradient of the fp32 upcast's backward,
    alive until that has made the 16-bit logits' gradient; the same tensor, not a second."""
    if head is None:
        return []
    wanted = set(b.items(head, b.pieces.transient))
    return [x for x in loss_bwd if (x[1], x[2]) in wanted]


def _stage_grads(b: _Builder, i: int, cache: dict) -> tuple[list, list]:
    plan, p = b.plan, b.pieces
    at_peak = plan.stage_grads_at_peak[i] if plan.stage_grads_at_peak else None
    key = (id(plan.grads_by_stage[i]), id(at_peak), id(p.grads_rest[i]) if p.grads_rest else None)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = _grad_items(b, i, plan.grads_by_stage[i], at_peak)
    return hit


RECOMPUTED = "activations/recomputed_layer/"


def build_events(plan: StepPlan, pieces: Pieces | None = None) -> StepEvents:
    """The step's tensor events (see the module docstring)."""
    events = _build(plan, pieces, None)
    if any(t.startswith(RECOMPUTED) for bd in plan.stage_backward_transient for t in bd.terms):
        events = _build(plan, pieces, events.live_peak()[0])
    return events


CACHE_NAME = CACHE_TERM.rsplit("/", 1)[1]


def _per_parameter(items: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """A moment's lazily made tensors in the order the optimizer makes them: one parameter
    at a time, each with all its states (torch/optim/adamw.py `_init_group`: exp_avg then
    exp_avg_sq per parameter), not one state over every parameter and then the next: terms
    split into the same number of pieces (one per parameter) interleave piece by piece."""
    by_term: dict[str, list[tuple[str, int]]] = {}
    for item in items:
        by_term.setdefault(item[0], []).append(item)
    counts = {t: len(v) for t, v in by_term.items()}
    out: list[tuple[str, int]] = []
    done: set[str] = set()
    for term in by_term:
        if term in done:
            continue
        group = [t for t in by_term if t not in done and counts[t] == counts[term] > 1] or [term]
        for i in range(counts[term]):
            out.extend(by_term[t][i] for t in group)
        done.update(group)
    return out


class _AutocastCache:
    """Autocast's weight cache in a forward whose layers are checkpointed: each layer's casts
    of its trained leaf weights (aten/src/ATen/autocast_mode.cpp `cached_cast`, one tensor
    per weight) stay alive until the autocast region exits, after the loss. The plan shows
    the whole cache in each layer's forward moment (components/checkpoint_moments.py); here
    each moment adds the casts made since the last, one per trained parameter of the layer,
    all freed together. (Made whole at every moment, the growing block opened a segment per
    layer: BERT-large amp-fp16 with checkpointing replayed 8.6 GiB for a 3.2 GiB peak.)"""

    __slots__ = ("made", "bytes")

    def __init__(self):
        self.made: list = []
        self.bytes = 0

    def grow(self, b: _Builder, items: list[tuple[str, int]], stage: int) -> list[tuple[str, int]]:
        """Allocate the cache's growth among `items` (a moment's tensors); return the others."""
        rest, total = [], 0
        for term, nbytes in items:
            if term.endswith(CACHE_NAME):
                total += nbytes
            else:
                rest.append((term, nbytes))
        if total > self.bytes:
            trained = b.pieces.trained
            weights = trained[stage - 1] if trained and 0 < stage <= len(trained) else ()
            pieces = split_bytes(total - self.bytes, weights) if weights else [total - self.bytes]
            self.made += b.alloc([(CACHE_TERM, x) for x in pieces if x], "forward")
            self.bytes = total
        return rest


def _forward_churn(b: _Builder, trans: Breakdown, ceiling: int) -> None:
    """A checkpointed layer's forward makes every tensor its recompute will make, and keeps
    none (torch/utils/checkpoint.py, non-reentrant: the saved-tensor hooks store nothing):
    each lives until the next op has made its output, a chain of pairs. Kept only where the
    pair stays under the step's peak, so the peak stays timeline.walk's."""
    prev = None
    for term, nbytes in b.items(trans, b.pieces.transient):
        if not term.startswith(RECOMPUTED):
            continue
        if b.live + nbytes > ceiling:
            continue
        made = b.alloc([(term, nbytes)], "forward")
        if prev is not None:
            b.free(prev, "forward")
        prev = made
    if prev is not None:
        b.free(prev, "forward")


def _build(plan: StepPlan, pieces: Pieces | None, ceiling: int | None) -> StepEvents:
    b = _Builder(plan, pieces)
    lazy_terms = b.pieces.lazy
    if plan.in_backward is not None:  # the hook steps each parameter as its gradient lands
        lazy_terms = {t: m for t, m in lazy_terms.items() if not any(x.startswith("optimizer") for x in m)}
    static = b.items(plan.static, b.pieces.static)
    pending: dict[str, list] = {"setup": [x for x in static if x[0] not in lazy_terms]}
    for term, nbytes in static:
        moments = lazy_terms.get(term, ())
        pieces = split_bytes(nbytes, (1,) * len(moments)) if len(moments) > 1 else [nbytes] * len(moments)
        for moment, piece in zip(moments, pieces):
            pending.setdefault(moment, []).append((term, piece))
    b.alloc(pending.pop("setup"), "setup")
    setup, b.out = b.out, []
    pending = {m: _per_parameter(items) for m, items in pending.items()}
    lazy = {m: b.alloc(items, PHASE_OF.get(m, m)) for m, items in pending.items()}
    lazy_events, b.out = b.out, []
    at = {"forward": 0}
    n = len(plan.stage_acts)
    grads_made: list = []
    grad_cache: dict[int, tuple[list, list]] = {}
    cache = _AutocastCache()
    for micro in range(2 if plan.grads_alive_in_forward else 1):
        have_grads = micro > 0
        saved = []
        for i, acts in enumerate(plan.stage_acts):
            saved.append(b.alloc(b.items(acts), "forward"))
            if ceiling is not None:
                _forward_churn(b, plan.stage_backward_transient[i], ceiling)
            if plan.stage_forward_transient and plan.stage_forward_transient[i].terms:
                rest = cache.grow(b, b.items(plan.stage_forward_transient[i]), i)
                b.free(b.alloc(rest, "forward"), "forward")
        fwd_end = b.alloc(cache.grow(b, b.items(plan.forward_end_transient), n), "forward")
        loss = b.alloc(b.items(plan.loss_saved), "forward")
        b.free(fwd_end + cache.made, "forward")  # the autocast region exits: its cache goes
        cache = _AutocastCache()
        loss_bwd = b.alloc(b.items(plan.loss_backward_transient), "backward")
        carried = _carried(b, loss_bwd, plan.stage_backward_transient[n - 1] if n else None)
        # log_softmax's backward consumes its input gradient, then its node releases the
        # saved output (the H100 traces free them in that order)
        b.free([x for x in loss_bwd if x not in carried], "backward")
        b.free(loss, "backward")
        for i in range(n - 1, -1, -1):
            at_peak = plan.stage_acts_at_peak[i] if plan.stage_acts_at_peak else None
            kept = set(at_peak.terms) if at_peak is not None else None
            early = [x for x in saved[i] if kept is not None and x[1] not in kept]
            b.free(early, "backward")
            items = b.items(plan.stage_backward_transient[i], b.pieces.transient)
            trans = []
            if i == n - 1 and carried:
                have = {(term, nbytes) for _, term, nbytes in carried}
                items = [x for x in items if x not in have]
                # the upcast's backward makes the 16-bit logits' gradient and its input
                # gradient goes before the head's first matmul (H100 traces: the backward
                # handle's workspace lands in the block the fp32 gradient left)
                trans = b.alloc([x for x in items if x[0] == UPCAST_GRAD], "backward")
                items = [x for x in items if x[0] != UPCAST_GRAD]
                b.free(carried, "backward")
            if "backward" not in at:
                # the head's first backward matmul: its output, then the backward thread's
                # cuBLAS handle and workspace (the traces: the lm_head weight's gradient or,
                # with the head frozen, the hidden state's, before the 32 MiB workspace)
                trans += b.alloc(items[:1], "backward")
                items = items[1:]
                at["backward"] = len(b.out)
            trans += b.alloc(items, "backward")
            if plan.in_backward is not None:  # stepped and freed by the hook as it is made
                made = b.alloc(_stage_grads(b, i, grad_cache)[0], "backward")
                _release_with_grads([x for x in saved[i] if kept is None or x[1] in kept] + trans, b)
                b.free(made, "backward")
                b.free(b.alloc(b.items(plan.in_backward[i]), "backward"), "backward")
                continue
            if not have_grads:
                cached = _stage_grads(b, i, grad_cache)
                grads_made += b.alloc(cached[0], "backward")
            _release_with_grads([x for x in saved[i] if kept is None or x[1] in kept] + trans, b)
            if not have_grads:
                grads_made += b.alloc(cached[1], "backward")
    if plan.backward_end_transient is not None and plan.in_backward is None:
        b.free(b.alloc(b.items(plan.backward_end_transient), "backward"), "backward")
    if plan.in_backward is None:
        at["optimizer"] = len(b.out)
        loop = plan.optimizer_sequence if pieces is not None else None  # one GPU: per parameter
        temps = b.alloc([x for x in b.items(plan.optimizer_temporaries, b.pieces.static)
                         if not loop or x[0] not in ADAFACTOR_TERMS], "optimizer")
        at["optimizer_update"] = len(b.out)
        made: dict[int, list] = {}
        for tensor, nbytes in loop or ():
            if nbytes:
                made[tensor] = b.alloc([(ADAFACTOR_TERMS[0], nbytes)], "optimizer")
            else:
                b.free(made.pop(tensor), "optimizer")
        b.free(temps, "optimizer")
        b.free(grads_made, "optimizer")
    at.setdefault("backward", len(b.out))
    at.setdefault("optimizer", len(b.out))
    at.setdefault("optimizer_update", len(b.out))
    return StepEvents(setup=setup, step=b.out, lazy=lazy_events,
                      lazy_at=tuple(at[m] for m, made in lazy.items() for _ in made))

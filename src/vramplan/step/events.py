"""One training step as an ordered list of tensor events, built from a StepPlan.

An event is `(kind, tensor, nbytes, term, phase)`: kind "alloc" or "free", a tensor id, its
bytes, the breakdown term it belongs to and the phase. The order follows what the real step
does (the same order timeline.walk takes its snapshots in):

- setup (once, before the first step): what lives across steps -- weights, optimizer
  states, the batch -- one tensor per parameter where the parameter sizes are known;
- forward: each stage's saved tensors, layer by layer; then the logits and the loss's
  saved tensors, after which the logits themselves go;
- backward: the loss's gradients, then per stage, last first: the tensors it frees before
  its peak, its transients (recomputed layer, activation gradients), the parameter
  gradients it has made by its peak; then its saved tensors and transients go in reverse
  order, each after a transient gradient of its size where that stays under the peak
  (`_release_with_grads`), and its other gradients arrive (with gradient accumulation, a
  second micro-step runs with every gradient already allocated);
- optimizer: its temporaries come and go, then the gradients are freed
  (zero_grad(set_to_none=True), the default of torch 2.x and transformers' Trainer).

The live-bytes maximum of the list equals timeline.walk's peak. Stages with one shared
saved list (identical layers) have their pieces built once and repeated.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count

from vramplan.breakdown import Breakdown
from vramplan.timeline import StepPlan

ALLOC, FREE = "alloc", "free"
GRAD_TERM = "backward/activation_grad"
Event = tuple  # (kind, tensor, nbytes, term, phase)


@dataclass(slots=True)
class Pieces:
    """How a term's bytes are split into tensors: per term of the persistent state and the
    optimizer temporaries, and per stage for the gradients made after the stage's backward
    peak (the one made by the peak is one tensor)."""

    static: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """term -> relative sizes of its tensors (parameter numels)."""
    grads_rest: list[tuple[int, ...]] | None = None


@dataclass(slots=True)
class StepEvents:
    setup: list[Event]
    """Allocated once, before the first step, never freed."""
    step: list[Event]
    """One step; every tensor it allocates it frees."""

    def compact(self) -> tuple[tuple, tuple]:
        """(setup, step) as (tensor, nbytes) ops, nbytes 0 for a free: what the allocator
        replay reads."""
        return (tuple((t, b) for _, t, b, _, _ in self.setup),
                tuple((t, b if k is ALLOC else 0) for k, t, b, _, _ in self.step))

    def live_peak(self) -> tuple[int, int]:
        """(peak live bytes, index of the step event that reaches it)."""
        live = sum(e[2] for e in self.setup)
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


def _stage_grads(b: _Builder, i: int, cache: dict) -> tuple[list, list]:
    plan, p = b.plan, b.pieces
    at_peak = plan.stage_grads_at_peak[i] if plan.stage_grads_at_peak else None
    key = (id(plan.grads_by_stage[i]), id(at_peak), id(p.grads_rest[i]) if p.grads_rest else None)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = _grad_items(b, i, plan.grads_by_stage[i], at_peak)
    return hit


def build_events(plan: StepPlan, pieces: Pieces | None = None) -> StepEvents:
    """The step's tensor events (see the module docstring)."""
    b = _Builder(plan, pieces)
    b.alloc(b.items(plan.static, b.pieces.static), "setup")
    setup, b.out = b.out, []
    n = len(plan.stage_acts)
    grads_made: list = []
    grad_cache: dict[int, tuple[list, list]] = {}
    for micro in range(2 if plan.grads_alive_in_forward else 1):
        have_grads = micro > 0
        saved = []
        for i, acts in enumerate(plan.stage_acts):
            saved.append(b.alloc(b.items(acts), "forward"))
            if plan.stage_forward_transient and plan.stage_forward_transient[i].terms:
                b.free(b.alloc(b.items(plan.stage_forward_transient[i]), "forward"), "forward")
        fwd_end = b.alloc(b.items(plan.forward_end_transient), "forward")
        loss = b.alloc(b.items(plan.loss_saved), "forward")
        b.free(fwd_end, "forward")
        loss_bwd = b.alloc(b.items(plan.loss_backward_transient), "backward")
        b.free(loss, "backward")
        b.free(loss_bwd, "backward")
        for i in range(n - 1, -1, -1):
            at_peak = plan.stage_acts_at_peak[i] if plan.stage_acts_at_peak else None
            kept = set(at_peak.terms) if at_peak is not None else None
            early = [x for x in saved[i] if kept is not None and x[1] not in kept]
            b.free(early, "backward")
            trans = b.alloc(b.items(plan.stage_backward_transient[i]), "backward")
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
        temps = b.alloc(b.items(plan.optimizer_temporaries, b.pieces.static), "optimizer")
        b.free(temps, "optimizer")
        b.free(grads_made, "optimizer")
    return StepEvents(setup=setup, step=b.out)

"""Live memory through one steady-state training step; its maximum is the peak.

The step is a list of events (moments where memory is at a local maximum). Each event is a
Breakdown of what is alive then; the peak is the largest. Order follows what autograd does:
forward saves activations layer by layer, the loss adds the logits, backward walks the
layers in reverse freeing each layer's saved tensors and adding its parameter gradients,
then the optimizer step adds its temporaries. Steady state means optimizer states already
exist during forward and backward (they are created in the first step and kept).
"""
from __future__ import annotations

from itertools import accumulate, chain, repeat
from dataclasses import dataclass, field
from operator import attrgetter

from vramplan.breakdown import Breakdown


class Event:
    """A moment of the step. `total` is computed from subtotals; the Breakdown of what is
    alive (`live`) is only assembled when asked for (the peak, a report)."""

    __slots__ = ("phase", "label", "total", "_parts", "_live")

    def __init__(self, phase: str, label: str, parts: "list[Breakdown] | Breakdown", total: int | None = None):
        if isinstance(parts, Breakdown):
            parts = [parts]
        self.phase = phase
        """forward | backward | optimizer (| generation for multi-model jobs)."""
        self.label = label
        self._parts = parts
        self._live: Breakdown | None = None
        self.total = sum(p.total() for p in parts) if total is None else total

    @property
    def live(self) -> Breakdown:
        if self._live is None:
            self._live = _sum(self._parts)
        return self._live

    def subtotal(self, prefixes: tuple[str, ...], memo: dict | None = None) -> int:
        """Bytes of the terms under `prefixes` alive at this moment: `live.total(prefix)`
        summed from the parts, without merging them (`memo`: per part, shared by events
        that share parts)."""
        memo = {} if memo is None else memo
        total = 0
        for p in self._parts:
            v = memo.get(id(p))
            if v is None:
                v = memo[id(p)] = sum(int(x) for k, x in p.terms.items() if k.startswith(prefixes))
            total += v
        return total

    def distinct_parts(self) -> tuple[list[Breakdown], dict[int, int]]:
        """The Breakdowns whose sum `live` is, each once (by identity, in order of first
        place), and how often each is counted."""
        return _distinct(self._parts if self._live is None else [self._live])

    @live.setter
    def live(self, value: Breakdown) -> None:
        self._live, self._parts = value, [value]
        self.total = value.total()


@dataclass(slots=True)
class StepPlan:
    """What the components computed, in the shape the timeline walks."""

    static: Breakdown
    """Alive for the whole step: weights, optimizer states, master weights, inputs."""
    grads_by_stage: list[Breakdown]
    """Parameter gradients, in the order backward produces them (head first, embedding last)."""
    stage_acts: list[Breakdown]
    """Saved activations per stage in forward order (embedding, layers..., final norm/head)."""
    loss_saved: Breakdown
    """Saved by the loss (fp32 log-softmax output), released by the loss backward."""
    forward_end_transient: Breakdown
    """Alive only at the end of forward (the logits, their fp32 upcast)."""
    loss_backward_transient: Breakdown
    """Alive at the start of backward (gradients of the log-softmax and of the logits)."""
    stage_backward_transient: list[Breakdown]
    """Per stage (forward order): extra bytes alive at the peak of that stage's backward
    (recomputed activations under checkpointing, gradients of activations)."""
    optimizer_temporaries: Breakdown
    stage_acts_at_peak: list[Breakdown] | None = None
    """Per stage: what of its own activations is still alive at its backward peak (a layer's
    MLP backward has already freed the down-projection input); default: all of them."""
    stage_grads_at_peak: list[Breakdown] | None = None
    """Per stage: which of its own gradients exist at its backward peak (a layer's MLP
    backward has produced the down projection's gradient, not yet the others)."""
    grads_alive_in_forward: bool = False
    """Gradient accumulation: later micro-steps run forward with gradients allocated."""
    stage_grads_in_flight: list[Breakdown] | None = None
    """Per stage, with grads_alive_in_forward: the gradients the op at the stage's backward
    peak has just made, alive beside the `.grad` they go into until AccumulateGrad adds them
    in place (torch/csrc/autograd/functions/accumulate_grad.h `accumulateGrad`, Case 2.3:
    `variable_grad += new_grad` when `.grad` is defined and grad mode is off; without a
    `.grad` it steals them, Case 1.1, which stage_grads_at_peak counts). None: none."""
    labels: list[str] = field(default_factory=list)
    sharded_prefixes: tuple[str, ...] = ()
    """Term prefixes already cut to one rank by the parallel layer (parallel.rank_plan):
    ("",) for a whole plan, ("policy/",) once that plan is a job's policy section."""
    parallel: object | None = None
    """The parallel.ParallelReport of the rank this plan describes (None when trivial)."""
    in_backward: list[Breakdown] | None = None
    """Per stage, when the optimizer steps inside backward (components/optimizer_in_backward.py):
    what is alive beyond weights, states and earlier stages' activations while the stage's
    largest parameter steps (its gradient and the step's temporaries). Gradients are freed
    as they are made; the optimizer phase holds no gradients and no temporaries."""
    backward_end_transient: Breakdown | None = None
    """Alive once every backward stage has run, with all gradients, before the optimizer
    step (a pipeline schedule's merged outputs, parallel/pipeline.py)."""
    stage_forward_transient: list[Breakdown] | None = None
    """Per stage, held only while its forward runs, with the activations saved so far
    (float8 casts, components/float8.py); None: nothing beyond the saved activations."""
    stage_backward_moment: list[Breakdown | None] | None = None
    """Per stage, a second backward moment after its compute peak (None: none): what is
    alive then beyond the static set, the earlier stages' activations and the gradients of
    the stages before it (DeepSpeed ZeRO-2's first bucket reduction,
    parallel/engines.zero2_first_reduction)."""
    optimizer_sequence: tuple | None = None
    """The optimizer step's temporaries as a per-parameter sequence of (tensor, bytes) ops,
    bytes 0 for a free, for the event list of a one-GPU plan (components/optimizer.py
    adafactor_sequence); their largest moment is optimizer_temporaries'. None: one block."""
    step_grads: Breakdown | None = None
    """The gradients alive at the optimizer step when they are not all that backward made:
    DeepSpeed ZeRO-1 keeps only the rank's partition once backward ends
    (parallel/engines.zero1_step_grads); None: every stage's gradients."""


def _sum(parts) -> Breakdown:
    """The parts merged in order. Identical layers share one Breakdown object, so each
    distinct part is merged once, times its count, at its first place (the same terms in
    the same key order as merging every part)."""
    distinct, counts = _distinct(parts)
    out = Breakdown()
    for p in distinct:
        out.merge(p, times=counts[id(p)])
    return out


def _distinct(parts) -> tuple[list, dict[int, int]]:
    """The distinct parts (by identity) in order of first place, and each one's count."""
    counts: dict[int, int] = {}
    distinct = []
    for p in parts:
        key = id(p)
        if key in counts:
            counts[key] += 1
        else:
            counts[key] = 1
            distinct.append(p)
    return distinct, counts


_TERMS = attrgetter("terms")


def _each_total(parts: list[Breakdown]) -> list[int]:
    """[p.total() for p in parts], summed in C."""
    return list(map(sum, map(dict.values, map(_TERMS, parts))))


def _totals(parts: list[Breakdown], memo: dict[int, int]) -> list[int]:
    """Each part's total(), each distinct part (by identity) summed once; `memo` keeps the
    totals by id for the other lists of the same walk (a loop: building a dict of the ids
    costs more than looking each one up, measured in instructions under callgrind)."""
    get = memo.get
    out = []
    for b in parts:
        key = id(b)
        t = get(key)
        if t is None:
            t = memo[key] = b.total()
        out.append(t)
    return out


def walk(plan: StepPlan) -> list[Event]:
    return _walk(plan, True)


def peak_total(plan: StepPlan) -> int:
    """peak_event(walk(plan)).total, without building the events (parallel.rank_plan
    compares its pipeline stages by it)."""
    return max(_walk(plan, False))


def _walk(plan: StepPlan, build: bool) -> list:
    """The events in order (build) or only their totals. A merged sum is never built here:
    an event's parts are the Breakdowns it is the sum of (timeline._sum merges them in the
    same order when `live` is asked for), and its total is the sum of their totals, each
    taken once (identical layers share one Breakdown)."""
    n = len(plan.stage_acts)
    stage_grads = _stage_grads(plan, n)
    memo: dict[int, int] = {}

    def totals(parts: list) -> list[int]:
        return _totals(parts, memo)
    accum = plan.grads_alive_in_forward
    grads_t, acts_t = totals(stage_grads), totals(plan.stage_acts)
    own_acts = plan.stage_acts_at_peak or plan.stage_acts
    own_grads = plan.stage_grads_at_peak or stage_grads
    own_acts_t, own_grads_t = totals(own_acts), totals(own_grads)
    trans = plan.stage_backward_transient
    if accum and plan.stage_grads_in_flight is not None:
        trans = [Breakdown().merge(t).merge(g) for t, g in zip(trans, plan.stage_grads_in_flight)]
    trans_t = _each_total(trans)
    grads_tot = sum(grads_t)
    fwd_grads = list(stage_grads) if accum else []
    static_tot = plan.static.total()
    base_tot = static_tot + (grads_tot if accum else 0) + sum(acts_t) + plan.loss_saved.total()
    out: list = []

    def event(phase: str, label: str, parts, total: int) -> None:
        out.append(Event(phase, label, parts(), total) if build else total)
    at, peak = _stage_forward(plan, acts_t)
    if at is not None:
        event("forward", f"stage {at} forward",
              lambda: [plan.static, *fwd_grads, *plan.stage_acts[:at + 1], plan.stage_forward_transient[at]],
              static_tot + (grads_tot if accum else 0) + peak)
    event("forward", "end of forward (logits and loss)",
          lambda: [plan.static, *fwd_grads, *plan.stage_acts, plan.loss_saved, plan.forward_end_transient],
          base_tot + plan.forward_end_transient.total())
    event("backward", "loss backward (logits gradient)",
          lambda: [plan.static, *fwd_grads, *plan.stage_acts, plan.loss_saved, plan.loss_backward_transient],
          base_tot + plan.loss_backward_transient.total())
    # Backward, last stage first: earlier stages' activations and this stage's (less what
    # its own backward has freed by its peak) are alive, with the gradients made so far
    # and this stage's transients; then its activations go.
    prefix = [0, *accumulate(acts_t)]
    done: list[Breakdown] = list(fwd_grads)
    done_tot = grads_tot if accum else 0
    fused = plan.in_backward
    static, stage_acts, moments = plan.static, plan.stage_acts, plan.stage_backward_moment
    labels = plan.labels or [f"stage {i} backward" for i in range(n)]
    grows = not accum and fused is None
    backward: range | tuple = range(n - 1, -1, -1)
    if not build and not moments and fused is None:
        # totals only, no extra moments: the loop below in C (the same integers; stage i's
        # gradients made so far are those of stages i+1.., the last ones first)
        made = repeat(grads_tot) if accum else accumulate(chain((0,), reversed(grads_t)))
        own_g = repeat(0) if accum else reversed(own_grads_t)
        out.extend(map(sum, zip(repeat(static_tot), made, own_g, prefix[n - 1::-1],
                                reversed(own_acts_t), reversed(trans_t))))
        backward = ()
    for i in backward:
        total = static_tot + done_tot + prefix[i] + own_acts_t[i] + trans_t[i]
        if not accum:
            total += own_grads_t[i]
        if not build:
            out.append(total)
        elif accum:
            out.append(Event("backward", labels[i], [static, *done, *stage_acts[:i], own_acts[i], trans[i]], total))
        else:
            out.append(Event("backward", labels[i],
                             [static, *done, own_grads[i], *stage_acts[:i], own_acts[i], trans[i]], total))
        moment = moments[i] if moments else None
        if moment is not None:
            # the same stage's label: a later moment of its backward (translated like it)
            event("backward", labels[i], lambda: [static, *done, *stage_acts[:i], moment],
                  static_tot + done_tot + prefix[i] + moment.total())
        if fused is not None and fused[i].terms:
            # the stage's activations are gone; its largest parameter steps in the hook
            event("backward", f"stage {i} step in backward", lambda: [static, *stage_acts[:i], fused[i]],
                  static_tot + prefix[i] + fused[i].total())
        if grows:
            done.append(stage_grads[i])
            done_tot += grads_t[i]
    if plan.backward_end_transient is not None and fused is None:
        event("backward", "end of backward", lambda: [plan.static, *stage_grads, plan.backward_end_transient],
              static_tot + grads_tot + plan.backward_end_transient.total())
    if fused is not None:  # stepped in backward: optimizer.step() has nothing left to do
        event("optimizer", "optimizer step (done in backward)", lambda: [plan.static], static_tot)
    else:
        held = stage_grads if plan.step_grads is None else [plan.step_grads]
        event("optimizer", "optimizer step", lambda: [plan.static, *held, plan.optimizer_temporaries],
              static_tot + sum(totals(held)) + plan.optimizer_temporaries.total())
    return out


def _stage_forward(plan: StepPlan, acts_t: list[int]) -> tuple[int | None, int]:
    """The forward moment of the stage whose transient, over the activations saved up to
    it, is largest (all of the stage's own counted: the cast comes late in a layer):
    (stage, activations up to it plus its transient), or (None, 0) when no stage has one."""
    trans = plan.stage_forward_transient
    upto, best, at = 0, -1, None
    for i, t in enumerate(trans or ()):
        upto += acts_t[i]
        if t.terms and upto + t.total() > best:
            best, at = upto + t.total(), i
    return at, max(best, 0)


def _stage_grads(plan: StepPlan, n: int) -> list[Breakdown]:
    """Gradients aligned with forward stages (grads_by_stage is already per stage)."""
    grads = list(plan.grads_by_stage)
    if len(grads) != n:
        raise ValueError(f"grads_by_stage has {len(grads)} stages, activations {n}")
    return grads


def phase_peaks(events: list[Event]) -> dict[str, int]:
    out: dict[str, int] = {"forward": 0, "backward": 0, "optimizer": 0}
    for e in events:
        out[e.phase] = max(out[e.phase], e.total)
    return out


def peak_event(events: list[Event]) -> Event:
    return max(events, key=lambda e: e.total)

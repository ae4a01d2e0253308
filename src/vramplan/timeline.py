"""Live memory through one steady-state training step; its maximum is the peak.

The step is a list of events (moments where memory is at a local maximum). Each event is a
Breakdown of what is alive then; the peak is the largest. Order follows what autograd does:
forward saves activations layer by layer, the loss adds the logits, backward walks the
layers in reverse freeing each layer's saved tensors and adding its parameter gradients,
then the optimizer step adds its temporaries. Steady state means optimizer states already
exist during forward and backward (they are created in the first step and kept).
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
    stage_forward_transient: list[Breakdown] | None = None
    """Per stage, held only while its forward runs, with the activations saved so far
    (float8 casts, components/float8.py); None: nothing beyond the saved activations."""


def _sum(parts) -> Breakdown:
    out = Breakdown()
    for p in parts:
        out.merge(p)
    return out


def walk(plan: StepPlan) -> list[Event]:
    n = len(plan.stage_acts)
    stage_grads = _stage_grads(plan, n)
    all_grads = _sum(stage_grads)
    fwd_grads = all_grads if plan.grads_alive_in_forward else Breakdown()
    acts = _sum(plan.stage_acts)
    base = [plan.static, fwd_grads, acts, plan.loss_saved]
    events = _stage_forward(plan, base[:2])
    events += [Event("forward", "end of forward (logits and loss)", base + [plan.forward_end_transient]),
              Event("backward", "loss backward (logits gradient)", base + [plan.loss_backward_transient])]
    # Backward, last stage first: earlier stages' activations and this stage's (less what
    # its own backward has freed by its peak) are alive, with the gradients made so far
    # and this stage's transients; then its activations go.
    own_acts = plan.stage_acts_at_peak or plan.stage_acts
    own_grads = plan.stage_grads_at_peak or stage_grads
    acts_tot = [b.total() for b in plan.stage_acts]
    prefix = [0]
    for t in acts_tot:
        prefix.append(prefix[-1] + t)
    static_tot, accum = plan.static.total(), plan.grads_alive_in_forward
    done: list[Breakdown] = [fwd_grads]
    done_tot = fwd_grads.total()
    fused = plan.in_backward
    for i in range(n - 1, -1, -1):
        mine = [] if accum else [own_grads[i]]
        parts = [plan.static, *done, *mine, *plan.stage_acts[:i], own_acts[i], plan.stage_backward_transient[i]]
        total = (static_tot + done_tot + sum(b.total() for b in mine) + prefix[i] + own_acts[i].total()
                 + plan.stage_backward_transient[i].total())
        events.append(Event("backward", plan.labels[i] if plan.labels else f"stage {i} backward", parts, total))
        if fused is not None and fused[i].terms:
            # the stage's activations are gone; its largest parameter steps in the hook
            events.append(Event("backward", f"stage {i} step in backward",
                                [plan.static, *plan.stage_acts[:i], fused[i]]))
        if not accum and fused is None:
            done.append(stage_grads[i])
            done_tot += stage_grads[i].total()
    if fused is not None:  # stepped in backward: optimizer.step() has nothing left to do
        events.append(Event("optimizer", "optimizer step (done in backward)", [plan.static]))
    else:
        events.append(Event("optimizer", "optimizer step", [plan.static, all_grads, plan.optimizer_temporaries]))
    return events


def _stage_forward(plan: StepPlan, base: list[Breakdown]) -> list[Event]:
    """The forward moment of the stage whose transient, over the activations saved up to
    it, is largest (all of the stage's own counted: the cast comes late in a layer)."""
    trans = plan.stage_forward_transient
    if not trans:
        return []
    upto, best, at = 0, -1, 0
    for i, (acts, t) in enumerate(zip(plan.stage_acts, trans)):
        upto += acts.total()
        if t.terms and upto + t.total() > best:
            best, at = upto + t.total(), i
    if best < 0:
        return []
    return [Event("forward", f"stage {at} forward", base + plan.stage_acts[:at + 1] + [trans[at]])]


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

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


@dataclass(slots=True)
class Event:
    phase: str
    """forward | backward | optimizer."""
    label: str
    live: Breakdown

    @property
    def total(self) -> int:
        return self.live.total()


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


def _sum(parts) -> Breakdown:
    out = Breakdown()
    for p in parts:
        out.merge(p)
    return out


def walk(plan: StepPlan) -> list[Event]:
    events: list[Event] = []
    all_grads = _sum(plan.grads_by_stage)
    fwd_grads = all_grads if plan.grads_alive_in_forward else Breakdown()
    acts = _sum(plan.stage_acts)
    base = Breakdown().merge(plan.static).merge(fwd_grads)
    events.append(Event("forward", "end of forward (logits and loss)",
                        Breakdown().merge(base).merge(acts).merge(plan.loss_saved)
                        .merge(plan.forward_end_transient)))
    events.append(Event("backward", "loss backward (logits gradient)",
                        Breakdown().merge(base).merge(acts).merge(plan.loss_saved)
                        .merge(plan.loss_backward_transient)))
    # Backward, last stage first: the stage's activations are still alive, its gradient
    # and its transients are added; then its activations go.
    grads_so_far = Breakdown().merge(fwd_grads)
    n = len(plan.stage_acts)
    stage_grads = _stage_grads(plan, n)
    own_acts = plan.stage_acts_at_peak or plan.stage_acts
    own_grads = plan.stage_grads_at_peak or stage_grads
    for i in range(n - 1, -1, -1):
        live = Breakdown().merge(plan.static).merge(grads_so_far)
        if not plan.grads_alive_in_forward:
            live.merge(own_grads[i])
        live.merge(_sum(plan.stage_acts[:i])).merge(own_acts[i]).merge(plan.stage_backward_transient[i])
        if not plan.grads_alive_in_forward:
            grads_so_far.merge(stage_grads[i])
        events.append(Event("backward", plan.labels[i] if plan.labels else f"stage {i} backward", live))
    events.append(Event("optimizer", "optimizer step",
                        Breakdown().merge(plan.static).merge(all_grads).merge(plan.optimizer_temporaries)))
    return events


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

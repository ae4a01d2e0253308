"""Put a multi-model step together: the trained model's timeline (timeline.walk) with the
frozen models' weights in the static set and their forwards inserted where the trainer
runs them, then the same device-level terms as a single-model estimate."""
from __future__ import annotations

from dataclasses import dataclass, field

from vramplan.breakdown import Breakdown
from vramplan.components.runtime import blas_workspace_terms
from vramplan.model import ModelDesc
from vramplan.spec import Backend, JobSpec
from vramplan.timeline import Event, StepPlan, peak_event, walk


@dataclass(slots=True)
class Step:
    """A job's step: one trained plan (already prefixed) plus what the other models add."""

    plan: StepPlan
    before: list[tuple[str, str, Breakdown]] = field(default_factory=list)
    """(phase, label, extra) events before the trained forward (generation, encoders)."""
    after_forward: list[tuple[str, str, Breakdown, bool]] = field(default_factory=list)
    """(phase, label, extra, loss_saved_alive) events after the trained forward, with its
    saved activations alive (reference forward, teacher forward, the loss)."""
    before_gradients: bool = False
    """The `before` events run once per accumulation cycle, at its first micro-step, when no
    gradient exists yet (TRL's generation and scoring: `_prepare_inputs` generates for
    steps_per_generation = gradient_accumulation_steps micro-steps at once); else they run at
    every micro-step, with the gradients of the earlier ones alive."""


def _sum(parts) -> Breakdown:
    out = Breakdown()
    for p in parts:
        out.merge(p)
    return out


def merge_trained(plan: StepPlan, other: StepPlan, role: str) -> None:
    """A second trained model (PPO's critic, a trained role of a models list) into `plan`.
    Its graph is built first, so its backward runs after the policy's: one backward stage
    holding all of its saved activations and gradients, before the policy's first."""
    plan.static.merge(other.static)
    if plan.step_grads is not None or other.step_grads is not None:  # ZeRO-1's partitions
        plan.step_grads = Breakdown().merge(plan.step_grads or _sum(plan.grads_by_stage)).merge(
            other.step_grads or _sum(other.grads_by_stage))
    plan.stage_acts.insert(0, _sum(other.stage_acts))
    plan.grads_by_stage.insert(0, _sum(other.grads_by_stage))
    plan.stage_backward_transient.insert(0, other.stage_backward_transient[-1])
    plan.labels.insert(0, f"{role} backward")
    if plan.stage_acts_at_peak is not None:
        plan.stage_acts_at_peak.insert(0, plan.stage_acts[0])
    if plan.stage_grads_at_peak is not None:
        plan.stage_grads_at_peak.insert(0, plan.grads_by_stage[0])
    plan.loss_saved.merge(other.loss_saved)
    plan.optimizer_temporaries.merge(other.optimizer_temporaries)
    plan.sharded_prefixes += other.sharded_prefixes


def events_of(step: Step) -> list[Event]:
    plan = step.plan
    walked = walk(plan)
    fwd_grads = _sum(plan.grads_by_stage) if plan.grads_alive_in_forward else Breakdown()
    base = Breakdown().merge(plan.static).merge(fwd_grads)
    saved = Breakdown().merge(base).merge(_sum(plan.stage_acts))
    first = Breakdown().merge(plan.static) if step.before_gradients else base
    before = [Event(ph, label, Breakdown().merge(first).merge(extra)) for ph, label, extra in step.before]
    after = [Event(ph, label, Breakdown().merge(saved).merge(plan.loss_saved if with_loss else Breakdown())
                   .merge(extra)) for ph, label, extra, with_loss in step.after_forward]
    return before + walked[:1] + after + walked[1:]


def phase_peaks(events: list[Event]) -> dict[str, int]:
    """Peak per phase; multi-model steps add phases (generation) to the single-model three."""
    out: dict[str, int] = {"forward": 0, "backward": 0, "optimizer": 0}
    for e in events:
        out[e.phase] = max(out.get(e.phase, 0), e.total)
    return out


def finish(spec: JobSpec, desc: ModelDesc, step: Step, *, num_params: int | dict[str, int],
           trainable_params: int, gpu=None, notes: list[str] | None = None, floor: Breakdown | None = None):
    """An Estimate from the step's events (same device-level terms as estimation.py, from device.py).
    `num_params`: the total, or the count per model keyed like the breakdown's sections
    (`policy`, `reference`, ...), which the Estimate keeps as `models`.
    `floor`: memory held outside the allocator's live tensors (a colocated vLLM pool)."""
    models = dict(num_params) if isinstance(num_params, dict) else {}
    num_params = sum(models.values()) if models else num_params
    from vramplan.device import device_levels
    from vramplan.result import Estimate
    from vramplan.jobs.sharding import shard_step
    par = shard_step(step, spec, desc, getattr(desc, "num_layers", None) or len(step.plan.stage_acts))
    if spec.backend is Backend.CUDA:
        for key, value in blas_workspace_terms(gpu.name if gpu else None):
            step.plan.static.add(key, value)
    if floor:
        step.plan.static.merge(floor)
    events = events_of(step)
    top = peak_event(events)
    components = top.live
    peak = components.total()
    phases = phase_peaks(events)
    phases[top.phase] = peak
    reserved, device = device_levels(spec, gpu, events, top)
    return Estimate(spec=spec, model=desc, num_params=num_params, trainable_params=trainable_params,
                    peak_allocated_bytes=peak, peak_phase=top.phase, peak_event=top.label,
                    phases=phases, components=components, reserved_bytes=reserved,
                    device_bytes=device, events=events, gpu=gpu, models=models,
                    notes=list(notes or []) + (par.notes if par else []), parallel=par)

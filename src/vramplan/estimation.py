"""estimate(spec) -> Estimate: one GPU's memory through a training step, in named terms."""
from __future__ import annotations

from dataclasses import dataclass, field

from vramplan.breakdown import Breakdown
from vramplan.components.activations import ActivationPlan, plan_activations
from vramplan.components.memo import cached
from vramplan.components.optimizer import optimizer_states, step_temporaries
from vramplan.components.runtime import (
    CUDA_CONTEXT_DEFAULT, cublas_workspace_bytes, reserved_from_allocated,
)
from vramplan.components.trainable import ParamSet, param_set
from vramplan.components.weights import (
    gradient_stages, gradient_stages_at_peak, tied_embedding_grad_temp, weight_terms,
)
from vramplan.model import ModelDesc
from vramplan.spec import Backend, JobSpec, Task
from vramplan.timeline import Event, StepPlan, peak_event, phase_peaks, walk
from vramplan.units import nbytes

SCHEMA_VERSION = 1


@dataclass(slots=True)
class Estimate:
    spec: JobSpec
    model: ModelDesc
    num_params: int
    trainable_params: int
    peak_allocated_bytes: int
    peak_phase: str
    peak_event: str
    phases: dict[str, int]
    components: Breakdown
    """What is alive at the peak, by term."""
    reserved_bytes: int
    device_bytes: int
    """What nvidia-smi would show: reserved plus the CUDA context (0 on the cpu backend)."""
    events: list[Event] = field(repr=False, default_factory=list)
    gpu: object | None = None
    notes: list[str] = field(default_factory=list)
    parallel: object | None = None
    """vramplan.parallel.ParallelReport when spec.parallel is not trivial (else None)."""
    managed_bytes: int = 0
    """CUDA managed memory (bitsandbytes paged optimizer state): outside the caching
    allocator's statistics, inside nvidia-smi's figure while resident."""

    @property
    def fits(self) -> bool | None:
        if self.gpu is None:
            return None
        return self.device_bytes <= self.gpu.memory_bytes

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.gpu is None else self.gpu.memory_bytes - self.device_bytes

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "model": {"name": self.model.name, "num_params": self.num_params,
                      "trainable_params": self.trainable_params},
            "spec": self.spec.to_dict(),
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_phase": self.peak_phase,
            "peak_event": self.peak_event,
            "phases": dict(self.phases),
            "components": self.components.to_dict(),
            "reserved_bytes": self.reserved_bytes,
            "device_bytes": self.device_bytes,
            "gpu": None if self.gpu is None else {"name": self.gpu.name, "memory_bytes": self.gpu.memory_bytes},
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "managed_bytes": self.managed_bytes,
            "notes": list(self.notes),
            **self._parallel_dict(),
        }

    def _parallel_dict(self) -> dict:
        if self.parallel is None:
            return {}
        return {"parallel": self.parallel.to_dict(), "communication": dict(self.parallel.communication),
                "host_bytes": {"per_rank": self.parallel.host.total(), "per_node": self.parallel.host_per_node,
                               "terms": self.parallel.host.to_dict()}}


def estimate(spec: JobSpec) -> Estimate:
    """Resolve the model and GPU (edges: catalog, file or cache), then the pure core."""
    from vramplan.catalog import find_gpu
    from vramplan.spec.tasks import needs_several_models
    gpu = find_gpu(spec.gpu) if spec.gpu else None
    if needs_several_models(spec):  # several models: per-model sections (vramplan.jobs)
        from vramplan.jobs import estimate_job
        return estimate_job(spec, gpu)
    from vramplan.parallel.host import resolve_local
    from vramplan.sources import resolve_model
    spec = resolve_local(spec)  # parallel.extras.host_memory_bytes: "local" -> this machine's RAM
    return estimate_model(resolve_model(spec), spec, gpu)


def estimate_model(desc: ModelDesc, spec: JobSpec, gpu=None) -> Estimate:
    params = param_set(desc, spec)
    managed = Breakdown()
    par = None
    if spec.task is Task.INFERENCE:
        events = _inference_events(desc, spec, params, gpu)
    else:
        acts = plan_activations(desc, spec, params)
        plan = _step_plan(desc, spec, params, acts, managed)
        if not spec.parallel.is_trivial or spec.num_gpus > 1:
            from vramplan.parallel import rank_plan
            plan, par = rank_plan(desc, spec, params, plan)
        if spec.backend is Backend.CUDA:
            plan.static.add("runtime/cublas_workspace", cublas_workspace_bytes(gpu.name if gpu else None))
        events = walk(plan)
    top = peak_event(events)
    components = top.live
    peak = components.total()
    phases = phase_peaks(events)
    phases[top.phase] = peak
    reserved, device = device_levels(spec, gpu, events, top, managed.total())
    notes = [f"LoRA target or modules_to_save {t!r} matches no module of {desc.name}; "
             "PEFT would ignore it" for t in params.unmatched_targets]
    return Estimate(spec=spec, model=desc, num_params=desc.num_params(),
                    trainable_params=params.numel(trainable=True), peak_allocated_bytes=peak,
                    peak_phase=top.phase, peak_event=top.label, phases=phases,
                    components=components, reserved_bytes=reserved, device_bytes=device,
                    events=events, gpu=gpu, notes=notes + (par.notes if par else []), parallel=par, managed_bytes=managed.total())


def _group(bd: Breakdown, group: str) -> list[int]:
    """Values of the terms in `group`, with or without a model prefix (multi-model jobs key
    them `policy/logits/...`)."""
    return [v for k, v in bd if k.startswith(group + "/") or f"/{group}/" in k]


def device_levels(spec: JobSpec, gpu, events: list[Event], top: Event, managed: int = 0) -> tuple[int, int]:
    """(max_memory_reserved, nvidia-smi) from the live peak on the CUDA backend (equal to the
    peak on cpu): the allocator's reserve (components/runtime.py) around the largest single
    logits-sized block and the activation bytes churned at the peak and at the start of
    backward, then the CUDA context and managed (paged) memory resident on the GPU."""
    peak = top.live.total()
    if spec.backend is not Backend.CUDA:
        return peak, peak
    ends = [e for e in events if e.label.startswith(("end of forward", "loss backward"))]
    largest = max((v for e in ends for v in _group(e.live, "logits")), default=0)
    loss_bwd = [e for e in ends if e.label.startswith("loss backward")]
    churn = max(sum(_group(e.live, "activations")) + sum(_group(e.live, "backward")) for e in [top, *loss_bwd])
    reserved = reserved_from_allocated(peak, largest, churn)
    context = getattr(gpu, "cuda_context_bytes_typical", None) or CUDA_CONTEXT_DEFAULT
    return reserved, reserved + context + managed


def _inference_events(desc: ModelDesc, spec: JobSpec, params: ParamSet, gpu) -> list[Event]:
    from vramplan.components.inference import inference_terms
    persistent, transient = inference_terms(desc, spec, spec.max_new_tokens or 0)
    live = weight_terms(spec, params).merge(persistent).merge(transient)
    live.add("batch/input_ids", nbytes(spec.micro_batch_size * spec.seq_len, "int64"))
    if spec.backend is Backend.CUDA:
        live.add("runtime/cublas_workspace", cublas_workspace_bytes(gpu.name if gpu else None))
    return [Event("forward", "no-grad forward", live)]


def _optimizer_extras(spec: JobSpec, params: ParamSet, acts: ActivationPlan) -> Breakdown:
    out = cached(params, ("temporaries", spec.optimizer, spec.optimizer_impl, spec.precision, spec.weight_decay),
                 lambda: step_temporaries(spec, params))
    if acts.input_leaf_bytes:
        # the loss (and so its graph, holding the input leaf and its gradient) is kept until
        # after optimizer.step() in a plain training loop; HF Trainer detaches it earlier.
        out.add("activations/input_leaf", acts.input_leaf_bytes).add("gradients/input_leaf", acts.input_leaf_bytes)
    return out


def _stage_breakdown(items: list[tuple[str, int]], prefix: str) -> Breakdown:
    out = Breakdown()
    for name, size in items:
        out.add(f"{prefix}/{name}", size)
    return out


def _step_plan(desc: ModelDesc, spec: JobSpec, params: ParamSet, acts: ActivationPlan,
               managed: Breakdown | None = None) -> StepPlan:
    """`managed` receives paged optimizer state (outside the allocator); without it, that
    state stays with the rest (multi-model jobs)."""
    opt_key = ("states", spec.optimizer, spec.optimizer_impl, spec.precision, spec.backend, spec.momentum)
    static = cached(params, ("weights", spec.quantization), lambda: weight_terms(spec, params))
    for key, value in cached(params, opt_key, lambda: optimizer_states(spec, params)):
        # paged optimizer state is CUDA managed memory, outside the caching allocator
        (managed if managed is not None and key.startswith("optimizer_paged") else static).add(key, value)
    static.add("batch/input_ids", nbytes(spec.micro_batch_size * spec.seq_len, "int64"))
    # registered buffers that are no parameters (GPTBigCode's causal-mask table)
    static.add("weights/buffers", getattr(desc, "buffer_bytes", 0))
    grads = cached(params, ("grads", spec.precision), lambda: gradient_stages(desc, spec, params))
    grads_at_peak = cached(params, ("grads_at_peak", spec.precision),
                           lambda: gradient_stages_at_peak(desc, spec, params))
    stage_acts, at_peak, transients, labels = [], [], [], []
    n = len(acts.stages)
    # Layers with one signature share their saved list; build each list's breakdowns once
    # (the timeline only reads them).
    built: dict[tuple, tuple[Breakdown, Breakdown]] = {}
    for i, st in enumerate(acts.stages):
        group = "activations/layers" if st.label.startswith("layer") else f"activations/{st.label}"
        key = (id(st.saved), group, st.freed_before_peak)
        if key not in built:
            built[key] = (_stage_breakdown(st.saved, group),
                          _stage_breakdown([x for x in st.saved if x[0] not in st.freed_before_peak], group))
        stage_acts.append(built[key][0])
        at_peak.append(built[key][1])
        t = Breakdown()
        if st.recompute:
            rkey = (id(st.recompute), "recompute", st.freed_before_peak)
            if rkey not in built:
                built[rkey] = (_stage_breakdown([x for x in st.recompute if x[0] not in st.freed_before_peak],
                                                "activations/recomputed_layer"), Breakdown())
            t.merge(built[rkey][0])
        if st.label.startswith("layer"):
            t.merge(acts.layer_backward_transient)
        elif i == n - 1:
            t.merge(acts.head_backward_transient)
        elif i == 0:
            t.merge(tied_embedding_grad_temp(desc, spec, params))
            if acts.input_leaf_bytes:
                t.add("activations/input_leaf", acts.input_leaf_bytes).add("gradients/input_leaf", acts.input_leaf_bytes)
        transients.append(t)
        labels.append(f"{st.label} backward")
    return StepPlan(static=static, grads_by_stage=grads, stage_acts=stage_acts,
                    loss_saved=acts.loss_saved, forward_end_transient=acts.forward_end_transient,
                    loss_backward_transient=acts.loss_backward_transient,
                    stage_backward_transient=transients, stage_acts_at_peak=at_peak,
                    stage_grads_at_peak=grads_at_peak,
                    optimizer_temporaries=_optimizer_extras(spec, params, acts),
                    grads_alive_in_forward=spec.grad_accum_steps > 1, labels=labels)

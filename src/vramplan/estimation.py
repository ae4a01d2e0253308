"""estimate(spec) -> Estimate: one GPU's memory through a training step, in named terms."""
from __future__ import annotations

from dataclasses import dataclass, field

from vramplan.breakdown import Breakdown
from vramplan.components.activations import plan_activations
from vramplan.components.dtypes import resolve_load_dtype, stated_dtypes
from vramplan.components.runtime import (
    blas_workspace_terms, cuda_context_bytes, nccl_terms, process_groups, reserved_from_allocated,
)
from vramplan.components.trainable import ParamSet, param_set
from vramplan.components.weights import weight_terms
from vramplan.i18n import Msg
from vramplan.model import ModelDesc
from vramplan.spec import Backend, JobSpec, Task
from vramplan.step.build import build_step, rank_step
from vramplan.step.pieces import tensor_pieces
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
    models: dict[str, int] = field(default_factory=dict)
    """Parameters per model of a multi-model job, keyed like the breakdown's sections
    (`policy`, `reference`, ...); empty for a single model. num_params is their sum."""
    replay: object | None = field(repr=False, default=None)
    """Callable(conf=None) -> vramplan.allocator.AllocatorResult: the caching allocator
    replaying the step's tensor events (CUDA backend, single-model jobs); run on demand."""
    lengths: object | None = field(repr=False, default=None)
    """vramplan.step.lengths.LengthsReplay when the spec gives a `lengths` distribution
    (dynamic padding): the run's steps replayed in order, longest-first and capped."""

    @property
    def allocator(self):
        """The allocator model's replay with the spec's alloc_conf (None where not modelled)."""
        return None if self.replay is None else self.replay()

    @property
    def dtypes(self):
        """The effective dtypes taken (weights, gradients, optimizer states, master, compute)."""
        return stated_dtypes(self.spec)

    @property
    def fits(self) -> bool | None:
        if self.gpu is None:
            return None
        return self.device_bytes <= self.gpu.memory_bytes

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.gpu is None else self.gpu.memory_bytes - self.device_bytes

    @property
    def device_terms(self) -> Breakdown:
        """What nvidia-smi counts beyond reserved: runtime/cuda_context, runtime/nccl/<group>,
        managed/optimizer_paged (device_bytes = reserved_bytes + their total)."""
        return outside_allocator(self.spec, self.gpu, self.managed_bytes)

    @property
    def bounds(self) -> dict[str, list[int]] | None:
        """{"allocated" | "reserved" | "device": [lo, hi]} in bytes: the relative error
        interval of each metric measured on published GPU runs (catalog/bounds.json), around
        this estimate. None on the cpu backend (the CPU estimate is exact to 0.01%)."""
        if self.spec.backend is not Backend.CUDA:
            return None
        from vramplan.bounds import bounds_around
        return bounds_around({"allocated": self.peak_allocated_bytes, "reserved": self.reserved_bytes,
                              "device": self.device_bytes})

    @property
    def verdict(self) -> str | None:
        """"fits", "fits only at the low end" (the estimate fits, its upper bound does not) or
        "does not fit", on the GPU's memory; None without a GPU."""
        if self.gpu is None:
            return None
        from vramplan.bounds import verdict
        bounds = self.bounds
        return verdict(self.device_bytes, None if bounds is None else bounds["device"][1], self.gpu.memory_bytes)

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "model": {"name": self.model.name, "num_params": self.num_params,
                      "trainable_params": self.trainable_params,
                      **({"per_model": dict(self.models)} if self.models else {})},
            "spec": self.spec.to_dict(),
            "stack": {**self.spec.stack.to_dict(), "load_dtype": self.spec.load_dtype},
            "dtypes": self.dtypes.to_dict(),
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_phase": self.peak_phase,
            "peak_event": self.peak_event,
            "phases": dict(self.phases),
            "components": self.components.to_dict(),
            "reserved_bytes": self.reserved_bytes,
            "device_bytes": self.device_bytes,
            "device_terms": self.device_terms.to_dict(),
            "bounds": self.bounds,
            "verdict": self.verdict,
            "gpu": None if self.gpu is None else {"name": self.gpu.name, "memory_bytes": self.gpu.memory_bytes},
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "managed_bytes": self.managed_bytes,
            "notes": list(self.notes),
            **self._allocator_dict(),
            **({"lengths": self.lengths.to_dict()} if self.lengths is not None else {}),
            **self._parallel_dict(),
        }

    def _repr_html_(self) -> str:
        """Notebook display: the breakdown as an HTML table (report/answers.py)."""
        from vramplan.report.answers import estimate_table
        return estimate_table(self).to_html()

    def _allocator_dict(self) -> dict:
        alloc = self.allocator
        if alloc is None:
            return {}
        return {"allocator": {**alloc.to_dict(), "basis": (
            "replay of the step's tensor events through the caching-allocator model; the "
            "estimate's reserved_bytes is the fitted reserve plus what alloc_conf changes in this replay")}}

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
    from vramplan.spec import SpecError
    from vramplan.validity import check_size
    try:
        gpu = find_gpu(spec.gpu) if spec.gpu else None
    except KeyError as exc:  # catalog.UnknownNameError: its message suggests the nearest name
        raise SpecError("gpu", str(exc)) from None
    if needs_several_models(spec):  # several models: per-model sections (vramplan.jobs)
        from vramplan.jobs import estimate_job
        est = estimate_job(spec, gpu)
    else:
        from vramplan.parallel.host import resolve_local
        from vramplan.sources import resolve_model
        from vramplan.importers.lengths import resolve_lengths
        spec = resolve_local(spec)  # parallel.extras.host_memory_bytes: "local" -> this machine's RAM
        spec = resolve_lengths(spec)  # lengths.lengths_file: read and summarised here, at the edge
        est = estimate_model(resolve_model(spec), spec, gpu)
    check_size(est.device_bytes, est.spec)
    return est


def estimate_model(desc: ModelDesc, spec: JobSpec, gpu=None) -> Estimate:
    spec = resolve_load_dtype(spec, desc.checkpoint_dtype)
    from vramplan.validity import check_job
    checked = check_job(desc, spec)  # SpecError for a job the libraries refuse
    params = param_set(desc, spec)
    managed = Breakdown()
    par = None
    if spec.task is Task.INFERENCE:
        events = _inference_events(desc, spec, params, gpu)
    else:
        plan = rank_step(desc, spec, params, plan_activations(desc, spec, params), managed)
        par = plan.parallel
        if spec.backend is Backend.CUDA:
            for key, value in blas_workspace_terms(gpu.name if gpu else None):
                plan.static.add(key, value)
        events = walk(plan)
    top = peak_event(events)
    components = top.live
    peak = components.total()
    phases = phase_peaks(events)
    phases[top.phase] = peak
    replayer, conf_delta = None, 0
    if spec.backend is Backend.CUDA and spec.task is not Task.INFERENCE:
        replayer = allocator_replayer(spec, gpu, plan, desc, params if par is None else None, managed.total())
        if _changes_placement(spec.alloc_conf):
            conf_delta = replayer().reserved_bytes - replayer(default=True).reserved_bytes
    lengths = None
    if replayer is not None and spec.lengths is not None:
        lengths = _lengths_replay(spec, gpu, desc, params, par is None, managed.total())
    reserved, device = device_levels(spec, gpu, events, top, managed.total(), conf_delta)
    if lengths is not None:
        extra = lengths.applied(reserved, _replay_capacity(spec, gpu, managed.total()))
        reserved, device = reserved + extra, device + extra
    notes = checked + [Msg("LoRA target or modules_to_save {target} matches no module of {model}; PEFT would ignore it",
                           target=repr(t), model=desc.name) for t in params.unmatched_targets]
    if spec.lengths is not None:
        from vramplan.step.lengths import lengths_notes
        notes += lengths_notes(spec, lengths)
    if spec.alloc_conf and "cudaMallocAsync" in spec.alloc_conf:
        notes.append(Msg("alloc_conf backend:cudaMallocAsync: the driver's memory pool is not modelled; "
                         "reserved memory is estimated as for PyTorch's caching allocator"))
    return Estimate(spec=spec, model=desc, num_params=desc.num_params(),
                    trainable_params=params.numel(trainable=True), peak_allocated_bytes=peak,
                    peak_phase=top.phase, peak_event=top.label, phases=phases,
                    components=components, reserved_bytes=reserved, device_bytes=device,
                    events=events, gpu=gpu, notes=notes + (par.notes if par else []), parallel=par,
                    managed_bytes=managed.total(), replay=replayer, lengths=lengths)


def _group(bd: Breakdown, group: str) -> list[int]:
    """Values of the terms in `group`, with or without a model prefix (multi-model jobs key
    them `policy/logits/...`)."""
    return [v for k, v in bd if k.startswith(group + "/") or f"/{group}/" in k]


def device_levels(spec: JobSpec, gpu, events: list[Event], top: Event, managed: int = 0,
                  conf_delta: int = 0) -> tuple[int, int]:
    """(max_memory_reserved, nvidia-smi) on the CUDA backend (both equal to the live peak on
    cpu): allocated plus the allocator's reserve (`reserved_bytes`), then the CUDA context
    and managed (paged) memory resident on the GPU."""
    peak = top.live.total()
    if spec.backend is not Backend.CUDA:
        return peak, peak
    reserved = reserved_bytes(events, top, conf_delta)
    return reserved, reserved + outside_allocator(spec, gpu, managed).total()


def reserved_bytes(events: list[Event], top: Event, conf_delta: int = 0) -> int:
    """max_memory_reserved: the live peak plus the allocator's reserve around the largest
    single logits-sized block and the activation bytes churned at the peak and at the start
    of backward (components/runtime.py), plus `conf_delta`, what the spec's alloc_conf
    changes in the allocator model's replay (vramplan.allocator) against PyTorch's defaults.

    The replay's own reserve is not used as the level: its event list holds the saved
    tensors and the modelled transients, not every temporary of the real backward, and on
    the published GPU rows it is less accurate than this fitted reserve (single-model
    nvidia-smi rows: median |err| 6.9% against 2.4%, bench/allocator/score_replay.py)."""
    ends = [e for e in events if e.label.startswith(("end of forward", "loss backward"))]
    largest = max((v for e in ends for v in _group(e.live, "logits")), default=0)
    loss_bwd = [e for e in ends if e.label.startswith("loss backward")]
    churn = max(sum(_group(e.live, "activations")) + sum(_group(e.live, "backward")) for e in [top, *loss_bwd])
    return reserved_from_allocated(top.live.total(), largest, churn) + conf_delta


def _changes_placement(alloc_conf: str | None) -> bool:
    """Whether alloc_conf moves blocks in the caching allocator (the pinned-memory and
    locking options do not; backend:cudaMallocAsync bypasses it and is not modelled)."""
    from vramplan.spec.alloc_conf import AllocConf, parse_alloc_conf
    conf = parse_alloc_conf(alloc_conf)
    return conf.backend == "native" and conf != AllocConf()


def step_events(spec: JobSpec):
    """The tensor events (vramplan.step.StepEvents) of one training step of a single-model,
    single-GPU job, tensors split per parameter: what the allocator model replays, and
    what bench/allocator/replay_cuda.py replays on a real GPU."""
    from vramplan.sources import resolve_model
    from vramplan.step import build_events
    desc = resolve_model(spec)
    params = param_set(desc, spec)
    plan = build_step(desc, spec, params, plan_activations(desc, spec, params))
    if spec.backend is Backend.CUDA:
        from vramplan.catalog import find_gpu
        gpu = find_gpu(spec.gpu) if spec.gpu else None
        for key, value in blas_workspace_terms(gpu.name if gpu else None):
            plan.static.add(key, value)
    return build_events(plan, tensor_pieces(desc, params, plan))


def allocator_replayer(spec: JobSpec, gpu, plan: StepPlan, desc: ModelDesc, params: ParamSet | None,
                       outside: int = 0):
    """A function (default=False) -> AllocatorResult: the caching allocator
    (vramplan.allocator) replaying the step's tensor events (vramplan.step) over several
    steps with spec.alloc_conf's options (or PyTorch's defaults). `params`: split the
    persistent terms and gradients into per-parameter tensors (single-GPU plans). With a
    GPU named, the allocator may reserve its memory less the CUDA context and `outside`
    (managed memory): a step that needs more frees its cached blocks and retries, as malloc
    does; one that still does not fit reports its unconstrained reserve."""
    from vramplan.allocator import replay
    from vramplan.spec.alloc_conf import parse_alloc_conf
    from vramplan.step import build_events
    capacity = _replay_capacity(spec, gpu, outside)
    ops: list = []

    def run(default: bool = False):
        if not ops:
            pieces = tensor_pieces(desc, params, plan) if params is not None else None
            ops.extend(build_events(plan, pieces).compact())
        conf = parse_alloc_conf(None if default else spec.alloc_conf)
        result = replay(ops[0], ops[1], conf, capacity)
        return replay(ops[0], ops[1], conf, None) if result.out_of_memory else result
    return run


def _replay_capacity(spec: JobSpec, gpu, outside: int = 0) -> int | None:
    return None if gpu is None else gpu.memory_bytes - outside_allocator(spec, gpu).total() - outside


def _lengths_replay(spec: JobSpec, gpu, desc: ModelDesc, params: ParamSet, split: bool, outside: int):
    """Dynamic padding (spec.lengths): the run's steps of different lengths through one
    allocator (vramplan.step.lengths); its extra_bytes joins the reserve like conf_delta."""
    from vramplan.spec import SpecError
    from vramplan.spec.alloc_conf import parse_alloc_conf
    from vramplan.step.lengths import length_ops, replay_lengths
    if not spec.lengths.resolved:
        raise SpecError("lengths.lengths_file", "not read yet: vramplan.estimate and the CLI read it "
                        "(vramplan.importers.lengths.resolve_lengths)")
    setup, ops_for = length_ops(desc, spec, params, split, blas_workspace_terms(gpu.name if gpu else None))
    return replay_lengths(spec.lengths, spec.micro_batch_size, spec.seq_len, setup, ops_for,
                          parse_alloc_conf(spec.alloc_conf), _replay_capacity(spec, gpu, outside))


def outside_allocator(spec: JobSpec, gpu, managed: int = 0) -> Breakdown:
    """What nvidia-smi counts beyond max_memory_reserved, each term from its source
    (components/runtime.py, catalog/cuda_runtime.json): the CUDA context, the NCCL
    communicators of every process group, and CUDA managed (paged) memory resident on the
    GPU. Empty on the cpu backend."""
    out = Breakdown()
    if spec.backend is not Backend.CUDA:
        return out
    out.add("runtime/cuda_context", cuda_context_bytes(gpu.name if gpu else None, spec.cuda_version))
    if spec.num_gpus > 1:
        from vramplan.parallel.layout import Layout
        lay = Layout.of(spec)
        groups = process_groups(spec.num_gpus, dp=lay.dp, tp=lay.tp, cp=lay.cp, pp=lay.pp, ep=lay.ep,
                                shard_group=lay.shard_group if lay.engine in ("fsdp", "zero") else None)
        for key, value in nccl_terms(groups, getattr(gpu, "interconnect", None)):
            out.add(key, value)
    if managed:
        out.add("managed/optimizer_paged", managed)
    return out


def _inference_events(desc: ModelDesc, spec: JobSpec, params: ParamSet, gpu) -> list[Event]:
    from vramplan.components.inference import inference_terms
    persistent, transient = inference_terms(desc, spec, spec.max_new_tokens or 0)
    live = weight_terms(spec, params).merge(persistent).merge(transient)
    live.add("batch/input_ids", nbytes(spec.micro_batch_size * spec.seq_len, "int64"))
    if spec.backend is Backend.CUDA:
        for key, value in blas_workspace_terms(gpu.name if gpu else None, training=False):
            live.add(key, value)
    return [Event("forward", "no-grad forward", live)]

"""One place that turns a (spec, GPU) into an estimate, a fit verdict and a step time.

A search resolves the model once and keeps every estimate it made, keyed by the fields
the memory estimate reads, so no layout is estimated twice.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

from vramplan.components.memo import spec_key
from vramplan.components.trainable import param_set
from vramplan.estimation import Estimate, estimate_model, model_spec
from vramplan.model import ModelDesc
from vramplan.plan.steptime import DEFAULT_MFU, LayoutTime, ModelCounts, StepTime, step_time
from vramplan.spec import JobSpec, SpecError, load_spec
from vramplan.spec.tasks import drop_unread_sections, needs_several_models
from vramplan.spec.variants import with_dotted


def apply_changes(base: JobSpec | Mapping, changes: Mapping[str, Any]) -> JobSpec:
    """A validated copy of `base` with `changes` applied; dotted keys reach into sections
    (`parallel.zero_stage`, `lora.r`)."""
    data = copy.deepcopy(base.to_dict(as_given=True) if isinstance(base, JobSpec) else dict(base))
    data = with_dotted(data, changes.items())
    drop_unread_sections(data, changes)
    return load_spec(data)


def fit_inputs(spec, top_k) -> tuple[JobSpec, int]:
    """fit()'s spec (a JobSpec, a mapping or a spec file, as estimate() takes) and top_k
    (an integer >= 1: the search reads found[top_k - 1], so 0 was an IndexError)."""
    from vramplan.spec.sections import positive_int
    return (spec if isinstance(spec, JobSpec) else load_spec(spec)), positive_int("top_k", top_k)


def trained_desc(spec: JobSpec) -> ModelDesc | None:
    """The trained model's description (the policy of a DPO job, the reward model ...);
    None for jobs whose trained model is no transformer ModelDesc (diffusion pipelines)."""
    from vramplan.sources import resolve_model
    if not needs_several_models(spec):
        return resolve_model(spec)
    try:
        return resolve_model(spec)
    except (SpecError, KeyError):
        return None


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def accum_key(spec: JobSpec) -> int:
    """What of grad_accum_steps the memory estimate can depend on.

    Without pipelines only "more than one" matters (gradients alive during forward,
    step.build.build_step). Under a 1F1B pipeline at most `pp` micro-batches are in flight
    (Narayanan et al. 2021, section 2.2), so counts beyond pp are alike; other schedules
    (GPipe keeps all m in flight) depend on the exact count.
    """
    return accum_of(spec.grad_accum_steps, spec.parallel)


def accum_of(grad_accum_steps: int, parallel) -> int:
    """accum_key of a spec with this accumulation and parallel section."""
    ga, pp = grad_accum_steps, parallel.pp
    if pp == 1:
        return min(ga, 2)
    return min(ga, max(pp, 2)) if parallel.pp_schedule == "1f1b" else ga


def memory_key(spec: JobSpec, *, drop: tuple[str, ...] = ()) -> tuple:
    """The spec as a hashable key for the memory estimate (see `accum_key`): its fields as
    they are (components/memo.py spec_key; to_dict is ten times slower), or, where one is
    not hashable, its dict form. Equal fields give equal estimates; a key finer than
    needed only costs an estimate."""
    fast = spec_key(spec, frozenset(drop) | {"grad_accum_steps"})
    if fast is not None:
        return ("fields", accum_key(spec)) + fast
    data = spec.to_dict()
    data["grad_accum_steps"] = accum_key(spec)
    for name in drop:
        data.pop(name, None)
    return _freeze(data)


# Spec fields parallel/plan.py stage_traffic does not read (communication_floor does).
_ACTIVATION_FIELDS = ("micro_batch_size", "seq_len", "gradient_checkpointing", "loss_impl", "attention")
_TRAINABLE_FIELDS = ("task", "method", "lora", "freeze", "quantization", "num_labels")


@dataclass(slots=True)
class Verdict:
    spec: JobSpec
    estimate: Estimate
    fits: bool
    step: StepTime


class Evaluator:
    """Estimates for one model on one GPU, cached; capacity and headroom fixed."""

    def __init__(self, desc: ModelDesc | None, gpu, *, headroom_bytes: int = 0,
                 capacity_bytes: int | None = None, mfu: float = DEFAULT_MFU):
        self.desc = desc
        """The trained model; None where it is no transformer ModelDesc (diffusion pipelines)."""
        self.gpu = gpu
        self.counts = ModelCounts.of(desc) if desc is not None else None
        if (isinstance(headroom_bytes, bool) or not isinstance(headroom_bytes, (int, float))
                or not 0 <= headroom_bytes < float("inf")):  # a negative headroom would add memory
            raise SpecError("headroom", f"expected a number of bytes >= 0, got {headroom_bytes!r}")
        self.headroom_bytes = int(headroom_bytes)
        self.capacity_bytes = int(capacity_bytes if capacity_bytes is not None else gpu.memory_bytes)
        if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
            # a share of the GPU's peak FLOP/s (fit(mfu=nan) ranked layouts by NaN step times)
            raise SpecError("mfu", f"expected a number in (0, 1] (model FLOPs utilization, e.g. 0.4), got {mfu!r}")
        self.mfu = mfu
        self.calls = 0
        self._cache: dict[tuple, Estimate] = {}
        self._trainable: dict[tuple, int] = {}
        self._traffic: dict[tuple, object] = {}

    @classmethod
    def for_spec(cls, spec: JobSpec, gpu=None, **kwargs) -> "Evaluator":
        if isinstance(gpu, str):  # a catalog name from Python, as spec.gpu takes it
            from vramplan.catalog import find_gpu
            try:
                gpu = find_gpu(gpu)
            except KeyError as exc:
                raise SpecError("gpu", str(exc).strip("'\"")) from None
        if gpu is None:
            from vramplan.catalog import find_gpu
            if not spec.gpu:
                raise SpecError("gpu", "planning needs a GPU: pass --gpu (see `vramplan gpus`)")
            gpu = find_gpu(spec.gpu)
        return cls(trained_desc(spec), gpu, **kwargs)

    @property
    def limit_bytes(self) -> int:
        """device_bytes may not exceed this."""
        return self.capacity_bytes - self.headroom_bytes

    def estimate(self, spec: JobSpec) -> Estimate:
        key = memory_key(spec)
        est = self._cache.get(key)
        if est is None:
            self.calls += 1
            if needs_several_models(spec) or self.desc is None:
                # Several models (DPO reference, teacher, diffusion parts): the job estimator.
                from vramplan.jobs import estimate_job
                est = estimate_job(spec, self.gpu)
            else:
                est = estimate_model(self.desc, spec, self.gpu)
            self._cache[key] = est
        return est

    def fits(self, spec: JobSpec) -> bool:
        return self.estimate(spec).device_bytes <= self.limit_bytes

    def trainable_params(self, spec: JobSpec) -> int:
        key = tuple(getattr(spec, k) for k in _TRAINABLE_FIELDS)   # frozen, hashable sections
        n = self._trainable.get(key)
        if n is None:
            n = 0 if self.desc is None else param_set(self.desc, spec).numel(trainable=True)
            self._trainable[key] = n
        return n

    def step_time(self, spec: JobSpec, est: Estimate | None = None) -> StepTime:
        """Seconds per step; with the estimator's own `communication` when it reports one."""
        if self.counts is None:
            return StepTime(mfu=self.mfu)     # no FLOPs model without a transformer description
        comm = reported_communication(est) if est is not None else None
        return step_time(self.counts, spec, self.gpu, mfu=self.mfu,
                         trainable_params=self.trainable_params(spec), communication=comm)

    def step_time_bound(self, spec: JobSpec, reports_comm: bool) -> float:
        """A lower bound on step_time(spec, estimate) known before estimating: the whole
        model when the estimator reports no communication, else everything but comm/."""
        if self.counts is None:
            return 0.0
        return self.bound_at(self.layout_time(spec), spec.micro_batch_size, spec.grad_accum_steps, reports_comm)

    def layout_time(self, layout: JobSpec) -> LayoutTime | None:
        """steptime.LayoutTime of `layout` (any batch split of it); None without a FLOPs model."""
        if self.counts is None:
            return None
        return LayoutTime(self.counts, layout, self.gpu, mfu=self.mfu, trainable_params=self.trainable_params(layout))

    @staticmethod
    def bound_at(times: LayoutTime | None, micro_batch_size: int, grad_accum_steps: int, reports_comm: bool) -> float:
        """step_time_bound of the layout `times` was made for, at this batch split."""
        if times is None:
            return 0.0
        if not reports_comm:
            return times.at(micro_batch_size, grad_accum_steps).total_s
        # the same terms, summed in the same order, as step_time's without its comm/ terms
        return times.at(micro_batch_size, grad_accum_steps, comm=False).total_s

    def step_time_floor(self, spec: JobSpec, family: tuple | None = None) -> float:
        """A tighter lower bound than step_time_bound(spec, True), also known before
        estimating: the step time with each collective at its least volume over the pipeline
        stages (parallel/plan.py communication_floor; every term of step_time is then at most
        the estimate's, and they are summed in the same order); step_time_bound where no
        floor holds. `family`: a key equal for layouts alike but for batch, sequence and
        checkpointing (see communication_floor)."""
        floor = self.communication_floor(spec, family) if self.counts is not None else None
        if floor is None:
            return self.step_time_bound(spec, True)
        return step_time(self.counts, spec, self.gpu, mfu=self.mfu, trainable_params=self.trainable_params(spec),
                         communication=floor).total_s

    def communication_floor(self, spec: JobSpec, family: tuple | None = None) -> dict | None:
        """parallel/plan.py communication_floor for a single-model job (None otherwise, or
        where the layout is refused: its estimate says why). What it reads of each pipeline
        stage (stage_traffic) depends on the layout and the parameter sets, not on batch,
        sequence or checkpointing: it is kept per `family` (a search's key for layouts alike
        but for those), else per the spec's other fields."""
        if self.desc is None or needs_several_models(spec):
            return None
        from vramplan.parallel.plan import communication_floor, stage_traffic
        try:
            mspec = model_spec(self.desc, spec)
            key = ("family", family) if family is not None else memory_key(mspec, drop=_ACTIVATION_FIELDS)
            if key not in self._traffic:
                self._traffic[key] = stage_traffic(self.desc, mspec, param_set(self.desc, mspec))
            traffic = self._traffic[key]
            return None if traffic is None else communication_floor(self.desc, mspec, *traffic)
        except (SpecError, ValueError):
            return None

    def reports_communication(self, spec: JobSpec) -> bool:
        """Whether the estimate of `spec` reports its own `communication` (which step_time
        then takes), known without estimating it where it is sure: a single-model job on one
        GPU with no sharding has no parallel plan (estimation.estimate_model runs rank_plan
        only otherwise), so none; any other layout of one model has one, and its collectives
        (True here even where they are none: a search then bounds step time without them and
        computes each layout's own, which gives the same answers). Other jobs: their estimate."""
        if self.desc is not None and not needs_several_models(spec):
            return not (spec.parallel.is_trivial and spec.num_gpus <= 1)
        return reported_communication(self.estimate(spec)) is not None

    def verdict(self, spec: JobSpec) -> Verdict:
        est = self.estimate(spec)
        return Verdict(spec=spec, estimate=est, fits=est.device_bytes <= self.limit_bytes,
                       step=self.step_time(spec, est))


def reported_communication(est: Estimate) -> dict | None:
    """The estimator's own `communication` section (parallel layouts), if it has one."""
    # read the section to_dict() would write (result.py _parallel_dict) without to_dict():
    # that also replays the allocator model, some 20 ms, for a figure step time never reads
    comm = getattr(est, "communication", None)
    if comm is None:
        par = getattr(est, "parallel", None)
        comm = None if par is None else dict(par.communication)
    if hasattr(comm, "to_dict"):
        comm = comm.to_dict()
    return comm if isinstance(comm, dict) and comm else None

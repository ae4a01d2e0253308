"""Estimate: one GPU's memory through a training step, as named terms and device levels
(the result of vramplan.estimation.estimate and of every multi-model job)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from vramplan.breakdown import Breakdown
from vramplan.components import qlora_prep
from vramplan.components.dtypes import stated_dtypes
from vramplan.device import outside_allocator
from vramplan.model import ModelDesc
from vramplan.spec import Backend, JobSpec, Method
from vramplan.timeline import Event

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
        """The effective dtypes taken (weights, gradients, optimizer states, master, compute);
        a quantized base's adapters as its stack's preparation leaves them (qlora_prep.py)."""
        dt = stated_dtypes(self.spec)
        if self.spec.method is not Method.QLORA:
            return dt
        adapters = qlora_prep.adapter_dtype(self.spec, dt.adapters)
        return dt if adapters == dt.adapters else replace(dt, adapters=adapters).for_adapters()

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
            # the step's events in order (timeline.walk): live bytes at each local maximum
            "timeline": [{"phase": e.phase, "label": e.label, "bytes": e.total} for e in self.events],
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
        basis = ("replay of the step's tensor events through the caching-allocator model; " + (
            "on one GPU the estimate's reserved_bytes is this replay's" if self.parallel is None else
            "the estimate's reserved_bytes is the fitted reserve plus what alloc_conf changes in this replay"))
        return {"allocator": {**alloc.to_dict(), "basis": basis}}

    def _parallel_dict(self) -> dict:
        if self.parallel is None:
            return {}
        par = self.parallel.to_dict()
        if par["pp_stage_peaks"] is None:  # no pipeline: the one stage's peak is the step's
            par["pp_stage_peaks"] = [self.peak_allocated_bytes]
        return {"parallel": par, "communication": dict(self.parallel.communication),
                "host_bytes": {"per_rank": self.parallel.host.total(), "per_node": self.parallel.host_per_node,
                               "terms": self.parallel.host.to_dict()}}

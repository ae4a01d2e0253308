"""Measurement branch: real training steps under a memory meter.

    from vramplan.measure import measure
    result = measure(job, device="cpu", fake=False, trace=False)
    result.to_dict()

``job`` is a ``vramplan.spec.JobSpec`` or a plain dict in the format of the
``job`` field of /work/shared/validation/cpu-dev-truth.jsonl.  This package is
the only part of vramplan that imports torch; the core never imports it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PHASE_KINDS = {"fwd": "forward", "bwd": "backward", "opt": "optimizer"}


@dataclass
class MeasureResult:
    """Measured bytes of one job (per device; exact live bytes on CPU/fake)."""

    device: str
    peak_allocated_bytes: int
    phases: dict[str, int]
    params_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    activation_bytes_end_of_forward: int
    peak_phase: str
    phase_peaks: dict[str, int] = field(default_factory=dict)  # per s{step}.{kind}
    peak_reserved_bytes: int | None = None  # CUDA only
    device_bytes: int | None = None  # CUDA only: NVML used memory at the end
    process_bytes: int | None = None  # CUDA only: NVML's used memory of this process alone
    trace: Any = None  # vramplan.measure.trace.Trace when trace=True
    runner: dict | None = None  # what ran: {library, version, entry[, note]}
    allocator_trace: dict | None = None  # CUDA with trace=True: measure/cuda_trace.py's compact trace

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("trace")
        for k in ("peak_reserved_bytes", "device_bytes", "process_bytes", "runner", "allocator_trace"):
            if d[k] is None:
                d.pop(k)
        return d


def phase_kinds(phase_peaks: dict[str, int]) -> dict[str, int]:
    """{'s1.fwd': .., 's2.fwd': ..} -> {'forward': max, 'backward': .., 'optimizer': ..}."""
    out = {v: 0 for v in PHASE_KINDS.values()}
    for name, peak in phase_peaks.items():
        kind = PHASE_KINDS.get(name.rsplit(".", 1)[-1])
        if kind:
            out[kind] = max(out[kind], peak)
    return out


def measure(job: Any, device: str = "cpu", fake: bool = False, trace: bool = False,
            steps: int = 2) -> MeasureResult:
    """Build ``job``'s model and run ``steps`` training steps under a meter."""
    _layout_runs(job)  # before torch is imported
    from .dispatch import loop_runner, measure_cpu
    from .run_modes import run_cuda, run_fake

    if not fake and _deepspeed_job(job):
        from .deepspeed_run import run_deepspeed
        return run_deepspeed(job, trace=trace, steps=steps)
    if device == "cuda" and not fake:
        _cuda_runs(job)
    if fake or device == "cuda":
        result = run_fake(job, trace=trace, steps=steps) if fake else run_cuda(job, steps=steps, trace=trace)
        result.runner = loop_runner()
        return result
    if device != "cpu":
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    return measure_cpu(job, trace=trace, steps=steps)


def _cuda_runs(job: Any) -> None:
    """On CUDA only the single-model loop runs (run_modes.run_cuda: build, forward, backward,
    optimizer step); the library trainers and the multi-model, vision-language, diffusion
    and inference steps are metered on CPU only so far. Refuse those jobs rather than
    measure a different step (the loop would train the policy model alone)."""
    from .build import MEASURED_TASKS, job_dict

    jd = job_dict(job)
    what = ("a vision-language job" if jd.get("vision") else "a job of several models" if jd.get("models")
            else None if jd.get("task", "sft") in MEASURED_TASKS else f"task {jd.get('task')!r}")
    if what is None and (float(jd.get("label_smoothing") or 0) > 0 or jd.get("packing")):
        # the CPU runs these through transformers' Trainer (LabelSmoother, the flattening
        # collator); the CUDA loop would run neither (H200: four such rows 8-19% off)
        what = "label smoothing or packing"
    if what is not None:
        raise ValueError(f"device: measuring {what} on cuda is not implemented yet (cuda runs "
                         f"{', '.join(sorted(MEASURED_TASKS))}); measure it with device cpu")


def _layout_runs(job: Any) -> None:
    """The layouts measured here are one process, or DeepSpeed ZeRO's ranks (deepspeed_run.py):
    any other (tp, pp, cp, ulysses, ep, FSDP, or DDP over several GPUs) ran one unsharded
    process beside the sharded rank's estimate and printed its difference as the error."""
    from .build import job_dict

    jd = job_dict(job)
    par, n = jd.get("parallel") or {}, int(jd.get("num_gpus", 1) or 1)
    axes = [k for k in ("tp", "pp", "cp", "ulysses", "ep") if int(par.get(k, 1) or 1) > 1]
    if par.get("fsdp") not in (None, "none"):
        axes.append("fsdp")
    if axes or (n > 1 and not _deepspeed_job(job)):
        what = ", ".join(axes) if axes else f"{n} GPUs without ZeRO"
        raise ValueError(f"parallel: measure runs one process, or DeepSpeed ZeRO ranks (zero_stage >= 1), "
                         f"not {what}; measure num_gpus 1 or a ZeRO layout (bench/parallel/ holds the others)")


def _deepspeed_job(job: Any) -> bool:
    """A ZeRO job on more than one rank runs the real DeepSpeed (measure/deepspeed_run.py)."""
    from .build import job_dict

    jd = job_dict(job)
    par = jd.get("parallel") or {}
    return int(par.get("zero_stage", 0) or 0) > 0 and int(jd.get("num_gpus", 1) or 1) > 1


__all__ = ["MeasureResult", "measure", "phase_kinds"]

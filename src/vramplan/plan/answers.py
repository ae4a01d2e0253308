"""What `compare` and `fit` answer for a spec and the planning options as the user wrote them
(`--headroom 2GiB`, `--mfu 0.4`): the command line and the web page's /api/compare and
/api/fit call these, so both print the same JSON for the same spec."""
from __future__ import annotations

import re

from vramplan.plan.compare import CompareRows, Strategy, compare
from vramplan.plan.evaluate import Evaluator, trained_desc
from vramplan.plan.fit import FitReport, fit
from vramplan.spec import JobSpec, SpecError
from vramplan.units import GB, GiB, MiB


def parse_headroom(text: str | None, capacity_bytes: int) -> int:
    """'0', '2GiB', '1.5GB', '512MiB', '5%', a fraction '0.05', or bytes '2000000000' -> bytes."""
    if text is None or str(text).strip() in ("", "0"):
        return 0
    t = str(text).strip().replace(" ", "")
    m = re.fullmatch(r"([\d.]+)(%|GiB|GB|MiB|B)?", t, flags=re.IGNORECASE)
    if not m or m.group(1).count(".") > 1:
        raise SpecError("headroom", f"expected e.g. 2GiB, 1.5GB, 512MiB, 5% or 0.05, got {text!r}")
    value, unit = float(m.group(1)), (m.group(2) or "B").lower()
    if unit == "b" and m.group(2) is None and value < 1:
        unit, value = "%", value * 100     # a bare number below 1 is a fraction of the GPU
    elif m.group(2) is None and (value < MiB or value != int(value)):
        # '2' or '2.5' would be 2 bytes kept free: a unit left off, not a plan
        share = " or a fraction of the GPU (e.g. 0.05)" if capacity_bytes else ""
        raise SpecError("headroom", f"{text} reads as {value:g} bytes; give a unit (e.g. {text}GiB){share}")
    if unit == "%" and not capacity_bytes:  # check: the local GPU is not known yet
        raise SpecError("headroom", f"a share of the GPU is not taken here; give a size like 2GiB or 512MiB, got {text!r}")
    scale = {"%": capacity_bytes / 100, "gib": GiB, "gb": GB, "mib": MiB, "b": 1}[unit]
    if capacity_bytes and value * scale >= capacity_bytes:
        raise SpecError("headroom", f"{text} leaves nothing of the GPU's {capacity_bytes / GiB:.2f} GiB for the job; "
                                    "keep less free, e.g. 5% or 2GiB")
    return int(value * scale)


def evaluator_for(spec: JobSpec, command: str, *, headroom: str | None = None, mfu: float | None = None,
                  default_headroom: bool = False) -> Evaluator:
    """The Evaluator of `compare` / `fit` (`command` names the one asking, for the error):
    the spec's catalog GPU, the headroom as written (None: 0, or fit's default with
    `default_headroom`), the model FLOPs utilization (None: DEFAULT_MFU)."""
    from vramplan.catalog import find_gpu
    from vramplan.plan.steptime import DEFAULT_MFU
    if not spec.gpu:
        raise SpecError("gpu", "planning needs a GPU: pass --gpu (see `vramplan gpus`)")
    try:
        gpu = find_gpu(spec.gpu)
    except KeyError as exc:  # catalog.UnknownNameError, as estimate() names it (was field `spec`)
        raise SpecError("gpu", str(exc)) from None
    if gpu.by_size:
        raise SpecError("gpu", f"{command} ranks layouts by step time, which needs the GPU's "
                               f"throughput: name a catalog GPU with {gpu.memory_marketed} (see `vramplan gpus`); "
                               f"a size alone is enough for estimate and check")
    if mfu is not None and not 0 < mfu <= 1:  # a share of the GPU's peak FLOP/s; 0 would mean infinite time
        raise SpecError("mfu", f"expected a number in (0, 1] (model FLOPs utilization, e.g. 0.4), got {mfu}")
    if headroom is None and default_headroom:
        from vramplan.plan.fit import default_fit_headroom
        headroom_bytes = default_fit_headroom(gpu.memory_bytes)
    else:
        headroom_bytes = parse_headroom(headroom, gpu.memory_bytes)
    return Evaluator(trained_desc(spec), gpu, headroom_bytes=headroom_bytes, mfu=mfu or DEFAULT_MFU)


def fit_evaluator(spec: JobSpec, *, headroom: str | None = None, mfu: float | None = None) -> Evaluator:
    """fit's evaluator: its default headroom keeps the estimate's upper bound on the GPU."""
    return evaluator_for(spec, "fit", headroom=headroom, mfu=mfu, default_headroom=True)


def compare_answer(spec: JobSpec, *, strategies: list[Strategy] | None = None, headroom: str | None = None,
                   mfu: float | None = None) -> tuple[CompareRows, Evaluator]:
    """`vramplan compare`: one row per strategy (the first the job as given), and the
    evaluator that ranked them. Its JSON is `rows.to_dict()`."""
    ev = evaluator_for(spec, "compare", headroom=headroom, mfu=mfu)
    return compare(spec, strategies=strategies, evaluator=ev), ev


def fit_answer(spec: JobSpec, *, headroom: str | None = None, mfu: float | None = None, axes: dict | None = None,
               top_k: int = 5, progress=None, evaluator: Evaluator | None = None) -> tuple[FitReport, Evaluator]:
    """`vramplan fit`: the top-k fastest layouts that fit (headroom None: fit's default;
    an `evaluator` from fit_evaluator replaces headroom and mfu). Its JSON is `report.to_dict()`."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise SpecError("top_k", f"expected an integer >= 1, got {top_k!r}")
    ev = evaluator or fit_evaluator(spec, headroom=headroom, mfu=mfu)
    report = fit(spec, evaluator=ev, axes=axes, top_k=top_k, progress=progress)
    if report.candidates_total == 0:  # every combination refused before an estimate: "none of 0 fits" misleads
        from vramplan.plan.steptime import global_batch
        raise SpecError("vary", f"no layout to search: no combination of the axes is a valid layout of this job "
                        f"(its global batch of {global_batch(spec):,} rows split over the data-parallel GPUs, "
                        "heads over tp, layers over pp); open other values")
    return report, ev

"""The estimate, compare and fit answers as Tabulars (report/tables.py), plus the lines a
multi-GPU answer adds: per-stage peaks and communication per parallel axis."""
from __future__ import annotations

from vramplan.report.header import job_header
from vramplan.report.tables import Tabular, gb, gib
from vramplan.units import GB, GiB


def estimate_table(est, depth: int = 2) -> Tabular:
    total = est.peak_allocated_bytes or 1
    groups = sorted(est.components.groups(depth).items(), key=lambda kv: -kv[1])
    rows = [[name, size, gib(size), gb(size), round(100 * size / total, 1)] for name, size in groups]
    rows.append(["peak allocated", est.peak_allocated_bytes, gib(est.peak_allocated_bytes),
                 gb(est.peak_allocated_bytes), 100.0])
    notes = [f"peak in {est.peak_phase} ({est.peak_event}); phase peaks: "
             + ", ".join(f"{k} {v / GiB:,.2f} GiB" for k, v in est.phases.items())]
    if est.spec.backend.value == "cuda":
        notes.append(f"max_memory_allocated {est.peak_allocated_bytes / GiB:,.2f} GiB, max_memory_reserved "
                     f"{est.reserved_bytes / GiB:,.2f} GiB, nvidia-smi {est.device_bytes / GiB:,.2f} GiB "
                     f"({est.device_bytes / GB:,.2f} GB)")
    if est.gpu is not None:
        notes.append(f"{est.gpu.name} ({est.gpu.memory_bytes / GiB:,.2f} GiB): "
                     f"{'fits' if est.fits else 'does not fit'}, headroom {est.headroom_bytes / GiB:,.2f} GiB")
    notes += parallel_lines(est) + [f"note: {n}" for n in est.notes]
    return Tabular(job_header(est), ["term at the peak", "bytes", "GiB", "GB", "share %"], rows, notes)


def parallel_lines(est) -> list[str]:
    """Per-stage peaks and per-axis communication of a multi-GPU estimate (empty otherwise)."""
    par = est.parallel
    if par is None:
        return []
    d = par.to_dict()
    axes = " ".join(f"{k}={d[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if d.get(k, 1) > 1) or "dp=1"
    out = [f"parallel: {d['num_gpus']} GPUs, {axes}{' +sp' if d.get('sp') else ''}, engine {d.get('engine')}"]
    stages = d.get("pp_stage_peaks") or []
    if len(stages) > 1:
        worst = d.get("reported_pp_stage")
        out.append("pipeline stage peaks (allocated): " + ", ".join(
            f"stage {i} {b / GiB:,.2f} GiB{' (worst, reported)' if i == worst else ''}" for i, b in enumerate(stages)))
    for axis, info in (est.parallel.communication or {}).items():
        if isinstance(info, dict) and info.get("bytes") is not None:
            out.append(f"communication {axis}: {info['bytes'] / GB:,.2f} GB per GPU per step ({info.get('formula', '')})")
    host = est.parallel.host.total()
    if host:
        out.append(f"host RAM: {host / GiB:,.2f} GiB per rank, {est.parallel.host_per_node / GiB:,.2f} GiB per node")
    return out


def compare_table(rows, title: str) -> Tabular:
    out = []
    for r in rows:
        if r.estimate is None:
            out.append([r.strategy.name, None, None, None, None, None, None, None, r.note])
            continue
        out.append([r.strategy.name, gib(r.estimate.peak_allocated_bytes), gib(r.estimate.device_bytes),
                    gib(r.saving_bytes), round(100 * r.saving_pct, 1), r.fits,
                    None if r.relative_step_time is None else round(r.relative_step_time, 2),
                    gb(r.step.comm_bytes), _changes(r.strategy.changes)])
    return Tabular(title, ["strategy", "peak alloc GiB", "device GiB", "saves GiB", "saves %", "fits",
                           "step time x", "comm/step GB", "changes"], out)


def fit_table(report, gpu_name: str) -> Tabular:
    rows = [[i, _changes(r.changes), gib(r.estimate.device_bytes), gib(report.limit_bytes - r.estimate.device_bytes),
             round(r.step_time_s, 3), r.why[0] if r.why else ""] for i, r in enumerate(report.results, 1)]
    note = " (interrupted: best so far)" if report.interrupted else ""
    title = (f"{report.candidates_evaluated:,} of {report.candidates_total:,} layouts settled with "
             f"{report.estimates_computed} estimates in {report.elapsed_s:.2f} s on {gpu_name}{note}")
    notes = [f"#{i}: " + "; ".join(r.why[1:]) for i, r in enumerate(report.results, 1) if len(r.why) > 1]
    return Tabular(title, ["#", "layout", "device GiB", "spare GiB", "s/step", "why"], rows, notes)


_SHORT = {"gradient_checkpointing": "ckpt", "parallel.zero_stage": "zero",
          "parallel.offload_optimizer": "offload", "parallel.offload_params": "offload_params",
          "micro_batch_size": "mb", "grad_accum_steps": "ga"}


def _changes(changes: dict) -> str:
    """'ckpt=full zero=3 tp=2 mb=4 ga=8' for a changes mapping."""
    return " ".join(f"{_SHORT.get(k, k.split('.')[-1])}={v}" for k, v in changes.items()) or "(as given)"

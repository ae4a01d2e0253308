"""The estimate, compare and fit answers as Tabulars (report/tables.py), plus the lines a
multi-GPU answer adds: per-stage peaks and communication per parallel axis.

Titles, column names and notes are in the current language (vramplan.i18n); term keys,
layout settings and figures stay as they are, and JSON never comes through here."""
from __future__ import annotations

from vramplan.i18n import DEFAULT_LANGUAGE, Msg, _, get_language, ngettext, tr
from vramplan.i18n.terms import event_label, phase_name, strategy_label, term_label, verdict_label
from vramplan.report.header import job_header
from vramplan.report.tables import Tabular, gb, gib
from vramplan.units import GB, GiB


def estimate_table(est, depth: int = 2) -> Tabular:
    total = est.peak_allocated_bytes or 1
    groups = sorted(est.components.groups(depth).items(), key=lambda kv: -kv[1])
    labels = get_language() != DEFAULT_LANGUAGE  # a translated answer shows a label beside each key
    rows = [[name, *([term_label(name)] if labels else []), size, gib(size), gb(size), round(100 * size / total, 1)]
            for name, size in groups]
    rows.append([_("peak allocated"), *([""] if labels else []), est.peak_allocated_bytes,
                 gib(est.peak_allocated_bytes), gb(est.peak_allocated_bytes), 100.0])
    phase = phase_name if labels else str  # English keeps the phase keys, as the JSON has them
    notes = [_("peak in {phase} ({event}); phase peaks: {phases}").format(
        phase=phase(est.peak_phase), event=event_label(est.peak_event), phases=", ".join(
            _("{phase} {gib} GiB").format(phase=phase(k), gib=f"{v / GiB:,.2f}") for k, v in est.phases.items()))]
    if est.spec.backend.value == "cuda":
        notes.append(_("max_memory_allocated {allocated} GiB, max_memory_reserved {reserved} GiB, "
                       "nvidia-smi {device} GiB ({device_gb} GB)").format(
            allocated=f"{est.peak_allocated_bytes / GiB:,.2f}", reserved=f"{est.reserved_bytes / GiB:,.2f}",
            device=f"{est.device_bytes / GiB:,.2f}", device_gb=f"{est.device_bytes / GB:,.2f}"))
    if est.gpu is not None:
        notes.append(_("{gpu} ({gib} GiB): {verdict}, headroom {headroom} GiB").format(
            gpu=est.gpu.name, gib=f"{est.gpu.memory_bytes / GiB:,.2f}",
            verdict=verdict_label("fits" if est.fits else "does not fit"),
            headroom=f"{est.headroom_bytes / GiB:,.2f}"))
    notes += [tr(line) for line in parallel_lines(est)] + [_("note:") + " " + tr(n) for n in est.notes]
    columns = [_("term at the peak"), *([_("meaning")] if labels else []), _("bytes"), "GiB", "GB", _("share %")]
    return Tabular(tr(job_header(est)), columns, rows, notes)


def parallel_lines(est) -> list[str]:
    """Per-stage peaks and per-axis communication of a multi-GPU estimate (empty otherwise),
    as English `Msg` lines the caller prints through `tr()`."""
    par = est.parallel
    if par is None:
        return []
    d = par.to_dict()
    axes = " ".join(f"{k}={d[k]}" for k in ("dp", "tp", "pp", "cp", "ulysses", "ep") if d.get(k, 1) > 1) or "dp=1"
    out = [Msg("parallel: {n} GPUs, {axes}{sp}, engine {engine}", n=d["num_gpus"], axes=axes,
               sp=" +sp" if d.get("sp") else "", engine=d.get("engine"))]
    stages = d.get("pp_stage_peaks") or []
    if len(stages) > 1:
        worst = d.get("reported_pp_stage")
        out.append(Msg("pipeline stage peaks (allocated): {stages}", stages=Msg.join(", ", [
            _stage(i, b, i == worst) for i, b in enumerate(stages)])))
    for axis, info in (est.parallel.communication or {}).items():
        if isinstance(info, dict) and info.get("bytes") is not None:
            out.append(Msg("communication {axis}: {gb} GB per GPU per step ({formula})", axis=axis,
                           gb=f"{info['bytes'] / GB:,.2f}", formula=info.get("formula", "")))
    host = est.parallel.host.total()
    if host:
        out.append(Msg("host RAM: {rank} GiB per rank, {node} GiB per node", rank=f"{host / GiB:,.2f}",
                       node=f"{est.parallel.host_per_node / GiB:,.2f}"))
    return out


def _stage(i: int, nbytes: int, worst: bool) -> Msg:
    if worst:
        return Msg("stage {i} {gib} GiB (worst, reported)", i=i, gib=f"{nbytes / GiB:,.2f}")
    return Msg("stage {i} {gib} GiB", i=i, gib=f"{nbytes / GiB:,.2f}")


def compare_table(rows, title: str) -> Tabular:
    out = []
    for r in rows:
        if r.estimate is None:
            out.append([strategy_label(r.strategy.name), None, None, None, None, None, None, None, tr(r.note)])
            continue
        out.append([strategy_label(r.strategy.name), gib(r.estimate.peak_allocated_bytes), gib(r.estimate.device_bytes),
                    gib(r.saving_bytes), round(100 * r.saving_pct, 1), r.fits,
                    None if r.relative_step_time is None else round(r.relative_step_time, 2),
                    gb(r.step.comm_bytes), _changes(r.strategy.changes)])
    return Tabular(title, [_("strategy"), _("peak alloc GiB"), _("device GiB"), _("saves GiB"), _("saves %"),
                           _("fits"), _("step time x"), _("comm/step GB"), _("changes")], out)


def fit_table(report, gpu_name: str) -> Tabular:
    rows = [[i, _changes(r.changes), gib(r.estimate.device_bytes), gib(report.limit_bytes - r.estimate.device_bytes),
             None if r.step_time_s is None else round(r.step_time_s, 3), tr(r.why[0]) if r.why else ""] for i, r in enumerate(report.results, 1)]
    note = _(" (interrupted: best so far)") if report.interrupted else ""
    title = ngettext("{settled:,} of {total:,} layouts settled with {estimates} estimate in {seconds:.2f} s "
                     "on {gpu}{note}",
                     "{settled:,} of {total:,} layouts settled with {estimates} estimates in {seconds:.2f} s "
                     "on {gpu}{note}", report.estimates_computed).format(
        settled=report.candidates_evaluated, total=report.candidates_total, estimates=report.estimates_computed,
        seconds=report.elapsed_s, gpu=gpu_name, note=note)
    notes = [f"#{i}: " + _("; ").join(tr(w) for w in r.why[1:]) for i, r in enumerate(report.results, 1)
             if len(r.why) > 1]
    return Tabular(title, ["#", _("layout"), _("device GiB"), _("spare GiB"), _("s/step"), _("why")], rows, notes)


_SHORT = {"gradient_checkpointing": "ckpt", "parallel.zero_stage": "zero",
          "parallel.offload_optimizer": "offload", "parallel.offload_params": "offload_params",
          "micro_batch_size": "mb", "grad_accum_steps": "ga"}


def _changes(changes: dict) -> str:
    """'ckpt=full zero=3 tp=2 mb=4 ga=8' for a changes mapping."""
    return " ".join(f"{_SHORT.get(k, k.split('.')[-1])}={v}" for k, v in changes.items()) or _("(as given)")

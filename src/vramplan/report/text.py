"""Human-readable estimate: a rich table of terms with GiB and GB labelled, shares, phases.

Text is translated here, at the edge (vramplan.i18n); term keys stay English identifiers
and a translated report shows a label beside each.
"""
from __future__ import annotations

from vramplan.i18n import DEFAULT_LANGUAGE, _, get_language, tr
from vramplan.i18n.terms import event_label, phase_name, term_label, verdict_label
from vramplan.units import GB, GiB


def _gib(n: int) -> str:
    return f"{n / GiB:,.2f}"


def _gb(n: int) -> str:
    return f"{n / GB:,.2f}"


def render_estimate(est, console=None, depth: int = 2) -> None:
    """Print an Estimate with rich. `depth` groups terms by that many key parts."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    spec = est.spec
    from vramplan.report.header import job_header
    title = tr(job_header(est))
    title += "\n" + _("precision: {dtypes}").format(
        dtypes=tr(est.dtypes.describe(spec.optimizer.value not in ('sgd',) or spec.momentum > 0,
                                      training=spec.task.value != "inference")))
    labels = get_language() != DEFAULT_LANGUAGE
    table = Table(title=title, title_justify="left")
    table.add_column(_("term at the peak"))
    if labels:
        table.add_column(_("meaning"))
    table.add_column("GiB", justify="right")
    table.add_column("GB", justify="right")
    table.add_column(_("share"), justify="right")
    total = est.peak_allocated_bytes or 1
    groups = est.components.groups(depth)
    for name, size in sorted(groups.items(), key=lambda kv: -kv[1]):
        table.add_row(name, *([term_label(name)] if labels else []), _gib(size), _gb(size), f"{size / total:.1%}")
    table.add_section()
    table.add_row("[bold]" + _("peak allocated") + "[/bold]", *([""] if labels else []),
                  _gib(est.peak_allocated_bytes), _gb(est.peak_allocated_bytes), "100%")
    console.print(table)
    phase = phase_name if labels else str  # English keeps the phase and term keys, as the JSON has them
    phases = "  ".join(_("{phase} {gib} GiB").format(phase=phase(k), gib=_gib(v)) for k, v in est.phases.items())
    console.print(_("peak in {phase} ({event}); phase peaks: {phases}").format(
        phase=f"[bold]{phase(est.peak_phase)}[/bold]", event=event_label(est.peak_event), phases=phases))
    if spec.backend.value == "cuda":
        console.print(_("torch.cuda.max_memory_allocated ≈ {allocated} GiB, max_memory_reserved ≈ {reserved} GiB, "
                        "nvidia-smi ≈ {device} GiB ({device_gb} GB)").format(
            allocated=_gib(est.peak_allocated_bytes), reserved=_gib(est.reserved_bytes),
            device=_gib(est.device_bytes), device_gb=_gb(est.device_bytes)))
        outside = "  ".join(_("{term} {gib} GiB").format(term=term_label(k) if labels else k, gib=_gib(v))
                            for k, v in est.device_terms.to_dict().items())
        lo, hi = est.bounds["device"]
        console.print(_("nvidia-smi beyond reserved: {outside}; measured on published runs within "
                        "{low}-{high} GiB for this estimate (bench/accuracy/bounds.py)").format(
            outside=outside, low=_gib(lo), high=_gib(hi)))
    else:
        console.print(_("backend cpu: live tensor bytes, as the exact CPU meter counts them"))
    if est.gpu is not None:
        colour = {"fits": "green", "does not fit": "red"}.get(est.verdict, "yellow")
        verdict = f"[{colour}]{verdict_label(est.verdict)}[/{colour}]"
        console.print(_("{gpu} ({usable} GiB usable): {verdict}, headroom {headroom} GiB").format(
            gpu=est.gpu.name, usable=_gib(est.gpu.memory_bytes), verdict=verdict, headroom=_gib(est.headroom_bytes)))
    if getattr(est, "lengths", None) is not None:
        console.print(tr(est.lengths.summary()))
    for note in est.notes:
        console.print("[yellow]" + _("note:") + "[/yellow] " + tr(note))

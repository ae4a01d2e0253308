"""Human-readable estimate: a rich table of terms with GiB and GB labelled, shares, phases."""
from __future__ import annotations

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
    title = job_header(est)
    title += f"\nprecision: {est.dtypes.describe(spec.optimizer.value not in ('sgd',) or spec.momentum > 0)}"
    table = Table(title=title, title_justify="left")
    table.add_column("term at the peak")
    table.add_column("GiB", justify="right")
    table.add_column("GB", justify="right")
    table.add_column("share", justify="right")
    total = est.peak_allocated_bytes or 1
    groups = est.components.groups(depth)
    for name, size in sorted(groups.items(), key=lambda kv: -kv[1]):
        table.add_row(name, _gib(size), _gb(size), f"{size / total:.1%}")
    table.add_section()
    table.add_row("[bold]peak allocated[/bold]", _gib(est.peak_allocated_bytes), _gb(est.peak_allocated_bytes), "100%")
    console.print(table)
    phases = "  ".join(f"{k} {_gib(v)} GiB" for k, v in est.phases.items())
    console.print(f"peak in [bold]{est.peak_phase}[/bold] ({est.peak_event}); phase peaks: {phases}")
    if spec.backend.value == "cuda":
        console.print(f"torch.cuda.max_memory_allocated ≈ {_gib(est.peak_allocated_bytes)} GiB, "
                      f"max_memory_reserved ≈ {_gib(est.reserved_bytes)} GiB, "
                      f"nvidia-smi ≈ {_gib(est.device_bytes)} GiB ({_gb(est.device_bytes)} GB)")
        outside = "  ".join(f"{k} {_gib(v)} GiB" for k, v in est.device_terms.to_dict().items())
        lo, hi = est.bounds["device"]
        console.print(f"nvidia-smi beyond reserved: {outside}; measured on published runs within "
                      f"{_gib(lo)}-{_gib(hi)} GiB for this estimate (bench/accuracy/bounds.py)")
    else:
        console.print("backend cpu: live tensor bytes, as the exact CPU meter counts them")
    if est.gpu is not None:
        colour = {"fits": "green", "does not fit": "red"}.get(est.verdict, "yellow")
        verdict = f"[{colour}]{est.verdict}[/{colour}]"
        console.print(f"{est.gpu.name} ({_gib(est.gpu.memory_bytes)} GiB usable): {verdict}, "
                      f"headroom {_gib(est.headroom_bytes)} GiB")
    if getattr(est, "lengths", None) is not None:
        console.print(est.lengths.summary())
    for note in est.notes:
        console.print(f"[yellow]note:[/yellow] {note}")

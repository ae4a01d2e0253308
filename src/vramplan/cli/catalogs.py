"""`vramplan models` and `vramplan gpus`: the built-in catalogs as tables or JSON (the rows
come from vramplan.listing, shared with the web page's API)."""
from __future__ import annotations

import json

from vramplan.i18n import N_, _


def cmd_models(args) -> int:
    from vramplan.listing import model_rows
    rows = model_rows(args.kind, args.name)
    if args.name is not None and not rows and not args.json:  # an empty table would read as an empty catalog
        from vramplan.spec import SpecError
        kind = f"model of kind {args.kind}" if args.kind else "model"
        raise SpecError("name", f"no catalog {kind} has {args.name!r} in its name or hub id; run "
                        "`vramplan models` for the list, or pass a hub id or config.json to estimate")
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table
    table = Table(title=_("vramplan model catalog (diffusion: all parts; the denoiser is trained)"))
    for col in (N_("name"), N_("kind"), N_("hub id"), N_("type"), N_("params")):
        table.add_column(_(col), justify="right" if col == "params" else "left")
    for r in rows:
        trained = f" (denoiser {r['trained_params'] / 1e9:,.2f} B)" if "trained_params" in r else ""
        table.add_row(r["name"], r["kind"], r["hub_id"] or "", r["type"], f"{r['num_params'] / 1e9:,.3f} B{trained}")
    Console().print(table)
    return 0


def cmd_gpus(args) -> int:
    from vramplan.catalog import list_gpus
    from vramplan.units import GiB
    gpus = list_gpus()
    if args.json:
        from vramplan.listing import gpu_rows
        print(json.dumps(gpu_rows(), indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table
    table = Table(title=_("vramplan GPU catalog (usable bytes as the driver reports them)"))
    for col in (N_("name"), N_("marketed"), N_("GiB usable"), "bf16 TFLOP/s", N_("what the marketed figure means")):
        table.add_column(_(col))
    for g in gpus:
        table.add_row(g.name, g.memory_marketed, f"{g.memory_bytes / GiB:,.2f}",
                      "-" if g.bf16_tflops is None else f"{g.bf16_tflops:g}", g.memory_unit_note)
    Console().print(table)
    return 0

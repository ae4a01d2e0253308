"""`vramplan compare | fit | check`: parse, call vramplan.plan / vramplan.check, render.

Registered from cli.build_parser with `register(sub, _add_spec_args, spec_from_args)`;
user errors are SpecError / UsageError, which cli.main turns into one line and exit 2.
"""
from __future__ import annotations

import json
import re
import sys

from vramplan.i18n import _, ngettext, tr
from vramplan.i18n.errors import localize
from vramplan.i18n.terms import strategy_label, tier_label
from vramplan.spec import SpecError
from vramplan.units import GB, GiB, MiB

_SPEC_FROM_ARGS = None


def parse_headroom(text: str | None, capacity_bytes: int) -> int:
    """'0', '2GiB', '1.5GB', '512MiB', '5%' -> bytes."""
    if text is None or str(text).strip() in ("", "0"):
        return 0
    t = str(text).strip().replace(" ", "")
    m = re.fullmatch(r"([\d.]+)(%|GiB|GB|MiB|B)?", t, flags=re.IGNORECASE)
    if not m:
        raise SpecError("headroom", f"expected e.g. 2GiB, 1.5GB, 512MiB or 5%, got {text!r}")
    value, unit = float(m.group(1)), (m.group(2) or "B").lower()
    scale = {"%": capacity_bytes / 100, "gib": GiB, "gb": GB, "mib": MiB, "b": 1}[unit]
    return int(value * scale)


def _parse_vary(items: list[str] | None) -> dict | None:
    """--vary zero_stage=0,3 --vary optimizer -> {axis: values}; a bare axis takes its defaults."""
    if not items:
        return None
    from vramplan.plan.compare import _scalar
    from vramplan.plan.space import KNOWN_AXES, axis_name
    out = {}
    for item in items:
        name, eq, values = item.partition("=")
        axis = axis_name(name)
        out[axis] = tuple(_scalar(v) for v in values.split(",")) if eq else KNOWN_AXES[axis]
        if not out[axis]:
            raise SpecError("vary", f"axis {axis} needs values, e.g. {axis}=1024,2048")
    return out


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table
    console = Console() if sys.stdout.isatty() else Console(width=160)
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:,.2f}"


# ------------------------------------------------------------------ compare
def cmd_compare(args) -> int:
    from vramplan.plan.compare import Strategy, compare, compare_to_dict, default_strategies
    spec = _SPEC_FROM_ARGS(args)
    if args.tiers:
        return _tiers(spec, args)
    strategies = None
    if args.strategy or args.strategies:
        strategies = [Strategy.parse(s) for s in args.strategy or []]
        if args.strategies:
            strategies += _read_strategies(args.strategies)
        if args.with_defaults:
            strategies = default_strategies(spec) + strategies
    ev = _evaluator(spec, args)
    rows = compare(spec, strategies=strategies, evaluator=ev)
    if args.plot:
        from vramplan.report.plots import plot_compare
        plot_compare(rows, args.plot, capacity_bytes=ev.gpu.memory_bytes)
    if args.json:
        print(json.dumps(compare_to_dict(rows), indent=2))
        return 0
    table = []
    for r in rows:
        if r.estimate is None:
            table.append([strategy_label(r.strategy.name), "-", "-", "-", "-", "-", "-", r.note])
            continue
        table.append([strategy_label(r.strategy.name), _gib(r.estimate.peak_allocated_bytes), _gib(r.estimate.device_bytes),
                      _gib(r.saving_bytes), f"{r.saving_pct:.1%}", _("yes") if r.fits else _("NO"),
                      "-" if r.relative_step_time is None else f"{r.relative_step_time:.2f}x",
                      f"{r.step.comm_bytes / GB:,.2f} GB"])
    _table(_("{model} on {gpu} ({usable} GiB usable): strategies").format(
               model=spec.model or _("model"), gpu=ev.gpu.name, usable=_gib(ev.limit_bytes)),
           [_("strategy"), _("peak alloc GiB"), _("device GiB"), _("saves GiB"), _("saves %"), _("fits"),
            _("step time"), _("comm/step")], table)
    return 0


def _tiers(spec, args) -> int:
    from vramplan.plan.tiers import gpu_tiers, tiers_summary
    rows = gpu_tiers(spec, headroom_bytes=0 if args.headroom is None else parse_headroom(args.headroom, 0))
    if args.json:
        print(json.dumps({"schema_version": 1, "gpus": [r.to_dict() for r in rows],
                          "tiers": tiers_summary(rows)}, indent=2))
        return 0
    _table(_("which GPUs hold this job, and with what (least change first)"),
           [_("tier"), _("gpu"), "GiB", _("needs"), _("device GiB")],
           [[tier_label(r.tier), r.gpu, _gib(r.memory_bytes),
             _("does not fit") if r.best is None else strategy_label(r.best.strategy.name),
             "-" if r.best is None else _gib(r.best.estimate.device_bytes)] for r in rows])
    return 0


def _read_strategies(path: str):
    from vramplan.plan.compare import Strategy
    from vramplan.spec.job import _read_file
    if path.endswith((".yaml", ".yml", ".json")):
        import yaml
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    else:
        data = _read_file(path)
    items = data.get("strategies") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise SpecError("strategies", f"{path} must hold a list of {{name, changes}}")
    return [Strategy(name=str(i["name"]), changes=dict(i.get("changes") or {})) for i in items]


def _evaluator(spec, args):
    from vramplan.catalog import find_gpu
    from vramplan.plan.evaluate import Evaluator
    from vramplan.plan.steptime import DEFAULT_MFU
    from vramplan.plan.evaluate import trained_desc
    if not spec.gpu:
        raise SpecError("gpu", "planning needs a GPU: pass --gpu (see `vramplan gpus`)")
    gpu = find_gpu(spec.gpu)
    return Evaluator(trained_desc(spec), gpu, headroom_bytes=parse_headroom(args.headroom, gpu.memory_bytes),
                     mfu=args.mfu or DEFAULT_MFU)


# ------------------------------------------------------------------ fit
def _progress(done: int, total: int, found: int) -> None:
    print("\r" + _("fit: {done:,}/{total:,} layouts, {found} fitting so far (Ctrl-C for the best so far)").format(
        done=done, total=total, found=found),
          end="", file=sys.stderr, flush=True)


def cmd_fit(args) -> int:
    spec = _SPEC_FROM_ARGS(args)
    ev = _evaluator(spec, args)
    axes = _parse_vary(args.vary)
    if axes is not None and not args.only:
        from vramplan.plan.space import default_axes
        axes = {**default_axes(spec, ev.desc), **axes}
    progress = _progress if sys.stderr.isatty() else None
    if args.maximize:
        return _fit_maximize(spec, ev, axes, args)
    if args.minimize:
        return _fit_minimize(spec, ev, axes, args)
    from vramplan.plan.fit import fit
    report = fit(spec, evaluator=ev, axes=axes, top_k=args.top_k, progress=progress)
    if progress:
        print(file=sys.stderr)
    if args.plot and report.results:
        from vramplan.report.plots import plot_breakdown
        plot_breakdown(report.results[0].estimate, args.plot)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0 if report.results else 1
    _render_fit(report, ev)
    return 0 if report.results else 1


_SHORT = {"gradient_checkpointing": "ckpt", "parallel.zero_stage": "zero",
          "parallel.offload_optimizer": "offload", "parallel.offload_params": "offload_params",
          "micro_batch_size": "mb", "grad_accum_steps": "ga"}


def short_layout(changes: dict) -> str:
    """'ckpt=full zero=3 tp=2 mb=4 ga=8' for a changes mapping."""
    return " ".join(f"{_SHORT.get(k, k.split('.')[-1])}={v}" for k, v in changes.items())


def _render_fit(report, ev) -> None:
    rows = []
    for i, r in enumerate(report.results, 1):
        layout = short_layout(r.changes)
        rows.append([str(i), layout, _gib(r.estimate.device_bytes), f"{r.step_time_s:.3f}", tr(r.why[0])])
    note = _(" (interrupted: best so far)") if report.interrupted else ""
    if rows:
        _table(ngettext("{settled:,} of {total:,} layouts settled with {estimates} estimate in {seconds:.2f} s "
                        "on {gpu}{note}",
                        "{settled:,} of {total:,} layouts settled with {estimates} estimates in {seconds:.2f} s "
                        "on {gpu}{note}", report.estimates_computed).format(settled=report.candidates_evaluated, total=report.candidates_total,
                                       estimates=report.estimates_computed, seconds=report.elapsed_s,
                                       gpu=ev.gpu.name, note=note),
               ["#", _("layout"), _("device GiB"), _("s/step"), _("why")], rows)
    else:
        print(_("none of {total:,} layouts fits on {gpu} ({estimates} estimates, {seconds:.2f} s){note}").format(
            total=report.candidates_total, gpu=ev.gpu.name, estimates=report.estimates_computed,
            seconds=report.elapsed_s, note=note))
    for i, r in enumerate(report.results, 1):
        print(f"#{i}: " + _("; ").join(tr(w) for w in r.why[1:]))
    if not report.results:
        closest = report.closest
        if closest is not None:
            short = closest.estimate.device_bytes - report.limit_bytes
            print(_("the closest layout ({layout}) needs {gib:.2f} GiB more").format(
                layout=short_layout(closest.changes), gib=short / GiB))
        for s in report.suggestions:
            print("  " + _("would fit: {suggestion}").format(suggestion=tr(s.message())))


def _fit_maximize(spec, ev, axes, args) -> int:
    from vramplan.plan.solve import maximize
    solved = maximize(ev, spec, args.maximize, axes=axes)
    if args.plot and solved.sweep:
        from vramplan.report.plots import plot_sweep
        plot_sweep(solved.sweep, args.plot, name=args.maximize, capacity_bytes=ev.limit_bytes)
    if args.json:
        print(json.dumps(solved.to_dict(), indent=2))
    elif solved.value is None:
        print(_("no layout fits even at {name}=1 on {gpu}").format(name=args.maximize, gpu=ev.gpu.name))
    else:
        print(_("largest {name} that fits on {gpu}: {value} ({gib} GiB, {seconds:.3f} s/step), with "
                "gradient_checkpointing={ckpt}, parallel={parallel}").format(
            name=args.maximize, gpu=ev.gpu.name, value=solved.value, gib=_gib(solved.estimate.device_bytes),
            seconds=solved.step.total_s, ckpt=solved.spec.gradient_checkpointing.value,
            parallel=solved.spec.parallel.to_dict() if not solved.spec.parallel.is_trivial else 'none'))
    return 0 if solved.value else 1


def _fit_minimize(spec, ev, axes, args) -> int:
    from vramplan.plan.solve import fewest_gpus
    n, report = fewest_gpus(spec, evaluator=ev, axes=axes, max_gpus=args.max_gpus)
    if args.json:
        print(json.dumps({"num_gpus": n, "fit": report.to_dict()}, indent=2))
    elif n is None:
        print(_("does not fit on {n} x {gpu} in any layout searched").format(n=args.max_gpus, gpu=ev.gpu.name))
    else:
        best = report.results[0]
        print(_("fewest GPUs: {n} x {gpu}, with {changes} ({gib} GiB, {seconds:.3f} s/step)").format(
            n=n, gpu=ev.gpu.name, changes=best.changes, gib=_gib(best.estimate.device_bytes),
            seconds=best.step_time_s))
    return 0 if n else 1


# ------------------------------------------------------------------ check
def cmd_check(args) -> int:
    from vramplan.check import NoGPUError, check
    spec = _SPEC_FROM_ARGS(args)
    try:
        result = check(spec, device=args.device, raise_error=False,
                       headroom_bytes=parse_headroom(args.headroom, 0))
    except NoGPUError as exc:
        print(f"vramplan: {localize(str(exc))}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(tr(result.message()))
    return 0 if result.fits else 1


# ------------------------------------------------------------------ registration
def register(sub, add_spec_args, spec_from_args) -> None:
    global _SPEC_FROM_ARGS
    _SPEC_FROM_ARGS = spec_from_args
    c = sub.add_parser("compare", help=_("memory-saving strategies side by side"))
    add_spec_args(c)
    c.add_argument("--strategy", action="append", help=_("'NAME key=value ...' (repeatable)"))
    c.add_argument("--strategies", help=_("YAML/JSON file: a list of {name, changes}"))
    c.add_argument("--with-defaults", action="store_true", help=_("keep the built-in strategies too"))
    c.add_argument("--tiers", action="store_true", help=_("every catalog GPU: the least change that fits"))
    _common(c)
    c.set_defaults(func=cmd_compare)
    f = sub.add_parser("fit", help=_("layouts that fit, ranked by estimated step time"))
    add_spec_args(f)
    f.add_argument("--top-k", type=int, default=5)
    f.add_argument("--vary", action="append", help=_("open an axis: NAME or NAME=v1,v2 (repeatable)"))
    f.add_argument("--only", action="store_true", help=_("search only the --vary axes"))
    f.add_argument("--maximize", choices=("micro_batch_size", "seq_len"))
    f.add_argument("--minimize", choices=("num_gpus",))
    f.add_argument("--max-gpus", type=int, default=1024)
    _common(f)
    f.set_defaults(func=cmd_fit)
    k = sub.add_parser("check", help=_("compare the estimate with a local GPU's free memory"))
    add_spec_args(k)
    k.add_argument("--device", type=int, default=None, help=_("local GPU index (default 0)"))
    k.add_argument("--headroom", default=None, help=_("memory to keep free: 2GiB, 1.5GB, 512MiB"))
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=cmd_check)


def _common(p) -> None:
    p.add_argument("--headroom", default=None, help=_("memory to keep free: 2GiB, 1.5GB, 5%%"))
    p.add_argument("--mfu", type=float, default=None, help=_("model FLOPs utilization (default 0.40)"))
    p.add_argument("--plot", help=_("write a picture: .png/.svg (matplotlib) or .html"))
    p.add_argument("--json", action="store_true")

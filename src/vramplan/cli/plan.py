"""`vramplan compare | fit | check`: parse, call vramplan.plan / vramplan.check, render.

Registered from cli.build_parser with `register(sub, _add_spec_args, spec_from_args)`;
user errors are SpecError / UsageError, which cli.main turns into one line and exit 2.
"""
from __future__ import annotations

import json
import sys

from vramplan.cli.flags import say_notes
from vramplan.i18n import _, ngettext, tr
from vramplan.i18n.errors import localize
from vramplan.i18n.terms import strategy_label, tier_label
from vramplan.spec import SpecError
from vramplan.units import GiB

_SPEC_FROM_ARGS = None


def _parse_vary(items: list[str] | None) -> dict | None:
    """--vary zero_stage=0,3 --vary optimizer -> {axis: values}; a bare axis takes its defaults."""
    if not items:
        return None
    from vramplan.plan.compare import parse_scalar
    from vramplan.plan.space import KNOWN_AXES, axis_name
    out = {}
    for item in items:
        name, eq, values = item.partition("=")
        axis = axis_name(name)
        out[axis] = tuple(parse_scalar(v) for v in values.split(",")) if eq else KNOWN_AXES[axis]
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
    from vramplan.plan.answers import compare_answer
    from vramplan.plan.compare import compare_to_dict, default_strategies
    spec = _SPEC_FROM_ARGS(args)
    if args.tiers:
        return _tiers(spec, args)
    strategies = None
    if args.strategy or args.strategies:
        strategies = [_strategy(s) for s in args.strategy or []]
        if args.strategies:
            strategies += _read_strategies(args.strategies)
        if args.with_defaults:
            strategies = default_strategies(spec) + strategies
    rows, ev = compare_answer(spec, strategies=strategies, headroom=args.headroom, mfu=args.mfu)
    say_notes(args)
    if args.plot:
        from vramplan.report.plots import plot_compare
        plot_compare(rows, args.plot, capacity_bytes=ev.gpu.memory_bytes)
    status = 1 if rows[0].fits is False else 0  # the job as given, as `estimate` answers
    fmt = _format(args)
    if fmt == "json":
        print(json.dumps(compare_to_dict(rows), indent=2))
        return status
    from vramplan.report.answers import compare_table, parallel_lines
    table = compare_table(rows, _("{model} on {gpu} ({usable} GiB usable): strategies").format(
        model=spec.model or _("model"), gpu=ev.gpu.name, usable=_gib(ev.limit_bytes)))
    if rows[0].estimate is not None:
        table.notes += [_("as given: {line}").format(line=tr(line)) for line in parallel_lines(rows[0].estimate)]
    _print(table, fmt)
    return status


def _format(args) -> str:
    from vramplan.cli.flags import answer_format
    return answer_format(args)


def _print(table, fmt: str) -> None:
    text = table.render(fmt)
    if text is None:
        table.print_rich()
    else:
        print(text, end="")


def _strategy(text: str):
    """Flag words (`--zero-stage 3 --gradient-checkpointing full`) or `NAME key=value ...`."""
    from vramplan.plan.compare import Strategy
    if any(w.startswith("--") for w in text.split()):
        from vramplan.cli.flags import strategy_from_flags
        return strategy_from_flags(text)
    strategy = Strategy.parse(text)
    if not strategy.changes:
        raise SpecError("strategy", f"no change in {text!r}; e.g. \"--zero-stage 3 --gradient-checkpointing full\"")
    return strategy


def _tiers(spec, args) -> int:
    from vramplan.plan.answers import parse_headroom
    from vramplan.plan.tiers import gpu_tiers, tiers_summary
    unread = [flag for flag, given in (("--strategy", args.strategy), ("--strategies", args.strategies),
                                       ("--with-defaults", args.with_defaults), ("--plot", args.plot),
                                       ("--mfu", args.mfu is not None),
                                       (f"--format {args.format}", args.format not in (None, "table", "json")))
              if given]
    if unread:  # each was skipped without a word: the tiers table has its own strategies, no picture
        raise SpecError("tiers", f"{unread[0]} is not read with --tiers (every catalog GPU, its own least "
                                 "change); drop one of them")
    rows = gpu_tiers(spec, headroom_bytes=0 if args.headroom is None else parse_headroom(args.headroom, 0))
    if _format(args) == "json":
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
    """A YAML/JSON list of {name, changes} (or a mapping whose `strategies` is one)."""
    from vramplan.files import FileReadError, read_document
    from vramplan.plan.compare import Strategy
    try:
        data = read_document(path)
    except FileReadError as exc:
        raise SpecError("strategies", str(exc)) from None
    items = data.get("strategies") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise SpecError("strategies", f"{path} must hold a list of entries, each a name and its changes")
    if not items:  # the comparison would be the baseline alone
        raise SpecError("strategies", f"{path} holds no strategies; list entries like "
                        "{name: zero3, changes: {parallel.zero_stage: 3}}")
    for k, item in enumerate(items):
        if not (isinstance(item, dict) and "name" in item and isinstance(item.get("changes") or {}, dict)):
            raise SpecError("strategies", f"{path}: entry {k + 1} must be a mapping with a name and its changes, "
                            f"got {item!r}")
        if not item.get("changes"):  # a row repeating the baseline, as --strategy refuses
            raise SpecError("strategies", f"{path}: entry {k + 1} ({item['name']}) changes nothing; give its "
                            "changes, e.g. {parallel.zero_stage: 3}")
        unknown = set(item) - {"name", "changes"}
        if unknown:
            raise SpecError("strategies", f"{path}: entry {k + 1} has {', '.join(map(str, sorted(unknown, key=str)))}; "
                            "an entry holds name and changes only")
        first = next(j for j, other in enumerate(items) if str(other["name"]) == str(item["name"]))
        if first < k:  # two rows of the answer under one name
            raise SpecError("strategies", f"{path}: entries {first + 1} and {k + 1} are both named "
                            f"{str(item['name'])!r}; give each entry a name of its own")
    return [Strategy(name=str(i["name"]), changes=dict(i.get("changes") or {})) for i in items]


# ------------------------------------------------------------------ fit
def cmd_fit(args) -> int:
    spec = _SPEC_FROM_ARGS(args)
    from vramplan.plan.answers import fit_answer, fit_evaluator
    ev = fit_evaluator(spec, headroom=args.headroom, mfu=args.mfu)
    axes = _parse_vary(args.vary)
    if axes is not None and not args.only:
        from vramplan.plan.space import default_axes
        axes = {**default_axes(spec, ev.desc), **axes}
    if args.maximize and args.minimize:  # two questions: --minimize was answered as if not given
        raise SpecError("minimize", f"--maximize {args.maximize} and --minimize num_gpus ask two questions; keep one")
    if args.only and not args.vary:  # "search only the --vary axes" with none searched the defaults
        raise SpecError("only", "searches only the --vary axes, and none is given; add --vary NAME=v1,v2 or drop --only")
    if args.max_gpus is not None and not args.minimize:
        raise SpecError("max_gpus", "bounds --minimize num_gpus; add --minimize num_gpus or drop --max-gpus")
    goal = f"--maximize {args.maximize}" if args.maximize else "--minimize num_gpus" if args.minimize else None
    if goal:  # these answer one layout: --top-k and --emit were skipped without a word
        for flag, given in (("--top-k", args.top_k is not None), ("--emit", args.emit),
                            (f"--vary {args.maximize}", args.maximize and axes and args.maximize in axes)):
            if given:
                raise SpecError(flag.split()[0].lstrip("-").replace("-", "_"),
                                f"{flag} is not read with {goal} (one answer, the search's own values); drop one")
    args.top_k = 5 if args.top_k is None else args.top_k
    if args.maximize:
        return _fit_maximize(spec, ev, axes, args)
    if args.minimize:
        return _fit_minimize(spec, ev, axes, args)
    from vramplan.cli.progress import SearchProgress, progress_wanted
    if progress_wanted(args):
        with SearchProgress() as progress:
            report, _ev = fit_answer(spec, evaluator=ev, axes=axes, top_k=args.top_k, progress=progress)
    else:
        report, _ev = fit_answer(spec, evaluator=ev, axes=axes, top_k=args.top_k)
    say_notes(args)
    if args.plot and report.results:
        from vramplan.report.plots import plot_breakdown
        plot_breakdown(report.results[0].estimate, args.plot)
    fmt = _format(args)
    if args.emit and report.results:
        return _emit(report.results, args.emit)
    if fmt == "json":
        print(json.dumps(report.to_dict(), indent=2))
        return 0 if report.results else 1
    _render_fit(report, ev, fmt)
    return 0 if report.results else 1


def _emit(results, what: str) -> int:
    """The fastest layout the format can express, as a DeepSpeed JSON or a TrainingArguments
    fragment on stdout; which one it is goes to stderr."""
    from vramplan.report.emit import deepspeed_config, training_args
    emit = deepspeed_config if what == "deepspeed" else training_args
    why: list[str] = []
    for i, r in enumerate(results, 1):
        try:
            out = emit(r.spec)
        except SpecError as exc:
            reason = str(exc).split(": ", 1)[-1]
            why += [reason] if reason not in why else []
            continue
        print("vramplan: " + _("{what} for layout #{i} ({layout})").format(what=what, i=i, layout=short_layout(r.changes)),
              file=sys.stderr)
        print(json.dumps(out, indent=2))
        return 0
    raise SpecError("emit", f"none of the {len(results)} layouts has a {what} form: " + "; ".join(why))


_SHORT = {"gradient_checkpointing": "ckpt", "parallel.zero_stage": "zero",
          "parallel.offload_optimizer": "offload", "parallel.offload_params": "offload_params",
          "micro_batch_size": "mb", "grad_accum_steps": "ga"}


def short_layout(changes: dict) -> str:
    """'ckpt=full zero=3 tp=2 mb=4 ga=8' for a changes mapping."""
    return " ".join(f"{_SHORT.get(k, k.split('.')[-1])}={v}" for k, v in changes.items())


def _render_fit(report, ev, fmt: str = "table") -> None:
    from vramplan.report.answers import fit_table
    from vramplan.report.emit import command_line
    if report.results:
        table = fit_table(report, ev.gpu.name)
        try:
            table.notes.append(_("#1 as a command: ") + command_line(report.results[0].spec))
        except SpecError as exc:
            table.notes.append(f"#1: {localize(str(exc))}")
        table.notes.append(_("--emit deepspeed | training-args prints #1 as a DeepSpeed JSON or TrainingArguments"))
        _print(table, fmt)
        return
    note = _(" (interrupted: best so far)") if report.interrupted else ""
    print(_("none of {total:,} layouts fits on {gpu} ({estimates} estimates, {seconds:.2f} s){note}").format(
        total=report.candidates_total, gpu=ev.gpu.name, estimates=report.estimates_computed,
        seconds=report.elapsed_s, note=note))
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
    if _format(args) == "json":
        print(json.dumps(solved.to_dict(), indent=2))
    elif solved.value is None:
        print(_("no layout fits even at {name}=1 on {gpu}").format(name=args.maximize, gpu=ev.gpu.name))
    else:
        print(_("largest {name} that fits on {gpu}: {value} ({gib} GiB, {time}), with "
                "gradient_checkpointing={ckpt}, parallel={parallel}").format(
            name=args.maximize, gpu=ev.gpu.name, value=solved.value, gib=_gib(solved.estimate.device_bytes),
            time=_per_step(solved.step), ckpt=solved.spec.gradient_checkpointing.value,
            parallel=solved.spec.parallel.to_dict() if not solved.spec.parallel.is_trivial else 'none'))
    return 0 if solved.value else 1


def _fit_minimize(spec, ev, axes, args) -> int:
    from vramplan.plan.solve import fewest_gpus
    max_gpus = 1024 if args.max_gpus is None else args.max_gpus
    n, report = fewest_gpus(spec, evaluator=ev, axes=axes, max_gpus=max_gpus)
    if _format(args) == "json":
        print(json.dumps({"num_gpus": n, "fit": report.to_dict()}, indent=2))
    elif n is None:
        print(_("does not fit on {n} x {gpu} in any layout searched").format(n=max_gpus, gpu=ev.gpu.name))
    else:
        best = report.results[0]
        print(_("fewest GPUs: {n} x {gpu}, with {changes} ({gib} GiB, {time})").format(
            n=n, gpu=ev.gpu.name, changes=best.changes, gib=_gib(best.estimate.device_bytes),
            time=_per_step(best.step)))
    return 0 if n else 1


def _per_step(step) -> str:
    """'0.123 s/step', or that no step-time model covers the model (plan.steptime.StepTime.modelled)."""
    return _("{seconds:.3f} s/step").format(seconds=step.total_s) if step.modelled else _("step time not modelled")


# ------------------------------------------------------------------ check
def cmd_check(args) -> int:
    from vramplan.check import NoGPUError, check
    from vramplan.plan.answers import parse_headroom
    spec = _SPEC_FROM_ARGS(args)
    try:
        result = check(spec, device=args.device, raise_error=False,
                       headroom_bytes=parse_headroom(args.headroom, 0))
    except NoGPUError as exc:
        from vramplan.i18n.errors import error_line
        print(error_line(f"device: {localize(exc.detail)}"), file=sys.stderr)
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
    c.add_argument("--strategy", action="append",
                   help=_("the command line's own flags, e.g. \"zero3 --zero-stage 3 --gradient-checkpointing full\" "
                          "(leading words name the row), or 'NAME key=value ...' (repeatable)"))
    c.add_argument("--strategies", help=_("YAML/JSON file: a list of {name, changes}"))
    c.add_argument("--with-defaults", action="store_true", help=_("keep the built-in strategies too"))
    c.add_argument("--tiers", action="store_true", help=_("every catalog GPU: the least change that fits"))
    _common(c)
    c.set_defaults(func=cmd_compare)
    f = sub.add_parser("fit", help=_("layouts that fit, ranked by estimated step time"))
    add_spec_args(f)
    f.add_argument("--top-k", type=int, default=None)  # 5 (cmd_fit): None tells it was not given
    f.add_argument("--vary", action="append", help=_("open an axis: NAME or NAME=v1,v2 (repeatable)"))
    f.add_argument("--only", action="store_true", help=_("search only the --vary axes"))
    f.add_argument("--maximize", choices=("micro_batch_size", "seq_len"))
    f.add_argument("--minimize", choices=("num_gpus",))
    f.add_argument("--max-gpus", type=int, default=None)
    f.add_argument("--emit", choices=("deepspeed", "training-args"),
                   help=_("print the best layout as a DeepSpeed JSON or a TrainingArguments fragment"))
    _common(f)
    f.set_defaults(func=cmd_fit)
    k = sub.add_parser("check", help=_("compare the estimate with a local GPU's free memory"))
    add_spec_args(k)
    k.add_argument("--device", type=int, default=None, help=_("local GPU index (default 0)"))
    k.add_argument("--headroom", default=None, help=_("memory to keep free: 2GiB, 1.5GB, 512MiB"))
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=cmd_check)


def _common(p) -> None:
    p.add_argument("--headroom", default=None, help=_("memory to keep free: 2GiB, 1.5GB, 5%%, 0.05 "
                                                  "(fit's default: what keeps the estimate's upper bound on the GPU; 0 for none)"))
    p.add_argument("--mfu", type=float, default=None, help=_("model FLOPs utilization (default 0.40)"))
    p.add_argument("--plot", help=_("write a picture: .png/.svg (matplotlib) or .html"))
    from vramplan.cli import add_format_args
    add_format_args(p)

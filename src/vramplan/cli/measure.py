"""``vramplan measure``: measure one job and put the estimate beside it.

``measure_main(args)`` takes the parsed argparse namespace of the lead's CLI
(``vramplan.cli``: the spec flags plus ``device``, ``fake``, ``trace``,
``json``) and returns the result dict; without ``--json`` it also prints a
short table (and, with ``--trace``, the tensors alive at the peak).

JSON shape (schema ``vramplan.measure/1``)::

    {"schema", "device", "job", "runner": {library, version, entry[, note]} | null,
     "measured": {peak_allocated_bytes, phases {forward, backward, optimizer},
                  params_bytes, grad_bytes, optimizer_state_bytes,
                  activation_bytes_end_of_forward, peak_phase, phase_peaks,
                  [peak_reserved_bytes, device_bytes on CUDA]} | null,
     "estimated": <vramplan.estimate(spec).to_dict()> | null,
     "error": {peak, phases {forward, backward, optimizer}, params, grads, optimizer_states,
               activations_end_of_forward: estimate / measured - 1} | null,
     "failure": {"stage", "type", "message"} | null,
     ["trace": {snapshot name: [raw storages]} with --trace],
     ["allocator_trace": measure/cuda_trace.py's compact trace, "allocator": {allocations,
      measured_reserved_bytes, model_on_trace_reserved_bytes, estimate_replay_reserved_bytes}
      with --trace on CUDA]}
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any

from vramplan.spec import SpecError

SCHEMA = "vramplan.measure/1"


def _spec(args) -> Any:
    """The JobSpec the flags describe (the lead's parser), else --spec alone."""
    try:
        from vramplan.cli.main import spec_from_args
    except ImportError:
        spec_from_args = None
    if spec_from_args is not None and hasattr(args, "model"):
        return spec_from_args(args)
    from vramplan import load_spec

    return load_spec(getattr(args, "spec"))


def _device(args) -> str:
    import re

    import torch
    device = getattr(args, "device", None)
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise SpecError("device", f"expected cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecError("device", "no CUDA GPU here (torch.cuda.is_available() is False); use --device cpu or --fake")
    if ":" in device and int(device[5:]) >= torch.cuda.device_count():
        raise SpecError("device", f"no GPU {device}: {torch.cuda.device_count()} visible")
    return device


def _fits_host(spec) -> None:
    """A CPU measurement holds the step's tensors in this machine's RAM (every rank's, for
    the ranks it starts): a job far past it (llama-3.1-405b) would swap or be killed after
    minutes, so it is refused before the model is built."""
    est, _ = _estimated(spec)
    free = _available_ram()
    if est is None or free is None:
        return
    need = est.peak_allocated_bytes * spec.num_gpus
    if need > free:
        raise SpecError("device", f"measuring this job on cpu holds about {need / 2**30:,.1f} GiB ({spec.num_gpus} "
                        f"process(es) at the estimate's peak) and this machine has {free / 2**30:,.1f} GiB "
                        "available; use --fake (FakeTensorMode, no memory) or a smaller job")


def _available_ram() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None: no guess."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _estimated(spec):
    """(Estimate or None, failure dict or None)."""
    try:
        from vramplan import estimate
    except ImportError:
        return None, None
    try:
        return estimate(spec), None
    except Exception as exc:  # the estimate is a companion; never lose the measurement
        return None, {"stage": "estimate", "type": type(exc).__name__, "message": str(exc)}


def _rel(est: int, measured: int) -> float | None:
    return None if not measured else est / measured - 1


def attributed_errors(est, measured: dict) -> dict:
    """Relative error of the estimate per attributable term: the peak, each phase, and the
    model state (weights, gradients, optimizer states: as alive in the optimizer step) and
    the activations alive at the end of forward (saved tensors plus the loss's)."""
    roles = tuple(est.models)  # a multi-model job keys each model's terms 'role/group/...'

    def kind(live, *groups: str, trained_only: bool = False) -> int:
        # the meter's params are the trained model's: a frozen reference or teacher is not
        # among them, so weights count only for the roles that hold gradients
        ps = [""] + [r + "/" for r in roles if not trained_only or live.total(r + "/gradients/")]
        return sum(live.total(p + g) for g in groups for p in ps)

    opt = [e for e in est.events if e.phase == "optimizer"]
    fwd = [e for e in est.events if e.label.startswith("end of forward")]
    out = {"peak": _rel(est.peak_allocated_bytes, measured["peak_allocated_bytes"]),
           "phases": {k: _rel(est.phases.get(k, 0), v) for k, v in measured["phases"].items()}}
    if opt:
        live = opt[0].live
        out["params"] = _rel(kind(live, "weights/", trained_only=True), measured.get("params_bytes", 0))
        out["grads"] = _rel(kind(live, "gradients/"), measured.get("grad_bytes", 0))
        out["optimizer_states"] = _rel(kind(live, "optimizer/", "master_weights/"),
                                       measured.get("optimizer_state_bytes", 0))
    if fwd:
        live = fwd[0].live
        acts = kind(live, "activations/", "logits/log_softmax", "logits/labels", "logits/softcap")
        out["activations_end_of_forward"] = _rel(acts, measured.get("activation_bytes_end_of_forward", 0))
    return out


def measure_main(args) -> dict:
    """Measure the job ``args`` describes; return the JSON-ready dict."""
    from vramplan.measure import measure

    spec = _spec(args)  # spec errors propagate: the CLI turns them into one line
    fake = bool(getattr(args, "fake", False))
    if fake and getattr(args, "device", None) is not None:  # was ignored: any word ran the fake step
        raise SpecError("device", "--fake runs under FakeTensorMode on no device; drop --device or --fake")
    device = "fake" if fake else _device(args)
    if device == "cpu":
        _fits_host(spec)
    from vramplan.cli.flags import say_notes
    say_notes(args)
    trace = bool(getattr(args, "trace", False))
    out: dict = {"schema": SCHEMA, "device": device, "job": spec.to_dict(), "runner": None,
                 "measured": None, "estimated": None, "error": None, "failure": None}
    from vramplan.cli.progress import stages
    show = sys.stderr.isatty() and not getattr(args, "json", False)
    with stages(show, [f"measure: building the model and running training steps ({device})",
                       "estimate: the same job"]) as step:
        step(f"measure: building the model and running training steps ({device})")
        try:
            # the trainers print their logs to stdout (transformers' Trainer.log without a
            # progress bar): keep stdout for the answer, so `--json` stays one JSON document
            with contextlib.redirect_stdout(sys.stderr):
                result = measure(spec, device="cpu" if fake else device, fake=fake, trace=trace)
        except (ValueError, NotImplementedError, RuntimeError) as exc:
            out["failure"] = {"stage": "measure", "type": type(exc).__name__, "message": str(exc)}
            result = None
        step("estimate: the same job")
        est, est_failure = _estimated(spec)
    if result is not None:
        measured = result.to_dict()
        out["device"] = measured.pop("device")
        out["runner"] = measured.pop("runner", None)
        out["measured"] = measured
        if trace and result.trace is not None:
            out["trace"] = {name: result.trace.raw(name) for name in result.trace.names()}
        trace_doc = measured.pop("allocator_trace", None)
        if trace_doc is not None:
            out["allocator_trace"] = trace_doc
            out["allocator"] = allocator_check(trace_doc, measured.get("peak_reserved_bytes"), est, spec)
    out["estimated"] = est.to_dict() if est is not None else None
    out["failure"] = out["failure"] or est_failure
    if est is not None and out["measured"]:
        out["error"] = attributed_errors(est, out["measured"])
    if not getattr(args, "json", False):
        print(render(out, result.trace if result is not None and trace else None))
    return out


def refusal_line(result: dict) -> str | None:
    """The error line of a job the measure stage refused as given (a task or setting it does
    not build: ValueError, NotImplementedError), as the estimate's own refusals; None for a
    run that measured, or failed while running. The document keeps the failure too."""
    failure = result.get("failure") or {}
    if result.get("measured") is not None or failure.get("stage") != "measure" or \
            failure.get("type") not in ("ValueError", "NotImplementedError"):
        return None
    from vramplan.spec.enums import user_error_line
    return user_error_line(ValueError(failure.get("message", "")))


def allocator_check(trace_doc: dict, measured_reserved: int | None, est, spec) -> dict:
    """What the allocator did on this run against the model: the model replaying the run's
    own allocations (the allocator's policy alone), and the estimate's replay of its event
    list (the step as vramplan imagines it), beside the measured max_memory_reserved."""
    from vramplan.allocator.trace import is_marker, ops, replay_ops
    from vramplan.spec.alloc_conf import parse_alloc_conf
    seq = ops(trace_doc)
    on_trace, _ = replay_ops(seq, parse_alloc_conf(spec.alloc_conf))
    alloc = est.allocator if est is not None else None
    return {"allocations": sum(1 for kind, _, size, _ in seq if kind == "a" and not is_marker(trace_doc, size)),
            "measured_reserved_bytes": measured_reserved,
            "model_on_trace_reserved_bytes": on_trace,
            "estimate_replay_reserved_bytes": alloc.reserved_bytes if alloc is not None else None}


def render(out: dict, trace=None) -> str:
    """A plain-text table: measured beside estimated, in bytes and GiB."""
    from vramplan.i18n import _
    from vramplan.measure.trace import fmt_bytes

    lines = [_("device: {device}").format(device=out["device"])]
    runner = out.get("runner")
    if runner:
        note = f" ({runner['note']})" if runner.get("note") else ""
        lines.append(_("ran: {library} {version} {entry}{note}").format(
            library=runner["library"], version=runner["version"], entry=runner["entry"], note=note))
    if out["failure"]:
        lines.append(_("failed ({stage}): {message}").format(stage=out["failure"]["stage"],
                                                             message=out["failure"]["message"]))
    m = out["measured"]
    if m:
        rows = [("peak_allocated_bytes", m["peak_allocated_bytes"])]
        rows += [(f"phases.{k}", v) for k, v in m["phases"].items()]
        rows += [(k, m[k]) for k in ("params_bytes", "grad_bytes", "optimizer_state_bytes",
                                     "activation_bytes_end_of_forward")]
        est = _estimated_peak(out["estimated"])
        for name, value in rows:
            lines.append(f"  {name:34s} {value:>15d}  {fmt_bytes(value):>11s}")
        lines.append(f"  {'peak_phase':34s} {m['peak_phase']:>15s}")
        if est is not None:
            err = (est - m["peak_allocated_bytes"]) / max(1, m["peak_allocated_bytes"])
            label = _pad(_("estimated peak"), 34)
            lines.append(f"  {label} {est:>15d}  {fmt_bytes(est):>11s}  ({err:+.1%})")
        for name, value in (out["error"] or {}).items():
            if isinstance(value, float):
                label = _pad(_("error of {name}").format(name=name), 34)
                lines.append(f"  {label} {value:>+15.2%}")
    check = out.get("allocator")
    if check:
        lines.append(_("allocator: {n} allocations traced; max_memory_reserved {measured}, the model on these "
                       "allocations {model}, the estimate's replay {replay}").format(
            n=check["allocations"], measured=_gib(check["measured_reserved_bytes"]),
            model=_gib(check["model_on_trace_reserved_bytes"]), replay=_gib(check["estimate_replay_reserved_bytes"])))
    if trace is not None:
        for name in ("peak", "end_of_forward"):
            if name in trace.snapshots:
                lines.append(trace.render(name, limit=40))
    return "\n".join(lines)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _pad(text: str, width: int) -> str:
    """Left-justify to `width` terminal columns (a CJK character takes two)."""
    import unicodedata
    cols = sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)
    return text + " " * max(0, width - cols)


def _estimated_peak(estimated: dict | None) -> int | None:
    if not estimated:
        return None
    for key in ("peak_allocated_bytes", "allocated_bytes", "peak_bytes"):
        value = estimated.get(key)
        if isinstance(value, int):
            return value
    return None


if __name__ == "__main__":  # python -m vramplan.cli.measure SPEC [--fake] [--trace]
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m vramplan.cli.measure")
    ap.add_argument("spec")
    ap.add_argument("--device", default=None)
    ap.add_argument("--fake", action="store_true")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    res = measure_main(ns)
    if ns.json:
        json.dump(res, sys.stdout, indent=2)

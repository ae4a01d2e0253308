#!/usr/bin/env python3
"""The accuracy grid: vramplan's estimate against measured training steps, case by case.

    python bench/accuracy/grid.py                   # every case of grid_cases.yaml on CPU
    python bench/accuracy/grid.py --ci              # the `ci: true` subset; exit 1 outside the targets
    python bench/accuracy/grid.py --only gemma2     # cases whose name contains a substring
    python bench/accuracy/grid.py --resume          # skip cases already in the results file
    python bench/accuracy/grid.py --summary         # print the table of a results file, run nothing
    python bench/accuracy/grid.py --job NAME        # print one case's job as JSON (for trace_case.py)
    python bench/accuracy/grid.py --device cuda     # the same grid on this machine's GPU
    python bench/accuracy/grid.py --device cuda --not-in results-cuda-A.json   # cases A lacks

Each real case runs in its own fresh process (the CPU meter counts every tensor alive
in the process, so nothing may leak from one case to the next); `fake: true` cases run
under FakeTensorMode at catalog sizes.  Writes results-cpu.json (or
results-cuda-<gpu>.json) beside this script: the machine and library versions, and per
case the job, measured and estimated peak, phases and peak phase, the signed relative
error of the peak and of each phase, and the run time.

Targets (issue 3), on real CPU cases with `backend: cpu`: median |peak error| <= 2%,
worst <= 5%, every phase within 5%.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
sys.path.insert(0, str(SRC))

CASES = HERE / "grid_cases.yaml"
PHASES = ("forward", "backward", "optimizer")
PHASE_KINDS = {"fwd": "forward", "bwd": "backward", "opt": "optimizer"}
CATEGORIES = ("architecture", "precision", "method", "optimizer", "checkpointing", "attention")
TARGET_MEDIAN, TARGET_WORST, TARGET_PHASE = 0.02, 0.05, 0.05
SCHEMA_VERSION = 1
CASE_TIMEOUT_S = 600

# One case in a fresh interpreter; prints one JSON line: the MeasureResult, seconds, GPU name.
CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from vramplan.measure import measure
job, device, fake = json.loads(sys.argv[2]), sys.argv[3], sys.argv[4] == '1'
t0 = time.perf_counter()
res = measure(job, device=device, fake=fake).to_dict()
seconds = time.perf_counter() - t0
name = None
if device == 'cuda':
    import torch
    name = torch.cuda.get_device_name()
print(json.dumps({'measured': res, 'seconds': seconds, 'gpu': name}))
"""


# ---------------------------------------------------------------- cases

def load_cases(path: Path = CASES) -> list[dict]:
    """Cases as {name, fake, ci, job}: each case's keys laid over `defaults`."""
    import yaml

    data = yaml.safe_load(path.read_text())
    cases, seen = [], set()
    for raw in data["cases"]:
        raw = dict(raw)
        fake, ci, name = raw.pop("fake", False), raw.pop("ci", False), raw.pop("name", None)
        job = {**data["defaults"], **raw}
        name = name or case_name(job, fake)
        if name in seen:
            raise ValueError(f"{path.name}: two cases are named {name!r}; give one a `name`")
        seen.add(name)
        cases.append({"name": name, "fake": fake, "ci": ci, "job": job})
    return cases


def architecture(job: dict) -> str:
    model = job["model"]
    if isinstance(model, dict):
        return model["model_type"]
    from vramplan.catalog import find_model

    return find_model(model).config["model_type"]


def _short_targets(targets) -> str:
    if isinstance(targets, str):
        return targets
    return "+".join(t.removesuffix("_proj") for t in targets)


def method_label(job: dict) -> str:
    """full | lora-r8-q+v[-d0.1][-dora][-rslora][-mts] | freeze-L-1+lm_head"""
    method = job.get("method", "full")
    if method == "lora":
        lora = job.get("lora", {})
        label = f"lora-r{lora.get('r', 8)}-{_short_targets(lora.get('target_modules', ['q_proj', 'v_proj']))}"
        label += f"-d{lora['dropout']}" if lora.get("dropout") else ""
        label += "-dora" if lora.get("use_dora") else ""
        label += "-rslora" if lora.get("use_rslora") else ""
        return label + ("-mts" if lora.get("modules_to_save") else "")
    if method == "freeze":
        fr = job.get("freeze", {})
        parts = [f"L{','.join(map(str, fr.get('trainable_layers', [])))}", *fr.get("trainable_modules", [])]
        return "freeze-" + "+".join(parts)
    return method


def optimizer_label(job: dict) -> str:
    opt = job.get("optimizer", "adamw")
    if job.get("optimizer_in_backward"):
        return optimizer_label({k: v for k, v in job.items() if k != "optimizer_in_backward"}) + "-in-backward"
    if opt in ("galore-adamw", "apollo-adamw"):
        low = job.get("low_rank") or {}
        targets = low.get("target_modules", "all-linear")
        return f"{opt}-r{low.get('rank')}-{_short_targets(targets)}"
    if opt == "adamw":
        return f"adamw-{job.get('optimizer_impl') or 'default'}"
    if opt == "sgd":
        label = "sgd-momentum" if job.get("momentum", 0.0) else "sgd"
        return label + ("-nowd" if job.get("weight_decay", 0.01) == 0 else "")
    return opt


def case_name(job: dict, fake: bool) -> str:
    model = job["model"] if isinstance(job["model"], str) else architecture(job)
    parts = [model, f"b{job['micro_batch_size']}s{job['seq_len']}", job["precision"], method_label(job),
             optimizer_label(job), job["attention"],
             "gc" if job["gradient_checkpointing"] != "none" else "nogc"]
    if job.get("grad_accum_steps", 1) > 1:
        parts.append(f"accum{job['grad_accum_steps']}")
    if job.get("task", "sft") != "sft":
        parts.append(job["task"])
    return ("fake:" if fake else "") + "/".join(parts)


def categories(job: dict) -> dict[str, str]:
    return {"architecture": architecture(job), "precision": job["precision"],
            "method": job.get("method", "full"), "optimizer": optimizer_label(job).removesuffix("-nowd"),
            "checkpointing": job["gradient_checkpointing"], "attention": job["attention"]}


# ---------------------------------------------------------------- running

def measure_in_subprocess(job: dict, device: str, fake: bool) -> dict:
    args = [sys.executable, "-c", CHILD, str(SRC), json.dumps(job), device, "1" if fake else "0"]
    env = dict(os.environ)
    if job.get("alloc_conf"):  # read by the caching allocator when CUDA starts in the child
        env["PYTORCH_CUDA_ALLOC_CONF"] = job["alloc_conf"]
    proc = subprocess.run(args, capture_output=True, text=True, check=False, timeout=CASE_TIMEOUT_S, env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip()[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def estimate(job: dict) -> dict:
    import vramplan

    est = vramplan.estimate(vramplan.load_spec(job)).to_dict()
    est.pop("spec", None)
    return est


def rel(est: int, meas: int) -> float:
    return (est - meas) / meas if meas else float("nan")


def errors(measured: dict, estimated: dict) -> dict:
    """Signed relative error, (estimate - measured) / measured, of the peak and each phase."""
    out = {"peak": rel(estimated["peak_allocated_bytes"], measured["peak_allocated_bytes"])}
    for ph in PHASES:
        out[ph] = rel(estimated["phases"][ph], measured["phases"][ph])
    out["peak_phase_agrees"] = estimated["peak_phase"] == measured["peak_phase_kind"]
    out.update(cuda_errors(measured, estimated))
    return out


# On CUDA the meter also reads the caching allocator's max_memory_reserved and NVML (the
# process's own used memory, and the whole device's); each is set against the estimate's
# figure for it. `reserved_replay` is the allocator model's own replay of the event list
# (vramplan.allocator), `*_in_bounds` whether the measurement lies inside the estimate's
# error bar for that metric (vramplan.bounds).
CUDA_METRICS = (("reserved", "peak_reserved_bytes", "reserved_bytes"),
                ("process", "process_bytes", "device_bytes"),
                ("device", "device_bytes", "device_bytes"))
BOUND_OF = {"peak": ("peak_allocated_bytes", "allocated"), "reserved": ("peak_reserved_bytes", "reserved"),
            "device": ("device_bytes", "device")}


def unattributed_context(estimated: dict) -> int:
    """Device-level context memory NVML does not charge to the process (catalog
    cuda_context "bytes" - "process_bytes"; 0 where no measurement separates them)."""
    from vramplan.components.runtime import cuda_context_bytes, cuda_context_process_bytes
    gpu = (estimated.get("gpu") or {}).get("name")
    return cuda_context_bytes(gpu) - cuda_context_process_bytes(gpu)


def cuda_errors(measured: dict, estimated: dict) -> dict:
    out = {}
    for name, meas_key, est_key in CUDA_METRICS:
        if measured.get(meas_key):
            want = estimated[est_key]
            if name == "process":  # less what the driver holds for the context uncharged
                want -= unattributed_context(estimated)
            out[name] = rel(want, measured[meas_key])
    replay = (estimated.get("allocator") or {}).get("reserved_bytes")
    if replay and measured.get("peak_reserved_bytes"):
        out["reserved_replay"] = rel(replay, measured["peak_reserved_bytes"])
    bounds = estimated.get("bounds") or {}
    for name, (meas_key, bound_key) in BOUND_OF.items():
        lo_hi = bounds.get(bound_key)
        if lo_hi and measured.get(meas_key) and (name == "peak" or name in out):
            out[f"{name}_in_bounds"] = lo_hi[0] <= measured[meas_key] <= lo_hi[1]
    return out


def drop_shared_device(row: dict) -> None:
    """A case measured side by side with others (--jobs > 1): the device-level NVML figure
    held the other cases' memory too, so it is not compared."""
    if row.get("parallel_jobs", 1) > 1:
        row["error"].pop("device", None)
        row["error"].pop("device_in_bounds", None)


def cuda_job(job: dict, gpu: str | None) -> dict:
    """The job as it ran on the GPU: backend cuda, and the card it ran on (its cuBLAS
    workspaces and CUDA context depend on the architecture) unless the case names one."""
    job = {**job, "backend": "cuda"}
    if gpu and "gpu" not in job:
        job["gpu"] = gpu
    return job


def run_case(case: dict, device: str, gpu: str | None = None) -> dict:
    job = dict(case["job"])
    if device == "cuda" and not case["fake"]:
        job = cuda_job(job, gpu)
    row = {"name": case["name"], "fake": case["fake"], "categories": categories(job), "job": job}
    t0 = time.perf_counter()
    try:
        child = measure_in_subprocess(job, device, case["fake"])
        measured = child["measured"]
        measured["peak_phase_kind"] = PHASE_KINDS.get(measured["peak_phase"].rsplit(".", 1)[-1], "")
        row.update(measured=measured, gpu=child["gpu"], measure_seconds=round(child["seconds"], 2))
        t1 = time.perf_counter()
        row["estimated"] = estimate(job)
        row["estimate_seconds"] = round(time.perf_counter() - t1, 3)
        row["error"] = errors(measured, row["estimated"])
    except Exception as exc:  # a case that cannot run is reported, the grid goes on
        row["failed"] = f"{type(exc).__name__}: {exc}"
    row["wall_seconds"] = round(time.perf_counter() - t0, 2)
    return row


def machine() -> dict:
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
            "python": platform.python_version(),
            **{pkg: version(pkg) for pkg in ("torch", "transformers", "peft", "accelerate")}}


def source_state() -> dict:
    """The commit the estimator and meter came from, and whether src/ had local edits."""
    def git(*args: str) -> str:
        proc = subprocess.run(["git", "-C", str(HERE), *args], capture_output=True, text=True, check=False)
        return proc.stdout.rstrip()

    return {"commit": git("rev-parse", "HEAD").strip(), "src_modified": sorted(
        line[3:] for line in git("status", "--porcelain", "--", str(SRC)).splitlines())}


def results_path(device: str, gpu: str | None) -> Path:
    if device == "cpu":
        return HERE / "results-cpu.json"
    slug = re.sub(r"[^a-z0-9]+", "-", (gpu or "unknown").lower()).strip("-")
    return HERE / f"results-cuda-{slug}.json"


def cuda_name() -> str:
    code = "import torch; print(torch.cuda.get_device_name())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


# ---------------------------------------------------------------- summary

def _stats(errs: list[float]) -> dict:
    a = [abs(e) for e in errs]
    return {"n": len(a), "median_abs": statistics.median(a) if a else None, "worst_abs": max(a) if a else None}


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" in r]
    real = [r for r in ok if not r["fake"]]
    summary = {"real": _stats([r["error"]["peak"] for r in real]),
               "fake": _stats([r["error"]["peak"] for r in ok if r["fake"]]),
               "phases_outside_target": sum(abs(r["error"][ph]) > TARGET_PHASE for r in real for ph in PHASES),
               "phases_total": len(real) * len(PHASES),
               "peak_phase_disagrees": [r["name"] for r in ok if not r["error"]["peak_phase_agrees"]],
               "failed": [r["name"] for r in rows if "failed" in r],
               "by_category": {}}
    for cat in CATEGORIES:
        groups: dict[str, list[float]] = {}
        for r in real:
            groups.setdefault(r["categories"][cat], []).append(r["error"]["peak"])
        summary["by_category"][cat] = {k: _stats(v) for k, v in sorted(groups.items())}
    summary["misses"] = [miss(r) for r in ok if is_miss(r)]
    cuda = {m: _stats([r["error"][m] for r in real if m in r["error"]])
            for m in ("reserved", "reserved_replay", "process", "device")}
    cuda = {m: s for m, s in cuda.items() if s["n"]}
    for name in BOUND_OF:
        flags = [r["error"][f"{name}_in_bounds"] for r in real if f"{name}_in_bounds" in r["error"]]
        if flags:
            cuda[f"{name}_bounds_coverage"] = {"n": len(flags), "inside": sum(flags)}
    if cuda:
        summary["cuda"] = cuda
    m = summary["real"]
    summary["targets_met"] = bool(real) and not summary["failed"] and m["median_abs"] <= TARGET_MEDIAN \
        and m["worst_abs"] <= TARGET_WORST and summary["phases_outside_target"] == 0
    return summary


def is_miss(row: dict) -> bool:
    e = row["error"]
    return abs(e["peak"]) > TARGET_WORST or any(abs(e[ph]) > TARGET_PHASE for ph in PHASES)


def miss(row: dict) -> dict:
    e = row["error"]
    return {"name": row["name"], "peak": e["peak"], **{ph: e[ph] for ph in PHASES},
            "trace": f"python bench/accuracy/grid.py --job '{row['name']}' > /tmp/case.json && "
                     "python bench/accuracy/trace_case.py /tmp/case.json --fake"}


def pct(x) -> str:
    return "   n/a" if x is None else f"{100 * x:6.2f}%"


def signed(x: float) -> str:
    return f"{100 * x:+7.2f}%"


def render(rows: list[dict], summary: dict) -> str:
    lines = [f"{'case':86s} {'peak':>8s} {'fwd':>8s} {'bwd':>8s} {'opt':>8s}  phase(meas/est)  secs"]
    for r in rows:
        if "failed" in r:
            lines.append(f"{r['name'][:86]:86s} FAILED {r['failed'].splitlines()[-1][:120]}")
            continue
        e = r["error"]
        flag = "" if e["peak_phase_agrees"] else " *"
        lines.append(f"{r['name'][:86]:86s} {signed(e['peak'])} " + " ".join(signed(e[p]) for p in PHASES)
                     + f"  {r['measured']['peak_phase_kind'][:3]}/{r['estimated']['peak_phase'][:3]}{flag}"
                     + f"{r['wall_seconds']:>9.1f}")
    lines += ["", f"{'group':32s} {'n':>4s} {'median |err|':>13s} {'worst |err|':>12s}"]
    for label, s in (("all real cases", summary["real"]), ("fake mode (catalog sizes)", summary["fake"])):
        lines.append(f"{label:32s} {s['n']:>4d} {pct(s['median_abs']):>13s} {pct(s['worst_abs']):>12s}")
    for cat, groups in summary["by_category"].items():
        lines.append(f"-- {cat}")
        for key, s in groups.items():
            lines.append(f"   {key:29s} {s['n']:>4d} {pct(s['median_abs']):>13s} {pct(s['worst_abs']):>12s}")
    lines += ["", f"phases outside {TARGET_PHASE:.0%} (real cases): "
              f"{summary['phases_outside_target']} of {summary['phases_total']}",
              f"peak phase disagrees: {len(summary['peak_phase_disagrees'])}",
              f"failed: {len(summary['failed'])} {summary['failed']}",
              f"targets (median <= {TARGET_MEDIAN:.0%}, worst <= {TARGET_WORST:.0%}, phases <= "
              f"{TARGET_PHASE:.0%}): {'MET' if summary['targets_met'] else 'MISSED'}"]
    for metric, s in summary.get("cuda", {}).items():
        if "inside" in s:
            lines.append(f"{metric}: {s['inside']} of {s['n']} measured inside the estimate's bounds")
        else:
            lines.append(f"{metric:32s} {s['n']:>4d} {pct(s['median_abs']):>13s} {pct(s['worst_abs']):>12s}")
    if summary["misses"]:
        lines += ["", f"misses ({len(summary['misses'])}):"]
        for m in summary["misses"]:
            lines.append(f"  {m['name']}  peak {signed(m['peak'])}  "
                         + " ".join(f"{p[:3]} {signed(m[p])}" for p in PHASES))
            lines.append(f"    {m['trace']}")
    return "\n".join(lines)


# ---------------------------------------------------------------- main

def write(path: Path, device: str, gpu: str | None, rows: list[dict], started: dict,
          cases_file: str = CASES.name) -> dict:
    """`source_at_start`/`source_at_end`: the tree can change under a long run (shared checkout)."""
    summary = summarize(rows)
    doc = {"schema_version": SCHEMA_VERSION, "device": device, "gpu": gpu, "machine": machine(),
           "source_at_start": started, "source_at_end": source_state(),
           "cases_file": cases_file, "summary": summary, "cases": rows}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return summary


def select(cases: list[dict], args) -> list[dict]:
    out = [c for c in cases if args.only in c["name"]]
    if args.ci:
        out = [c for c in out if c["ci"]]
    if args.device == "cuda" and not args.with_fake:
        out = [c for c in out if not c["fake"]]
    if args.not_in:  # e.g. the cases another GPU's results file does not hold yet
        seen = {r["name"] for r in json.loads(Path(args.not_in).read_text())["cases"]}
        out = [c for c in out if c["name"] not in seen]
    return out


def reestimate(path: Path, device: str, gpu: str | None) -> int:
    """The measurements do not depend on the estimator: after an estimator change, put the
    current estimates beside the stored measurements (the file records both commits)."""
    doc = json.loads(path.read_text())
    rows = doc["cases"]
    for row in rows:
        if device == "cuda" and not row["fake"]:
            row["job"] = cuda_job(row["job"], doc.get("gpu"))
        if "measured" in row:
            row["estimated"] = estimate(row["job"])
            row["error"] = errors(row["measured"], row["estimated"])
            drop_shared_device(row)
    measured_at = {k: doc.get(k) for k in ("source_at_start", "source_at_end", "machine")}
    summary = write(path, device, gpu or doc.get("gpu"), rows, doc.get("source_at_start", {}),
                    doc.get("cases_file", CASES.name))
    doc = json.loads(path.read_text())
    doc.update(measured_at)  # the measurements keep the source and machine they came from
    doc["estimated_at"] = source_state()
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(render(rows, summary))
    print(f"\nre-estimated {len(rows)} cases in {path}")
    return 0


def as_completed_rows(pool, fn, cases):
    futures = [pool.submit(fn, c) for c in cases]
    for fut in as_completed(futures):
        yield fut.result()


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--only", default="", help="run cases whose name contains this")
    ap.add_argument("--ci", action="store_true", help="the `ci: true` subset; exit 1 outside the targets")
    ap.add_argument("--resume", action="store_true", help="keep cases already in the results file")
    ap.add_argument("--summary", action="store_true", help="print the results file's table, run nothing")
    ap.add_argument("--job", metavar="NAME", help="print this case's job as JSON and exit")
    ap.add_argument("--not-in", metavar="RESULTS", default="",
                    help="skip the cases this results file holds (measured on another machine, say)")
    ap.add_argument("--with-fake", action="store_true", help="with --device cuda, also run the fake cases")
    ap.add_argument("--cases", default=str(CASES), help="cases file (default: grid_cases.yaml here)")
    ap.add_argument("--jobs", type=int, default=1, help="cases run side by side (each in its own process)")
    ap.add_argument("--out", default="", help="results file (default: results-<device>.json here)")
    ap.add_argument("--reestimate", action="store_true",
                    help="keep the file's measurements, recompute estimates and errors with this code")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    cases = load_cases(Path(args.cases))
    if args.job:
        hit = [c for c in cases if c["name"] == args.job]
        if not hit:
            print(f"no case named {args.job!r}", file=sys.stderr)
            return 2
        print(json.dumps(hit[0]["job"]))
        return 0
    gpu = cuda_name() if args.device == "cuda" and not (args.summary or args.reestimate) else None
    path = Path(args.out) if args.out else results_path(args.device, gpu)
    if (args.only or args.ci) and not args.out and not args.summary:  # never clobber the full grid
        path = Path("/tmp") / f"vramplan-grid-{path.name}"
    if args.summary:
        doc = json.loads(path.read_text())
        print(render(doc["cases"], doc["summary"]))
        return 0
    if args.reestimate:
        return reestimate(path, args.device, gpu)
    done = {}
    if args.resume and path.exists():
        done = {r["name"]: r for r in json.loads(path.read_text())["cases"] if "failed" not in r}
    rows, started = [], source_state()
    chosen = select(cases, args)
    order = {c["name"]: i for i, c in enumerate(chosen)}

    def one(case: dict) -> dict:
        return done.get(case["name"]) or run_case(case, args.device, gpu)

    # Cases run in their own processes; --jobs N runs N side by side (CUDA: each process's
    # allocator statistics and NVML per-process memory are its own; the device-level NVML
    # figure is not, so `device` is compared only with --jobs 1).
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for row in pool.map(one, chosen) if args.jobs <= 1 else as_completed_rows(pool, one, chosen):
            if args.jobs > 1 and "error" in row:
                row["parallel_jobs"] = args.jobs
                drop_shared_device(row)
            rows.append(row)
            rows.sort(key=lambda r: order[r["name"]])
            print(render([row], summarize([row])).splitlines()[1], flush=True)
            write(path, args.device, gpu, rows, started, Path(args.cases).name)
    summary = write(path, args.device, gpu, rows, started, Path(args.cases).name)
    print("\n" + render(rows, summary))
    print(f"\nwrote {path}")
    return 0 if summary["targets_met"] or not args.ci else 1


if __name__ == "__main__":
    raise SystemExit(main())

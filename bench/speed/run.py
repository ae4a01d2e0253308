"""Speed benchmark: the estimate in-process, `vramplan estimate` wall time, `fit`'s layouts/s,
for the code before and after a change, measured in the same run.

    .venv/bin/python bench/speed/run.py                     # writes bench/speed/results.json
    .venv/bin/python bench/speed/run.py --baseline 68c3249 --rounds 3

The machine is shared and noisy: each figure is measured in a fresh process per round, the
baseline's and this checkout's rounds alternate (baseline, after, baseline, after ...), and the
medians over rounds are reported, wall time and CPU time (process_time, less sensitive to other
load). The baseline is `git archive <commit>` of this repository, extracted to a temporary folder.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
AXES = {"parallel.zero_stage": (0, 1, 2, 3), "parallel.offload_optimizer": ("none", "cpu"),
        "gradient_checkpointing": ("none", "selective", "full"), "parallel.tp": (1, 2, 4, 8),
        "parallel.pp": (1, 2, 4, 8), "optimizer": ("adamw", "adamw-8bit"),
        "precision": ("bf16", "mixed-bf16"), "loss_impl": ("standard", "chunked")}
CASES = {
    # A 1.5B full fine-tune on 8 x A100-40GB: the fast layouts fit early.
    "qwen2.5-1.5b-8xa100-40gb": {"model": "qwen2.5-1.5b", "gpu": "a100-40gb", "num_gpus": 8,
                                 "micro_batch_size": 8, "grad_accum_steps": 8, "seq_len": 2048},
    # An 8B full fine-tune on 8 x A100-80GB: most fast layouts do not fit.
    "llama-3.1-8b-8xa100-80gb": {"model": "llama-3.1-8b", "gpu": "a100-80gb", "num_gpus": 8,
                                 "micro_batch_size": 8, "grad_accum_steps": 8, "seq_len": 4096},
    # Worst case: nothing fits, so every group of layouts needs at least one estimate.
    "llama-3.1-70b-8xrtx4090-nothing-fits": {"model": "llama-3.1-70b", "gpu": "rtx-4090", "num_gpus": 8,
                                             "micro_batch_size": 8, "grad_accum_steps": 8, "seq_len": 4096},
}
# The default-axes search: `vramplan fit --gpu a100-40gb --num-gpus 8` (ZeRO stage,
# offload, checkpointing, TP, PP, micro-batch).
DEFAULT_FIT = {"model": "llama-3.1-8b", "gpu": "a100-40gb", "num_gpus": 8, "micro_batch_size": 4,
               "grad_accum_steps": 4, "seq_len": 4096}
ESTIMATES = {
    "8b-full-1gpu": {"model": "llama-3.1-8b", "gpu": "a100-80gb", "micro_batch_size": 4},
    "8b-lora-1gpu": {"model": "llama-3.1-8b", "gpu": "a100-80gb", "micro_batch_size": 4, "method": "lora"},
    "8b-8gpu-zero2-tp2": {"model": "llama-3.1-8b", "gpu": "a100-80gb", "num_gpus": 8,
                          "parallel": {"zero_stage": 2, "tp": 2}},
    "70b-zero3-64gpu": {"model": "llama-3.1-70b", "gpu": "a100-80gb", "num_gpus": 64,
                        "parallel": {"zero_stage": 3}},
}


def _timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def measure_estimates(n: int = 30) -> dict:
    """`vramplan.estimate(spec)` (public API, model resolution included), ms per call:
    `repeat` calls it on one spec (what the issue's target names); `distinct` on a new spec
    each call (another seq_len), so nothing memoized for that spec helps."""
    from vramplan import estimate, load_spec
    out = {}
    for name, job in ESTIMATES.items():
        spec = load_spec(job)
        estimate(spec)
        runs = [_timed(lambda: estimate(spec)) for _ in range(n)]
        specs = [load_spec(dict(job, seq_len=1024 + 8 * i)) for i in range(n)]
        fresh = [_timed(lambda s=s: estimate(s)) for s in specs]
        out[name] = {"repeat_wall_ms": 1e3 * statistics.median(r[0] for r in runs),
                     "repeat_cpu_ms": 1e3 * statistics.median(r[1] for r in runs),
                     "distinct_wall_ms": 1e3 * statistics.median(r[0] for r in fresh),
                     "distinct_cpu_ms": 1e3 * statistics.median(r[1] for r in fresh)}
    return out


def measure_fit(job: dict, axes: dict | None, top_k: int) -> dict:
    from vramplan.plan import fit
    from vramplan.spec import load_spec
    spec = load_spec(job)
    c = time.process_time()
    report = fit(spec, axes=axes, top_k=top_k, suggest=False)
    cpu = time.process_time() - c
    return {"layouts": report.candidates_total, "settled": report.candidates_evaluated,
            "checked": getattr(report, "candidates_checked", None), "estimator_calls": report.estimates_computed,
            "wall_s": report.elapsed_s, "cpu_s": cpu,
            "found": len(report.results), "best": report.results[0].changes if report.results else None}


def measure(what: str) -> dict:
    if what == "estimate":
        return measure_estimates()
    if what == "fit_default":
        return measure_fit(DEFAULT_FIT, None, 5)
    return measure_fit(CASES[what], AXES, 10)


def run_child(src: str, what: str) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    proc = subprocess.run([sys.executable, __file__, "--measure", what], env=env, capture_output=True,
                          text=True, check=True)
    return json.loads(proc.stdout)


def run_cli(src: str) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "vramplan", "estimate", "llama-3.1-8b", "--gpu", "a100-80gb", "--json"],
                   env=env, check=True, stdout=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall_s": wall, "cpu_s": after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime}


def _median(rows: list) -> object:
    """Medians of the numbers across rounds (nested dicts); other values from the first round."""
    first = rows[0]
    if isinstance(first, dict):
        return {k: _median([r[k] for r in rows]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return round(statistics.median(rows), 4)
    return first


def baseline_tree(commit: str) -> str:
    out = tempfile.mkdtemp(prefix="vramplan-speed-base-")
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    return os.path.join(out, "src")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", default="68c3249", help="commit measured as 'before' (default: before issue 9's speed work)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fit-rounds", type=int, default=1)
    ap.add_argument("--only", help="comma-separated figures to measure (estimate, cli, fit_default or a fit "
                    "case); the others stay as results.json has them, and the measured ones record their "
                    "own baseline and load under 'partial_runs'")
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    trees = {"before": baseline_tree(args.baseline), "after": os.path.join(ROOT, "src")}
    out: dict = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                             "processor": platform.processor() or platform.machine(),
                             "load_average_at_start": os.getloadavg()},
                 "baseline_commit": args.baseline, "rounds": args.rounds,
                 "method": "each figure a fresh process per round; before/after rounds alternate; medians"}
    plan = [("estimate", args.rounds), ("cli", args.rounds), ("fit_default", args.rounds)]
    plan += [(name, args.fit_rounds) for name in CASES]
    if args.only:
        only = set(args.only.split(","))
        unknown = only - {what for what, _ in plan}
        if unknown:
            ap.error(f"--only: unknown figure(s) {', '.join(sorted(unknown))}")
        plan = [(what, rounds) for what, rounds in plan if what in only]
        path = os.path.join(HERE, "results.json")
        kept = json.load(open(path, encoding="utf-8")) if os.path.exists(path) else {}
        out = dict(kept, partial_runs=dict(kept.get("partial_runs") or {}))
        start = os.getloadavg()
    for what, rounds in plan:
        rows: dict[str, list] = {k: [] for k in trees}
        for _ in range(rounds):
            for k, src in trees.items():
                rows[k].append(run_cli(src) if what == "cli" else run_child(src, what))
        out[what] = {k: _median(v) for k, v in rows.items()}
        for k in trees:
            res = out[what][k]
            if "layouts" in res:
                res["layouts_per_s_wall"] = round(res["layouts"] / res["wall_s"])
                res["layouts_per_s_cpu"] = round(res["layouts"] / res["cpu_s"])
        print(what, json.dumps(out[what]), flush=True)
    if args.only:
        for what, rounds in plan:
            out["partial_runs"][what] = {"baseline_commit": args.baseline, "rounds": rounds,
                                         "load_average_at_start": start, "load_average_at_end": os.getloadavg()}
    else:
        out["machine"]["load_average_at_end"] = os.getloadavg()
    with open(os.path.join(HERE, "results.json"), "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=2)
        fh.write("\n")


if __name__ == "__main__":
    main()

"""Speed benchmark: one estimate in-process, `vramplan estimate` wall time, `fit` over >= 10k layouts.

    .venv/bin/python bench/speed/run.py            # writes bench/speed/results.json

Each fit case reports the layouts in the space, how many the search settled, how many
estimator calls it made, and the wall time; the target is < 2 s for 10k layouts.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time

from vramplan.catalog import find_gpu
from vramplan.estimation import estimate, estimate_model
from vramplan.plan import fit
from vramplan.sources import resolve_model
from vramplan.spec import load_spec

HERE = os.path.dirname(os.path.abspath(__file__))
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


def time_estimate(n: int = 50) -> dict:
    spec = load_spec({"model": "llama-3.1-8b", "gpu": "a100-80gb", "micro_batch_size": 4})
    desc, gpu = resolve_model(spec), find_gpu("a100-80gb")
    core = []
    for _ in range(n):
        t = time.perf_counter()
        estimate_model(desc, spec, gpu)
        core.append(time.perf_counter() - t)
    full = []
    for _ in range(10):
        t = time.perf_counter()
        estimate(spec)
        full.append(time.perf_counter() - t)
    return {"estimate_model_ms_median": 1e3 * statistics.median(core),
            "estimate_with_resolve_ms_median": 1e3 * statistics.median(full)}


def time_cli(n: int = 3) -> dict:
    exe = os.path.join(os.path.dirname(sys.executable), "vramplan")
    walls = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run([exe, "estimate", "llama-3.1-8b", "--gpu", "a100-80gb", "--json"],
                       check=True, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - t)
    return {"vramplan_estimate_wall_s_median": statistics.median(walls)}


def time_fit(name: str, job: dict) -> dict:
    spec = load_spec(job)
    report = fit(spec, axes=AXES, top_k=10, suggest=False)
    return {"case": name, "layouts": report.candidates_total, "settled": report.candidates_evaluated,
            "estimator_calls": report.estimates_computed, "elapsed_s": round(report.elapsed_s, 3),
            "layouts_per_s": round(report.candidates_total / report.elapsed_s),
            "found": len(report.results),
            "best": report.results[0].changes if report.results else None}


def time_default_fit() -> dict:
    """The issue's command: `vramplan fit --spec job.yaml --gpu a100-40gb --num-gpus 8`,
    default axes (ZeRO stage, offload, checkpointing, TP, PP, micro-batch)."""
    spec = load_spec({"model": "llama-3.1-8b", "gpu": "a100-40gb", "num_gpus": 8,
                      "micro_batch_size": 4, "grad_accum_steps": 4, "seq_len": 4096})
    report = fit(spec, top_k=5, suggest=False)
    return {"case": "default-axes llama-3.1-8b 8xa100-40gb", "layouts": report.candidates_total,
            "estimator_calls": report.estimates_computed, "elapsed_s": round(report.elapsed_s, 3),
            "found": len(report.results),
            "best": report.results[0].changes if report.results else None}


def estimate_costs() -> dict:
    """estimate_model's own cost by job shape: what a search pays per estimator call."""
    gpu = find_gpu("a100-80gb")
    out = {}
    for name, job in {"8b-1gpu": {"model": "llama-3.1-8b"},
                      "8b-8gpu-zero2-tp2": {"model": "llama-3.1-8b", "num_gpus": 8,
                                            "parallel": {"zero_stage": 2, "tp": 2}},
                      "70b-8gpu-zero3": {"model": "llama-3.1-70b", "num_gpus": 8,
                                         "parallel": {"zero_stage": 3}}}.items():
        spec = load_spec(job)
        desc = resolve_model(spec)
        times = []
        for _ in range(10):
            t = time.perf_counter()
            estimate_model(desc, spec, gpu)
            times.append(time.perf_counter() - t)
        out[name] = round(1e3 * statistics.median(times), 2)
    return {"estimate_model_ms_median": out}


def main() -> None:
    out = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "processor": platform.processor() or platform.machine()},
           "estimate": time_estimate(), "estimate_by_shape": estimate_costs(), "cli": time_cli(),
           "fit_default": time_default_fit(),
           "fit": [time_fit(name, job) for name, job in CASES.items()]}
    print(json.dumps(out, indent=2))
    with open(os.path.join(HERE, "results.json"), "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=2)
        fh.write("\n")


if __name__ == "__main__":
    main()

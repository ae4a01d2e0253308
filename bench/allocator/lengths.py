#!/usr/bin/env python3
"""Dynamic padding through the allocator model: reserved memory by order of step lengths.

For two jobs (an 8B LoRA and a 1.5B full fine-tune, both with a `lengths` section) it
replays the run's micro-batches through the caching-allocator model with the allocator
state carried from step to step (vramplan.step.lengths), in each batching policy (random,
group-by-length, sorted-longest-first) beside a run of only the longest step, for 50, 100
and 200 steps (seed 0) and for seeds 0-4 of the random order at 100 steps, and times the
replay of the policy's order (length_ops + replay_schedule: CPU seconds of this process,
best of 2, since the machine it ran on was shared; wall seconds beside them).

The length distribution is an assumption, not a measured dataset: a long-tailed chat-SFT
shape given as percentiles of seq_len (p50 1/6, p90 1/3, p99 3/4, max = seq_len). The
figures are the model's; no GPU has checked them yet (replay_cuda.py can, per step list).

    python bench/allocator/lengths.py            # prints a table, writes results-lengths.json
"""
from __future__ import annotations

import json
import os
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GiB = 2**30
JOBS = {
    "llama-3.1-8b lora r16, b4, seq 4096, full ckpt": {
        "model": "llama-3.1-8b", "method": "lora", "micro_batch_size": 4, "seq_len": 4096,
        "gradient_checkpointing": "full", "gpu": "H100-80GB"},
    "qwen2.5-1.5b full, b4, seq 2048": {
        "model": "qwen2.5-1.5b", "micro_batch_size": 4, "seq_len": 2048, "gpu": "H100-80GB"},
}
POLICIES = ("random", "group-by-length", "sorted-longest-first")
STEPS = (50, 100, 200)
SEEDS = (1, 2, 3, 4)


def _shape(seq_len: int) -> dict:
    return {"p50": seq_len // 6, "p90": seq_len // 3, "p99": seq_len * 3 // 4, "max": seq_len}


def _replay(spec, est):
    """(LengthsReplay pieces) for spec: the run in the policy's order, timed alone."""
    from vramplan.components.runtime import blas_workspace_terms
    from vramplan.components.trainable import param_set
    from vramplan.estimation import _replay_capacity
    from vramplan.spec.alloc_conf import parse_alloc_conf
    from vramplan.allocator.schedule import replay_schedule
    from vramplan.step.lengths import length_ops, step_lengths
    desc = est.model
    params = param_set(desc, spec)
    best = wall = None
    for _ in range(2):
        t0, w0 = time.process_time(), time.perf_counter()
        setup, ops_for = length_ops(desc, spec, params, True, blas_workspace_terms(est.gpu.name))
        lengths = step_lengths(spec.lengths, spec.micro_batch_size, spec.seq_len)
        run = replay_schedule(setup, ops_for, lengths, parse_alloc_conf(spec.alloc_conf),
                              _replay_capacity(spec, est.gpu, est.managed_bytes))
        took, wall_took = time.process_time() - t0, time.perf_counter() - w0
        best = took if best is None else min(best, took)
        wall = wall_took if wall is None else min(wall, wall_took)
    return run, best, wall


def measure() -> list[dict]:
    import vramplan
    rows = []
    for name, job in JOBS.items():
        plain = vramplan.estimate(vramplan.load_spec(job))
        cases = [(p, s, 0) for p in POLICIES for s in STEPS] + [("random", 100, seed) for seed in SEEDS]
        for policy, steps, seed in cases:
            spec = vramplan.load_spec({**job, "lengths": {**_shape(job["seq_len"]), "batching": policy,
                                                          "steps": steps, "seed": seed}})
            t0 = time.process_time()
            est = vramplan.estimate(spec)
            whole = time.process_time() - t0
            run, replay_s, wall_s = _replay(spec, est)
            rep = est.lengths
            rows.append({
                "job": name, "policy": policy, "steps": steps, "seed": seed,
                "reserved_gib": round(rep.run.reserved_bytes / GiB, 3),
                "peak_step": rep.run.peak_step, "peak_length": rep.run.peak_length,
                "all_max_gib": round(rep.all_longest.reserved_bytes / GiB, 3),
                "longest_first_gib": round(rep.longest_first.reserved_bytes / GiB, 3),
                "cap_p99": rep.cap_tokens,
                "cap_p99_gib": None if rep.capped is None else round(rep.capped.reserved_bytes / GiB, 3),
                "segments": rep.run.segments, "all_max_segments": rep.all_longest.segments,
                "out_of_memory_step": rep.run.out_of_memory_step,
                "estimate_reserved_gib": round(est.reserved_bytes / GiB, 3),
                "estimate_reserved_fixed_length_gib": round(plain.reserved_bytes / GiB, 3),
                "replayed_steps": run.replayed,
                "run_replay_cpu_s": round(replay_s, 3), "run_replay_wall_s": round(wall_s, 3),
                "estimate_with_lengths_cpu_s": round(whole, 3)})
    return rows


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=HERE).stdout.strip()
    except OSError:
        return "unknown"


def main() -> None:
    rows = measure()
    head = ("job", "policy", "steps", "seed", "reserved_gib", "peak_step", "peak_length", "longest_first_gib",
            "all_max_gib", "cap_p99_gib", "segments", "replayed_steps", "run_replay_cpu_s", "estimate_with_lengths_cpu_s")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join(str(r[k]) for k in head))
    out = {"commit": _commit(), "cpu_count": os.cpu_count(),
           "distribution": "percentiles of seq_len: p50 1/6, p90 1/3, p99 3/4, max = seq_len (assumed)",
           "rows": rows}
    with open(os.path.join(HERE, "results-lengths.json"), "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main()

"""Measured ground truth for DeepSpeed ZeRO 1-3: the real DeepSpeed on its CPU accelerator.

Every case runs `vramplan.measure.deepspeed_run.run_ranks`: N spawned ranks with
DS_ACCELERATOR=cpu, `deepspeed.init_distributed(dist_backend="gloo")`, the job's tiny
random-init model trained by `transformers.Trainer` with `TrainingArguments(use_cpu=True,
deepspeed=<ZeRO config>)` for 2 steps under the exact meter on each rank. The worst rank's
peak over the step phases is compared with `vramplan.estimate` of the same job
(`num_gpus = N`, `parallel.zero_stage`, `parallel.extras.dist_backend: gloo`).

    .venv/bin/python bench/parallel/deepspeed_cpu.py --out bench/parallel/results-deepspeed-cpu.json
    # re-estimate the stored measurements after an estimator change (keeps the old estimate
    # as `estimated_before`):
    .venv/bin/python bench/parallel/deepspeed_cpu.py --estimate-only --out bench/parallel/results-deepspeed-cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

TINY_LLAMA = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 256,
              "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 4, "max_position_embeddings": 512, "rms_norm_eps": 1e-05,
              "tie_word_embeddings": False}


def _job(stage: int, ulysses: int = 1, seq_len: int = 128, num_gpus: int = 2, **extras) -> dict:
    # The Trainer's optimizer: torch AdamW (optim adamw_torch) with foreach=None, which
    # torch/optim/optimizer.py _default_to_fused_or_foreach turns into the for-loop on CPU.
    model = {**TINY_LLAMA, "max_position_embeddings": max(512, seq_len)}
    par = {"zero_stage": stage, **({"ulysses": ulysses} if ulysses > 1 else {}),
           "extras": {"dist_backend": "gloo", **extras}}
    return {"model": model, "precision": "fp32", "optimizer": "adamw", "optimizer_impl": "forloop",
            "micro_batch_size": 2, "seq_len": seq_len, "backend": "cpu", "attention": "sdpa", "num_gpus": num_gpus,
            "parallel": par}


# reduce_bucket_size 1e6 elements (4 MB fp32, a quarter of the model) makes several reductions
# per backward, as on a real model, instead of one 2 GB default bucket that dwarfs the rest.
CASES = [
    {"name": "tiny-llama/b2s128/fp32/zero1/default-buckets", "job": _job(1)},
    {"name": "tiny-llama/b2s128/fp32/zero2/default-buckets", "job": _job(2)},
    {"name": "tiny-llama/b2s128/fp32/zero3/default-buckets", "job": _job(3)},
    {"name": "tiny-llama/b2s128/fp32/zero2/bucket1e6", "job": _job(2, reduce_bucket_size=1_000_000,
                                                                 allgather_bucket_size=1_000_000)},
    # DeepSpeed Ulysses (ALST) through TrainingArguments(parallelism_config=ParallelismConfig(
    # sp_backend="deepspeed", sp_size=2)): both ranks split each sample's sequence.
    {"name": "tiny-llama/b2s128/fp32/zero2/bucket1e6/ulysses2",
     "job": _job(2, ulysses=2, reduce_bucket_size=1_000_000, allgather_bucket_size=1_000_000)},
    {"name": "tiny-llama/b2s1024/fp32/zero2/bucket1e6",
     "job": _job(2, seq_len=1024, reduce_bucket_size=1_000_000, allgather_bucket_size=1_000_000)},
    {"name": "tiny-llama/b2s1024/fp32/zero2/bucket1e6/ulysses2",
     "job": _job(2, ulysses=2, seq_len=1024, reduce_bucket_size=1_000_000, allgather_bucket_size=1_000_000)},
]

# `--set hpz` (results-deepspeed-hpz-cpu.json): ZeRO-3 on 2 and 4 ranks, with ZeRO++ hpZ
# (zero_hpz_partition_size: a secondary partition of each parameter over hpz ranks;
# parallel/zero3.py says when it lives) and without: four ranks in secondary groups of two (the
# paper's layout, the world split into nodes) and two ranks in one group. Small buckets, so
# that nothing is lost beside a 2 GB one.
_SMALL = {"reduce_bucket_size": 1_000_000, "allgather_bucket_size": 1_000_000}
HPZ_CASES = [
    {"name": "tiny-llama/b2s128/fp32/zero3/bucket1e6/hpz2-of-4",
     "job": _job(3, num_gpus=4, zero_hpz_partition_size=2, **_SMALL)},
    {"name": "tiny-llama/b2s128/fp32/zero3/bucket1e6/hpz2-of-2", "job": _job(3, zero_hpz_partition_size=2, **_SMALL)},
    {"name": "tiny-llama/b2s128/fp32/zero3/bucket1e6/no-hpz-of-4", "job": _job(3, num_gpus=4, **_SMALL)},
    {"name": "tiny-llama/b2s128/fp32/zero3/bucket1e6/no-hpz-of-2", "job": _job(3, **_SMALL)},
]
# `--set lora` (results-deepspeed-lora-cpu.json): PEFT LoRA under ZeRO-2 and ZeRO-3 on 2 ranks
# (get_peft_model before the Trainer, as transformers' and TRL's scripts do): the frozen base
# is partitioned and gathered like any parameter, but only the adapters make gradients.
def _lora(job: dict, targets) -> dict:
    return {**job, "method": "lora", "lora": {"r": 8, "alpha": 16, "target_modules": targets}}


_V32K = {**TINY_LLAMA, "vocab_size": 32000}
LORA_CASES = [  # 3 steps: ZeRO-3's steady step is the third (`--set reuse` below)
    {"name": "tiny-llama/b2s128/fp32/zero3/lora-q+v/default-buckets", "steps": 3,
     "job": _lora(_job(3), ["q_proj", "v_proj"])},
    {"name": "tiny-llama/b2s128/fp32/zero3/lora-all-linear/bucket1e6", "steps": 3,
     "job": _lora(_job(3, **_SMALL), "all-linear")},
    # a 32k vocabulary: the frozen embedding (8.2 M) is by far the largest parameter
    {"name": "tiny-llama-v32k/b2s128/fp32/zero3/lora-q+v/bucket1e6", "steps": 3,
     "job": _lora(_job(3, **_SMALL), ["q_proj", "v_proj"]) | {"model": _V32K}},
    # with checkpointing: enable_input_require_grads makes the frozen embedding's output need a gradient
    {"name": "tiny-llama-v32k/b2s128/fp32/zero3/lora-q+v/bucket1e6/gc", "steps": 3,
     "job": _lora(_job(3, **_SMALL), ["q_proj", "v_proj"]) | {"model": _V32K, "gradient_checkpointing": "full"}},
    {"name": "tiny-llama/b2s128/fp32/zero2/lora-q+v/default-buckets", "job": _lora(_job(2), ["q_proj", "v_proj"])},
]
# `--set reuse` (results-deepspeed-reuse-cpu.json): what ZeRO-3 keeps gathered across the turn
# from forward to backward. With a complete trace DeepSpeed releases a module's parameters
# only when no module within `stage3_max_reuse_distance` elements of the trace uses them again
# (partitioned_param_coordinator.py __params_to_release); eight layers and small prefetch
# buckets make the distance decide, from keeping everything (the default 1e9) to keeping nothing.
_EIGHT = {**TINY_LLAMA, "num_hidden_layers": 8}
_REUSE = {"reduce_bucket_size": 1_000_000, "allgather_bucket_size": 1_000_000, "stage3_prefetch_bucket_size": 100_000}
REUSE_CASES = [
    {"name": "tiny-llama-8l/b2s128/fp32/zero3/prefetch1e5/reuse-default", "steps": 3,
     "job": _job(3, **_REUSE) | {"model": _EIGHT}},
    {"name": "tiny-llama-8l/b2s128/fp32/zero3/prefetch1e5/reuse2e6", "steps": 3,
     "job": _job(3, stage3_max_reuse_distance=2_000_000, **_REUSE) | {"model": _EIGHT}},
    {"name": "tiny-llama-8l/b2s128/fp32/zero3/prefetch1e5/reuse0", "steps": 3,
     "job": _job(3, stage3_max_reuse_distance=0, **_REUSE) | {"model": _EIGHT}},
    {"name": "tiny-llama-8l/b2s128/fp32/zero3/prefetch1e5/reuse2e6/lora-q+v", "steps": 3,
     "job": _lora(_job(3, stage3_max_reuse_distance=2_000_000, **_REUSE) | {"model": _EIGHT}, ["q_proj", "v_proj"])},
]
SETS = {"zero": CASES, "hpz": HPZ_CASES, "lora": LORA_CASES, "reuse": REUSE_CASES}


def estimate_case(job: dict) -> dict:
    from vramplan.estimation import estimate
    from vramplan.spec import load_spec
    est = estimate(load_spec(job))
    peak = max(est.events, key=lambda e: e.total)
    return {"peak_allocated_bytes": est.peak_allocated_bytes, "peak_phase": est.peak_phase,
            "peak_event": est.peak_event, "phases": est.phases,
            "peak_terms": {k: v for k, v in sorted(peak.live.to_dict().items(), key=lambda kv: -kv[1]) if v}}


def worst_phases(ranks: list[dict]) -> dict:
    """Each phase's peak on its worst rank (ranks own different partitions and peak apart)."""
    from vramplan.measure import phase_kinds
    per_rank = [phase_kinds(r["phase_peaks"]) for r in ranks]
    return {k: max(p[k] for p in per_rank) for k in per_rank[0]}


def _errors(est: dict, ranks: list[dict]) -> dict:
    measured = worst_phases(ranks)
    worst = max(ranks, key=lambda r: r["peak"])
    return {"peak": est["peak_allocated_bytes"] / worst["peak"] - 1,
            "phases": {k: (est["phases"].get(k, 0) / v - 1) if v else None for k, v in measured.items()}}


def _versions() -> dict:
    import deepspeed
    import torch
    import transformers
    import accelerate
    return {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "accelerate": accelerate.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", type=int, nargs="*", help="indices into CASES")
    ap.add_argument("--estimate-only", action="store_true")
    ap.add_argument("--set", choices=sorted(SETS), default="zero", help="zero: ZeRO 1-3 and Ulysses (2 ranks); "
                    "hpz: ZeRO++ hpZ on 2 and 4 ranks; lora: PEFT LoRA under ZeRO-2/3; reuse: ZeRO-3's max_reuse_distance")
    args = ap.parse_args(argv)
    old = {}
    if os.path.exists(args.out):
        with open(args.out) as fh:
            old = {r["name"]: r for r in json.load(fh)["results"]}
    results = dict(old)
    cases = SETS[args.set]
    for i, case in enumerate(cases):
        if args.only is not None and i not in args.only:
            continue
        if args.estimate_only:
            row = old.get(case["name"])
            if row is None:
                continue
            row["estimated_before"] = row["estimated"]
        else:
            from vramplan.measure.deepspeed_run import run_ranks
            ranks = run_ranks(case["job"], case["job"]["num_gpus"], steps=case.get("steps", 2))
            row = {"name": case["name"], "job": case["job"],
                   "measured": [{k: r[k] for k in ("peak", "peak_phase", "phase_peaks", "optimizer")}
                                for r in ranks]}
        row["job"] = case["job"]
        row["estimated"] = estimate_case(case["job"])
        row["error"] = _errors(row["estimated"], row["measured"])
        if "estimated_before" in row:
            row["error_before"] = _errors(row["estimated_before"], row["measured"])
        results[case["name"]] = row
        print(f"{case['name']}: measured {[r['peak'] for r in row['measured']]} estimated "
              f"{row['estimated']['peak_allocated_bytes']} ({row['error']['peak']:+.2%})", file=sys.stderr)
    order = {c["name"]: i for i, c in enumerate(cases)}
    rows = sorted(results.values(), key=lambda r: order.get(r["name"], len(order)))
    with open(args.out, "w") as fh:
        json.dump({"schema_version": 1, "versions": _versions(), "dist_backend": "gloo",
                   "world_size": sorted({r["job"]["num_gpus"] for r in rows}),
                   "results": rows}, fh, indent=1)
        fh.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

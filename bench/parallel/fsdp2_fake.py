"""FSDP2 per-rank peaks at larger world sizes, in one process, with PyTorch's fake process group.

`dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=N)`
(torch/testing/_internal/distributed/fake_pg.py, FakeStore and the "fake" backend of
torch/distributed/_fake_pg: every collective returns at once without touching its output)
lets one process play rank 0 of an N-rank job. FSDP2 does not care what the collectives
write, only how big their inputs and outputs are: fully_shard still chunks every parameter
on dim 0 over the N-way mesh (_fsdp_param.py FSDPParam._init_sharded_param), still
allocates the all-gather output and the unsharded parameters (_fsdp_collectives.py
foreach_all_gather, _fsdp_param.py alloc_storage) and the reduce-scatter input and output
(foreach_reduce), and frees them on the same schedule. So rank 0's live bytes under the
exact meter are its real per-rank bytes; only the values are meaningless. PyTorch's own
FSDP2 memory tests run on the same backend (test/distributed/_composable/fsdp/
test_fully_shard_memory.py measures on GPUs; fake_pg serves the tracker tests).

The same model, wrap, optimizer and meter as fsdp2_cpu.py (which runs real gloo ranks).

    .venv/bin/python bench/parallel/fsdp2_fake.py --world 4 8 --out bench/parallel/results-fake.json
    .venv/bin/python bench/parallel/fsdp2_fake.py --float8 --world 4 8 --out bench/parallel/results-fake-float8.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from fsdp2_cpu import TINY_LLAMA, ShardedMeter, estimate_case, wrap  # noqa: E402

CASES = [
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/fsdp2-full-shard",
     "job": {"model": TINY_LLAMA, "precision": "fp32", "optimizer": "adamw", "micro_batch_size": 2,
             "seq_len": 128, "backend": "cpu", "attention": "sdpa",
             "parallel": {"fsdp": "full-shard", "fsdp_version": 2}}},
    {"name": "tiny-llama-v32k/b1s256/fp32/adamw-foreach/fsdp2-full-shard",
     "job": {"model": {**TINY_LLAMA, "vocab_size": 32000}, "precision": "fp32", "optimizer": "adamw",
             "optimizer_impl": "foreach", "micro_batch_size": 1, "seq_len": 256, "backend": "cpu",
             "attention": "sdpa", "parallel": {"fsdp": "full-shard", "fsdp_version": 2}}},
    # Odd sizes: FSDP2 pads dim 0 of every parameter to a multiple of the world size
    # (intermediate 700 and vocab 2050 are not multiples of 8).
    {"name": "tiny-llama-odd/b2s96/fp32/adamw-foreach/fsdp2-full-shard",
     "job": {"model": {**TINY_LLAMA, "vocab_size": 2050, "intermediate_size": 700}, "precision": "fp32",
             "optimizer": "adamw", "optimizer_impl": "foreach", "micro_batch_size": 2, "seq_len": 96,
             "backend": "cpu", "attention": "sdpa", "parallel": {"fsdp": "full-shard", "fsdp_version": 2}}},
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/fsdp2-shard-grad-op",
     "job": {"model": TINY_LLAMA, "precision": "fp32", "optimizer": "adamw", "micro_batch_size": 2,
             "seq_len": 128, "backend": "cpu", "attention": "sdpa",
             "parallel": {"fsdp": "shard-grad-op", "fsdp_version": 2}}},
    # FSDP1 (FlatParameter per layer, use_orig_params): the fake backend serves it too.
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/fsdp1-full-shard",
     "job": {"model": TINY_LLAMA, "precision": "fp32", "optimizer": "adamw", "micro_batch_size": 2,
             "seq_len": 128, "backend": "cpu", "attention": "sdpa",
             "parallel": {"fsdp": "full-shard", "fsdp_version": 1}}},
    {"name": "tiny-llama-v32k/b1s256/fp32/adamw-foreach/fsdp1-full-shard",
     "job": {"model": {**TINY_LLAMA, "vocab_size": 32000}, "precision": "fp32", "optimizer": "adamw",
             "optimizer_impl": "foreach", "micro_batch_size": 1, "seq_len": 256, "backend": "cpu",
             "attention": "sdpa", "parallel": {"fsdp": "full-shard", "fsdp_version": 1}}},
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/fsdp1-shard-grad-op",
     "job": {"model": TINY_LLAMA, "precision": "fp32", "optimizer": "adamw", "micro_batch_size": 2,
             "seq_len": 128, "backend": "cpu", "attention": "sdpa",
             "parallel": {"fsdp": "shard-grad-op", "fsdp_version": 1}}},
]

# torchao float8 training (tensorwise) converted before fully_shard, as torchtitan does, with
# and without FSDP2's float8 all-gather (Float8LinearConfig.enable_fsdp_float8_all_gather);
# `precompute_scale`: torchtitan's precompute_float8_dynamic_scale_for_fsdp after each step.
_F8 = {"model": TINY_LLAMA, "precision": "fp32", "optimizer": "adamw", "micro_batch_size": 2, "seq_len": 128,
       "backend": "cpu", "attention": "sdpa", "parallel": {"fsdp": "full-shard", "fsdp_version": 2}}
FLOAT8_CASES = [
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/fsdp2-full-shard/float8",
     "job": {**_F8, "float8": {"recipe": "tensorwise"}}},
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/fsdp2-full-shard/float8-all-gather",
     "job": {**_F8, "float8": {"recipe": "tensorwise", "fsdp_float8_all_gather": True}}},
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/fsdp2-full-shard/float8-all-gather-precomputed-scale",
     "job": {**_F8, "float8": {"recipe": "tensorwise", "fsdp_float8_all_gather": True}}, "precompute_scale": True},
    {"name": "tiny-llama-v32k/b1s256/fp32/adamw-foreach/fsdp2-full-shard/float8-all-gather-lm-head",
     "job": {**_F8, "model": {**TINY_LLAMA, "vocab_size": 32000}, "micro_batch_size": 1, "seq_len": 256,
             "optimizer_impl": "foreach",
             "float8": {"recipe": "tensorwise", "fsdp_float8_all_gather": True, "convert_lm_head": True}}},
    {"name": "tiny-llama-v32k/b1s256/fp32/adamw-foreach/fsdp2-full-shard/float8-lm-head",
     "job": {**_F8, "model": {**TINY_LLAMA, "vocab_size": 32000}, "micro_batch_size": 1, "seq_len": 256,
             "optimizer_impl": "foreach", "float8": {"recipe": "tensorwise", "convert_lm_head": True}}},
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/fsdp2-shard-grad-op/float8-all-gather",
     "job": {**_F8, "parallel": {"fsdp": "shard-grad-op", "fsdp_version": 2},
             "float8": {"recipe": "tensorwise", "fsdp_float8_all_gather": True}}},
]


def measure_fake(job: dict, world: int, steps: int = 2, precompute_scale: bool = False) -> dict:
    """Rank 0's exact peak of an N-rank FSDP2 job, in this process (initializes and destroys
    the default process group). A `float8` job converts its linears before fully_shard, as
    torchtitan does (convert_float8); `precompute_scale` runs torchao's
    precompute_float8_dynamic_scale_for_fsdp after each optimizer step (torchtitan's
    `precompute_float8_dynamic_scale_for_fsdp`), so the next all-gather casts with that scale."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vramplan.measure.build import build_model, build_optimizer, convert_float8
    from vramplan.measure.run import make_inputs

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        torch.manual_seed(0)
        model = build_model(job, "cpu", torch.float32)
        model.train()
        if job.get("float8"):
            convert_float8(model, job["float8"])
        model = wrap(model, job, world)
        optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], job)
        batch = make_inputs(job, model.config.vocab_size, "cpu")
        gc.collect()
        meter = ShardedMeter()
        meter.register([o for o in gc.get_objects() if isinstance(o, torch.Tensor)], "preexisting")
        with meter:
            for step in range(1, steps + 1):
                with meter.phase(f"s{step}.fwd"):
                    loss = model(**batch).loss
                with meter.phase(f"s{step}.bwd"):
                    loss.backward()
                with meter.phase(f"s{step}.opt"):
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    if precompute_scale:
                        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
                        precompute_float8_dynamic_scale_for_fsdp(model)
                del loss
        meter.close()
        return {"rank": 0, "peak_allocated_bytes": meter.peak, "peak_phase": meter.peak_label,
                "phase_peaks": dict(meter.phase_peaks)}
    finally:
        dist.destroy_process_group()


def run_isolated(job: dict, world: int, steps: int = 2, precompute_scale: bool = False) -> dict:
    """measure_fake in a fresh interpreter (a process group and the meter's patches stay
    out of the caller)."""
    code = ("import json,sys; sys.path.insert(0, %r); from fsdp2_fake import measure_fake; "
            "print(json.dumps(measure_fake(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), "
            "sys.argv[4] == '1')))" % HERE)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(job), str(world), str(steps),
                          "1" if precompute_scale else "0"],
                         check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--float8", action="store_true", help="the torchao float8 cases (results-fake-float8.json)")
    args = ap.parse_args(argv)
    import torch
    results = []
    for world in args.world:
        for case in FLOAT8_CASES if args.float8 else CASES:
            measured = run_isolated(case["job"], world, args.steps, case.get("precompute_scale", False))
            est = estimate_case(case["job"], world)
            peak = measured["peak_allocated_bytes"]
            row = {"name": case["name"], "world_size": world, "process_group": "fake", "job": case["job"],
                   **({"precompute_scale": True} if case.get("precompute_scale") else {}),
                   "measured": [measured], "estimated": est,
                   "rel_error": (est["peak_allocated_bytes"] - peak) / peak}
            print(f"world {world} {case['name']}: measured {peak} estimated {est['peak_allocated_bytes']} "
                  f"({row['rel_error']:+.2%})", file=sys.stderr)
            results.append(row)
    if args.out:
        with open(args.out, "w") as fh:
            versions = {"torch": torch.__version__}
            if args.float8:
                import torchao
                versions["torchao"] = torchao.__version__
            json.dump({"schema_version": 1, **versions, "results": results}, fh, indent=1)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Measured ground truth for 2-D FSDP2 + tensor parallelism (torchtitan's recipe) and HSDP.

Each rank builds the job's HF model (random weights), makes a 2-D device mesh
(`init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))`), applies the Llama TP
plan of tp_cpu.py over the "tp" sub-mesh (torchtitan/models/llama3/infra/parallelize.py
apply_tp), then `fully_shard` every decoder layer and the root over the "dp_shard" sub-mesh
(apply_fsdp): FSDP2 shards each TP-local DTensor parameter once more on dim 0 over the
data-parallel ranks (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, the 2-D
`_init_sharded_param` path with `_tp_spec`). The loss is HF's, under `loss_parallel()`.
HSDP (`parallel.fsdp: hybrid-shard`) is FSDP2 over a ("dp_replicate", "dp_shard") mesh:
parameters are sharded within each replica group and gradients all-reduced across them
(_fsdp_collectives.py foreach_reduce, `all_reduce_group`).

One process plays rank 0 of the N-rank job on the fake process group
(torch/testing/_internal/distributed/fake_pg.py; fsdp2_fake.py); `--gloo` runs every rank.

    .venv/bin/python bench/parallel/fsdp_tp_cpu.py --out bench/parallel/results-fsdp-tp.json
    .venv/bin/python bench/parallel/fsdp_tp_cpu.py --reestimate --out bench/parallel/results-fsdp-tp.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from fsdp2_cpu import TINY_LLAMA  # noqa: E402
from tp_cpu import compare, measure_gloo, merge_out, metered_steps, print_trace, reestimate, tp_plan  # noqa: E402


def _job(model, par: dict, b=2, s=128) -> dict:
    return {"model": model, "precision": "fp32", "optimizer": "adamw", "optimizer_impl": "forloop",
            "micro_batch_size": b, "seq_len": s, "backend": "cpu", "attention": "sdpa", "parallel": par}


CASES = [
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/fsdp2-full-shard-dp2-tp2", "world": 4,
     "job": _job(TINY_LLAMA, {"fsdp": "full-shard", "fsdp_version": 2, "tp": 2})},
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/fsdp2-full-shard-dp2-tp2-sp", "world": 4,
     "job": _job(TINY_LLAMA, {"fsdp": "full-shard", "fsdp_version": 2, "tp": 2, "sp": True})},
    {"name": "tiny-llama-v32k/b1s256/fp32/adamw-forloop/fsdp2-full-shard-dp2-tp2-sp", "world": 4,
     "job": _job({**TINY_LLAMA, "vocab_size": 32000}, {"fsdp": "full-shard", "fsdp_version": 2, "tp": 2, "sp": True},
                 b=1, s=256)},
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/fsdp2-full-shard-dp4-tp2-sp", "world": 8,
     "job": _job(TINY_LLAMA, {"fsdp": "full-shard", "fsdp_version": 2, "tp": 2, "sp": True})},
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/hsdp-2x2", "world": 4,
     "job": _job(TINY_LLAMA, {"fsdp": "hybrid-shard", "fsdp_version": 2, "extras": {"shard_group_size": 2}})},
    {"name": "tiny-llama-v32k/b1s256/fp32/adamw-forloop/hsdp-2x4", "world": 8,
     "job": _job({**TINY_LLAMA, "vocab_size": 32000},
                 {"fsdp": "hybrid-shard", "fsdp_version": 2, "extras": {"shard_group_size": 4}}, b=1, s=256)},
]


def build_mesh(job: dict, world: int):
    """The job's device mesh: (dp_shard, tp) for FSDP + TP, (dp_replicate, dp_shard) for HSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    par = job["parallel"]
    tp = int(par.get("tp", 1))
    if par.get("fsdp") == "hybrid-shard":
        shard = int(par.get("extras", {}).get("shard_group_size", world))
        return init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp_shard", "tp"))


def shard_model(model, job: dict, world: int):
    """TP over mesh["tp"] (tp_cpu.tp_plan), then fully_shard over the data-parallel mesh."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    par = job["parallel"]
    mesh = build_mesh(job, world)
    if int(par.get("tp", 1)) > 1:
        root, layer = tp_plan(model, bool(par.get("sp")))
        for block in model.model.layers:
            parallelize_module(block, mesh["tp"], layer)
        parallelize_module(model, mesh["tp"], root)
        dp = mesh["dp_shard"]
    elif par.get("fsdp") == "hybrid-shard":
        dp = mesh  # 2-D: replicate over dim 0, shard over dim 1
    else:
        dp = mesh["dp_shard"]
    for block in model.model.layers:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def run_rank(rank: int, world: int, job: dict, steps: int) -> dict:
    import contextlib

    import torch
    from torch.distributed.tensor.parallel import loss_parallel

    from vramplan.measure.build import build_model, build_optimizer
    from vramplan.measure.run import make_inputs
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(job, "cpu", torch.float32)
    model.train()
    model = shard_model(model, job, world)
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], job)
    batch = make_inputs(job, model.config.vocab_size, "cpu")
    ctx = loss_parallel if int(job["parallel"].get("tp", 1)) > 1 else contextlib.nullcontext
    meter = metered_steps(model, optimizer, batch, steps, ctx, trace=bool(os.environ.get("TP_TRACE")))
    if meter.trace and rank == 0:
        for label in os.environ.get("TP_TRACE_LABEL", "peak").split(","):
            print_trace(meter, label)
    return {"rank": rank, "peak_allocated_bytes": meter.peak, "peak_phase": meter.peak_label,
            "phase_peaks": dict(meter.phase_peaks)}


def measure_fake(job: dict, world: int, steps: int = 2) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        return run_rank(0, world, job, steps)
    finally:
        dist.destroy_process_group()


def run_isolated(job: dict, world: int, steps: int = 2) -> dict:
    code = ("import json,sys; sys.path.insert(0, %r); from fsdp_tp_cpu import measure_fake; "
            "print(json.dumps(measure_fake(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))" % HERE)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(job), str(world), str(steps)],
                         check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--gloo", action="store_true", help="every rank a process on gloo (else rank 0 on the fake group)")
    ap.add_argument("--out")
    ap.add_argument("--only", type=int, nargs="*", help="indices into CASES")
    ap.add_argument("--reestimate", action="store_true", help="only re-estimate the rows of --out")
    args = ap.parse_args(argv)
    if args.reestimate:
        reestimate(args.out)
        return 0
    results = []
    for i, case in enumerate(CASES):
        if args.only is not None and i not in args.only:
            continue
        job, world = case["job"], case["world"]
        if args.gloo:
            job = {**job, "parallel": {**job["parallel"], "extras": {**job["parallel"].get("extras", {}),
                                                                      "dist_backend": "gloo"}}}
            results.append(compare(case["name"], job, world, measure_gloo("fsdp_tp_cpu", job, world, args.steps)))
        else:
            results.append(compare(case["name"], job, world, [run_isolated(job, world, args.steps)],
                                   {"process_group": "fake"}))
        if args.out:
            merge_out(args.out, results, [c["name"] for c in CASES])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

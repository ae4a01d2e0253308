"""Measured ground truth for FSDP2 and FSDP1 per-rank peaks: gloo on CPU, N processes, exact meter.

Each rank builds the job's model the way vramplan.measure does (random weights, HF
transformers) and wraps it the way the job's `parallel.fsdp_version` says:
  * FSDP2: torch.distributed.fsdp.fully_shard on every decoder layer and then the root
    (the torchtitan / accelerate FSDP2 recipe);
  * FSDP1: torch.distributed.fsdp.FullyShardedDataParallel with
    transformer_auto_wrap_policy on the decoder layer class (one FlatParameter per layer,
    the root's FlatParameter holding embedding, final norm and head), use_orig_params=True,
    the accelerate / HF Trainer FSDP1 recipe; backward_prefetch=BACKWARD_PRE (the default).
It builds the optimizer over the sharded parameters and runs `steps` training steps under
vramplan.measure.meter.MemoryMeter, extended for two things FSDP does that a dispatch
mode alone cannot see:
  * FSDP allocates and frees unsharded parameters by resizing their storage in place
    (FSDP2 torch/distributed/fsdp/_fully_shard/_fsdp_param.py alloc_storage / free_storage;
    FSDP1 torch/distributed/utils.py _alloc_storage / _free_storage on the padded
    unsharded FlatParameter); UntypedStorage.resize_ is patched to update the meter.
  * DTensor outputs are wrapper subclasses without storage; their local tensor is counted.

    .venv/bin/python bench/parallel/fsdp2_cpu.py --world 2 --out bench/parallel/results-cpu.json

`--out` merges: rows of the cases run replace the rows of the same name and world size.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vramplan.measure.build import build_model, build_optimizer
from vramplan.measure.meter import MemoryMeter
from vramplan.measure.run import make_inputs

TINY_LLAMA = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 256,
              "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 4, "max_position_embeddings": 512, "rms_norm_eps": 1e-05,
              "tie_word_embeddings": False}

# The collectives run on gloo: the estimate counts gloo's reduce-scatter buffer
# (vramplan.parallel.plan._gloo).
GLOO = {"extras": {"dist_backend": "gloo"}}

CASES = [
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/fsdp2-full-shard",
     "job": {"model": TINY_LLAMA, "precision": "fp32", "optimizer": "adamw", "micro_batch_size": 2,
             "seq_len": 128, "backend": "cpu", "attention": "sdpa",
             "parallel": {"fsdp": "full-shard", "fsdp_version": 2, **GLOO}}},
    {"name": "tiny-llama-v32k/b1s256/fp32/adamw-foreach/fsdp2-full-shard",
     "job": {"model": {**TINY_LLAMA, "vocab_size": 32000}, "precision": "fp32", "optimizer": "adamw",
             "optimizer_impl": "foreach", "micro_batch_size": 1, "seq_len": 256, "backend": "cpu",
             "attention": "sdpa", "parallel": {"fsdp": "full-shard", "fsdp_version": 2, **GLOO}}},
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/fsdp1-full-shard",
     "job": {"model": TINY_LLAMA, "precision": "fp32", "optimizer": "adamw", "micro_batch_size": 2,
             "seq_len": 128, "backend": "cpu", "attention": "sdpa",
             "parallel": {"fsdp": "full-shard", "fsdp_version": 1, **GLOO}}},
    {"name": "tiny-llama-v32k/b1s256/fp32/adamw-foreach/fsdp1-full-shard",
     "job": {"model": {**TINY_LLAMA, "vocab_size": 32000}, "precision": "fp32", "optimizer": "adamw",
             "optimizer_impl": "foreach", "micro_batch_size": 1, "seq_len": 256, "backend": "cpu",
             "attention": "sdpa", "parallel": {"fsdp": "full-shard", "fsdp_version": 1, **GLOO}}},
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/fsdp1-shard-grad-op",
     "job": {"model": TINY_LLAMA, "precision": "fp32", "optimizer": "adamw", "micro_batch_size": 2,
             "seq_len": 128, "backend": "cpu", "attention": "sdpa",
             "parallel": {"fsdp": "shard-grad-op", "fsdp_version": 1, **GLOO}}},
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/fsdp2-shard-grad-op",
     "job": {"model": TINY_LLAMA, "precision": "fp32", "optimizer": "adamw", "micro_batch_size": 2,
             "seq_len": 128, "backend": "cpu", "attention": "sdpa",
             "parallel": {"fsdp": "shard-grad-op", "fsdp_version": 2, **GLOO}}},
]


def wrap(model, job: dict, world: int):
    """Shard `model` the way the job's parallel section says (see the module docstring)."""
    par = job.get("parallel", {})
    if par.get("fsdp_version", 2) == 1:
        import functools
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
        layer_cls = {type(model.model.layers[0])}
        strategy = {"full-shard": ShardingStrategy.FULL_SHARD,
                    "shard-grad-op": ShardingStrategy.SHARD_GRAD_OP}[par.get("fsdp", "full-shard")]
        return FullyShardedDataParallel(
            model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_cls),
            sharding_strategy=strategy, use_orig_params=True, device_id=torch.device("cpu"))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    reshard = par.get("fsdp", "full-shard") != "shard-grad-op"
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def _local(t):
    from torch.distributed.tensor import DTensor
    return t._local_tensor if isinstance(t, DTensor) else t


class ShardedMeter(MemoryMeter):
    """MemoryMeter that also sees DTensor locals and in-place storage resizes."""

    def _track(self, t, op):
        super()._track(_local(t), op)

    def __enter__(self):
        meter, original = self, torch.UntypedStorage.resize_

        def resize_(storage, size):
            out = original(storage, size)
            info = meter.live.get(id(storage))
            if info is not None:
                meter.current += storage.nbytes() - info.nbytes
                info.nbytes = storage.nbytes()
            meter._after_op()
            return out

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def _snapshot(self, label):
        # copy each record: resize_ changes a live record's nbytes after the snapshot
        import dataclasses
        snap = super()._snapshot(label)
        snap.storages = [dataclasses.replace(i) for i in snap.storages]
        return snap

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)


def _rank(rank: int, world: int, port: int, job: dict, steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(job, "cpu", torch.float32)
    model.train()
    model = wrap(model, job, world)
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], job)
    batch = make_inputs(job, model.config.vocab_size, "cpu")
    gc.collect()
    meter = ShardedMeter(trace=bool(os.environ.get("FSDP_TRACE")))
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
            del loss
    meter.close()
    if meter.trace and rank == 0:
        snap = meter.snapshots["peak"]
        rows = sorted(snap.storages, key=lambda i: -i.nbytes)
        print("PEAK", snap.label, snap.total_bytes, file=sys.stderr)
        groups = {}
        for info in rows:
            key = (info.op, info.phase, info.node, info.shape)
            groups[key] = groups.get(key, 0) + info.nbytes
        for key, total in sorted(groups.items(), key=lambda kv: -kv[1])[:30]:
            print(f"  {total:>10} {key}", file=sys.stderr)
    queue.put((rank, meter.peak, meter.peak_label, dict(meter.phase_peaks)))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_fsdp2(job: dict, world: int, steps: int = 2) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, PORT[0], job, steps, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    rows = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return [{"rank": r, "peak_allocated_bytes": peak, "peak_phase": label, "phase_peaks": phases}
            for r, peak, label, phases in sorted(rows)]


PORT = [0]


def estimate_case(job: dict, world: int) -> dict:
    from vramplan.estimation import estimate
    from vramplan.spec import load_spec
    est = estimate(load_spec({**job, "num_gpus": world}))
    return {"peak_allocated_bytes": est.peak_allocated_bytes, "peak_phase": est.peak_phase,
            "peak_event": est.peak_event, "phases": est.phases, "components": est.components.to_dict(),
            **({"parallel": est.parallel.to_dict()} if est.parallel is not None else {})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--only", type=int, nargs="*", help="indices into CASES")
    args = ap.parse_args(argv)
    results = []
    for i, case in enumerate(CASES):
        if args.only is not None and i not in args.only:
            continue
        PORT[0] = _free_port()
        measured = measure_fsdp2(case["job"], args.world, args.steps)
        est = estimate_case(case["job"], args.world)
        worst = max(m["peak_allocated_bytes"] for m in measured)
        row = {"name": case["name"], "world_size": args.world, "job": case["job"],
               "measured": measured, "estimated": est,
               "rel_error": (est["peak_allocated_bytes"] - worst) / worst}
        print(f"{case['name']}: measured {[m['peak_allocated_bytes'] for m in measured]} "
              f"estimated {est['peak_allocated_bytes']} ({row['rel_error']:+.2%})", file=sys.stderr)
        results.append(row)
    if args.out:
        if os.path.exists(args.out):
            with open(args.out) as fh:
                old = json.load(fh)["results"]
            done = {(r["name"], r["world_size"]) for r in results}
            order = {c["name"]: i for i, c in enumerate(CASES)}
            results = sorted([r for r in old if (r["name"], r["world_size"]) not in done] + results,
                             key=lambda r: (r["world_size"], order.get(r["name"], len(order))))
        with open(args.out, "w") as fh:
            json.dump({"schema_version": 1, "torch": torch.__version__, "results": results}, fh, indent=1)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

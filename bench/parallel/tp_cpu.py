"""Measured ground truth for tensor (and sequence) parallel per-rank peaks: DTensor TP on CPU.

Each rank builds the job's HF model (random weights, vramplan.measure.build) and shards it with
torch.distributed.tensor.parallel.parallelize_module the way torchtitan does for Llama
(torchtitan/models/llama3/infra/parallelize.py, apply_tp; the Megatron layout of Shoeybi et al.
2019): q/k/v and gate/up ColwiseParallel, o and down RowwiseParallel, the embedding
RowwiseParallel (vocabulary split, torch/distributed/tensor/parallel/style.py
RowwiseParallel._partition_embedding_fn: Shard(0)), the output head ColwiseParallel with the
logits left vocabulary-sharded (`use_local_output=False`) and the loss taken under
`loss_parallel()` (torch/distributed/tensor/parallel/loss.py: the vocab-parallel cross-entropy,
so no rank builds the full logits). With `parallel.sp` the norms are SequenceParallel and the
residual stream is sequence-sharded (Shard(1)); the attention and MLP inputs are all-gathered by
PrepareModuleInput, and o/down reduce-scatter back to Shard(1) (torchtitan's plan). HF's
modules see the residual stream as a DTensor of the global shape (o/down keep
`use_local_output=False`), so LlamaModel computes rotary positions and the causal mask for the
whole sequence.

The optimizer is built over the DTensor parameters; `steps` training steps run under the exact
meter (fsdp2_cpu.ShardedMeter: DTensor outputs count their local tensor). Ranks run on gloo
(`--world 2`), or one process plays rank 0 of N on the fake process group
(`--fake --world 4`, torch/testing/_internal/distributed/fake_pg.py, as fsdp2_fake.py does).

    .venv/bin/python bench/parallel/tp_cpu.py --world 2 --out bench/parallel/results-tp-cpu.json
    .venv/bin/python bench/parallel/tp_cpu.py --fake --world 4 --out bench/parallel/results-tp-cpu.json
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from fsdp2_cpu import TINY_LLAMA, _free_port, estimate_case  # noqa: E402

TINY_QWEN2 = {"model_type": "qwen2", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 704,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-06, "tie_word_embeddings": False}
GLOO = {"extras": {"dist_backend": "gloo"}}


def _job(model, tp_par: dict, b=2, s=128, impl="forloop") -> dict:
    # Without sp the norms stay plain tensors beside DTensor parameters, which a foreach
    # optimizer cannot group (aten._foreach_* refuses mixed Tensor / DTensor lists).
    return {"model": model, "precision": "fp32", "optimizer": "adamw", "optimizer_impl": impl,
            "micro_batch_size": b, "seq_len": s, "backend": "cpu", "attention": "sdpa", "parallel": tp_par}


CASES = [
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/tp", "job": _job(TINY_LLAMA, {"tp": 2})},
    {"name": "tiny-llama/b2s128/fp32/adamw-forloop/tp-sp", "job": _job(TINY_LLAMA, {"tp": 2, "sp": True})},
    {"name": "tiny-llama-v32k/b1s256/fp32/adamw-foreach/tp-sp",
     "job": _job({**TINY_LLAMA, "vocab_size": 32000}, {"tp": 2, "sp": True}, b=1, s=256, impl="foreach")},
    {"name": "tiny-qwen2/b2s128/fp32/adamw-forloop/tp", "job": _job(TINY_QWEN2, {"tp": 2})},
    {"name": "tiny-qwen2/b2s128/fp32/adamw-forloop/tp-sp", "job": _job(TINY_QWEN2, {"tp": 2, "sp": True})},
]


def tp_plan(model, sp: bool) -> tuple[dict, dict]:
    """(root plan, per-layer plan) for parallelize_module; see the module docstring."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    seq = Shard(1) if sp else Replicate()
    root = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                                  use_local_output=not sp),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    layer = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
             "self_attn.v_proj": ColwiseParallel(),
             "self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=not sp),
             "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
             "mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=not sp)}
    if sp:
        root["model.norm"] = SequenceParallel()
        layer.update({
            "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
            # HF's decoder layer calls self_attn with keyword arguments, the MLP positionally.
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
    return root, layer


def parallelize(model, job: dict, mesh):
    from torch.distributed.tensor.parallel import parallelize_module
    root, layer = tp_plan(model, bool(job["parallel"].get("sp")))
    for block in model.model.layers:
        parallelize_module(block, mesh, layer)
    parallelize_module(model, mesh, root)
    return model


def dist_meter(trace: bool = False):
    """fsdp2_cpu.ShardedMeter (DTensor locals, in-place storage resizes) that also skips meta
    tensors: torch.distributed.pipelining infers the stages' shapes on the meta device
    (stage.py _forward_metadata_inference); they hold no memory."""
    from fsdp2_cpu import ShardedMeter

    class DistMeter(ShardedMeter):
        def _track(self, t, op):
            if t.device.type != "meta":
                super()._track(t, op)

    return DistMeter(trace=trace)


def metered_steps(model, optimizer, batch, steps: int, ctx, trace: bool = False):
    """`steps` training steps (forward under `ctx`, backward, optimizer step) under the meter."""
    import torch
    gc.collect()
    meter = dist_meter(trace)
    meter.register([o for o in gc.get_objects() if isinstance(o, torch.Tensor)], "preexisting")
    with meter:
        for step in range(1, steps + 1):
            with ctx():
                with meter.phase(f"s{step}.fwd"):
                    loss = model(**batch).loss
                with meter.phase(f"s{step}.bwd"):
                    loss.backward()
            with meter.phase(f"s{step}.opt"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            del loss
    meter.close()
    return meter


def print_trace(meter, label="peak", rank=0) -> None:
    snap = meter.snapshots[label]
    print(f"rank {rank} PEAK", snap.label, snap.total_bytes, file=sys.stderr)
    groups: dict = {}
    for info in snap.storages:
        key = (info.op, info.phase, info.node, info.shape)
        groups[key] = groups.get(key, 0) + info.nbytes
    for key, total in sorted(groups.items(), key=lambda kv: -kv[1])[:40]:
        print(f"  r{rank} {total:>10} {key}", file=sys.stderr)


def run_rank(rank: int, world: int, job: dict, steps: int) -> dict:
    """This rank's metered TP steps (the default process group is initialized)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from vramplan.measure.build import build_model, build_optimizer
    from vramplan.measure.run import make_inputs
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(job, "cpu", torch.float32)
    model.train()
    model = parallelize(model, job, init_device_mesh("cpu", (world,)))
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], job)
    batch = make_inputs(job, model.config.vocab_size, "cpu")
    meter = metered_steps(model, optimizer, batch, steps, loss_parallel, trace=bool(os.environ.get("TP_TRACE")))
    if meter.trace and rank == 0:
        print_trace(meter, os.environ.get("TP_TRACE_LABEL", "peak"))
    return {"rank": rank, "peak_allocated_bytes": meter.peak, "peak_phase": meter.peak_label,
            "phase_peaks": dict(meter.phase_peaks)}


def _gloo_rank(rank: int, world: int, port: int, module: str, job: dict, steps: int, queue) -> None:
    import importlib

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put(importlib.import_module(module).run_rank(rank, world, job, steps))
        dist.barrier()
    except Exception as exc:  # the parent re-raises it instead of waiting for this rank
        queue.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        dist.destroy_process_group()


def measure_gloo(module: str, job: dict, world: int, steps: int = 2) -> list[dict]:
    """Every rank's result of `module.run_rank`, N spawned processes on gloo."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, world, port, module, job, steps, queue)) for r in range(world)]
    for p in procs:
        p.start()
    rows = []
    for _ in procs:
        rows.append(queue.get(timeout=600))
        if "error" in rows[-1]:
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rows[-1]['rank']}: {rows[-1]['error']}")
    for p in procs:
        p.join()
    return sorted(rows, key=lambda r: r["rank"])


def measure_fake(job: dict, world: int, steps: int = 2) -> dict:
    """Rank 0 of an N-rank TP job in this process, on the fake process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        return run_rank(0, world, job, steps)
    finally:
        dist.destroy_process_group()


def run_isolated(job: dict, world: int, steps: int = 2) -> dict:
    code = ("import json,sys; sys.path.insert(0, %r); from tp_cpu import measure_fake; "
            "print(json.dumps(measure_fake(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))" % HERE)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(job), str(world), str(steps)],
                         check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def phase_errors(measured: list[dict], est: dict) -> dict:
    """Per phase (fwd / bwd / opt, both steps): the estimate's phase peak against the worst rank's."""
    phases = dict(est["phases"])
    if not any(k.endswith(".fwd") for m in measured for k in m["phase_peaks"]):
        # one phase for the pipeline schedule's interleaved forward and backward (pp_cpu.py)
        phases = {"fb": max(phases.get("forward", 0), phases.get("backward", 0)), "opt": phases.get("optimizer", 0)}
    out = {}
    for phase, value in phases.items():
        key = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}.get(phase, phase)
        seen = [v for m in measured for k, v in m["phase_peaks"].items() if k.endswith("." + key)]
        if seen:
            out[key] = (value - max(seen)) / max(seen)
    return out


def compare(name: str, job: dict, world: int, measured: list[dict], extra: dict | None = None) -> dict:
    est = estimate_case(job, world)
    worst = max(m["peak_allocated_bytes"] for m in measured)
    row = {"name": name, "world_size": world, **(extra or {}), "job": job, "measured": measured, "estimated": est,
           "rel_error": (est["peak_allocated_bytes"] - worst) / worst, "phase_errors": phase_errors(measured, est)}
    print(f"{name} world {world}: measured {[m['peak_allocated_bytes'] for m in measured]} "
          f"estimated {est['peak_allocated_bytes']} ({row['rel_error']:+.2%}) phases "
          + " ".join(f"{k} {v:+.2%}" for k, v in row["phase_errors"].items()), file=sys.stderr)
    return row


def merge_out(path: str, results: list[dict], order: list[str]) -> None:
    """Rows of the cases run replace the rows of the same name, world size and process group."""
    import torch
    key = lambda r: (r["name"], r["world_size"], r.get("process_group", "gloo"))  # noqa: E731
    if os.path.exists(path):
        with open(path) as fh:
            old = json.load(fh)["results"]
        done = {key(r) for r in results}
        results = [r for r in old if key(r) not in done] + results
    rank = {n: i for i, n in enumerate(order)}
    results.sort(key=lambda r: (r.get("process_group", "gloo"), r["world_size"], rank.get(r["name"], len(rank))))
    with open(path, "w") as fh:
        json.dump({"schema_version": 1, "torch": torch.__version__, "results": results}, fh, indent=1)
        fh.write("\n")


def reestimate(path: str) -> None:
    """Recompute every row's estimate and errors in `path` with the current estimator (the
    measurements stay)."""
    import torch
    with open(path) as fh:
        rows = json.load(fh)["results"]
    for row in rows:
        fresh = compare(row["name"], row["job"], row["world_size"], row["measured"])
        row.update({k: fresh[k] for k in ("estimated", "rel_error", "phase_errors")})
        if "stage_errors" in row:
            peaks = fresh["estimated"]["parallel"]["pp_stage_peaks"]
            row["stage_errors"] = [(peaks[m["rank"]] - m["peak_allocated_bytes"]) / m["peak_allocated_bytes"]
                                   for m in row["measured"]]
    with open(path, "w") as fh:
        json.dump({"schema_version": 1, "torch": torch.__version__, "results": rows}, fh, indent=1)
        fh.write("\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--fake", action="store_true", help="rank 0 of --world on the fake process group")
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
        job = case["job"]
        if args.fake:
            job = {**job, "parallel": {**job["parallel"], "tp": args.world}}
            results.append(compare(case["name"], job, args.world, [run_isolated(job, args.world, args.steps)],
                                   {"process_group": "fake"}))
        else:
            job = {**job, "parallel": {**job["parallel"], "tp": args.world, **GLOO}}
            results.append(compare(case["name"], job, args.world, measure_gloo("tp_cpu", job, args.world, args.steps)))
        if args.out:  # after every case: a long run that is stopped keeps what it measured
            merge_out(args.out, results, [c["name"] for c in CASES])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Measured ground truth for pipeline-parallel per-stage peaks: torch.distributed.pipelining on CPU.

Each rank builds the job's HF model (random weights, vramplan.measure.build) and keeps its
stage's part, split by layers as torchtitan does (torchtitan/distributed/pipeline_parallel.py
pipeline_module_split: a deep copy per stage with the other stages' modules deleted; layers as
even as possible, earlier stages taking the remainder, vramplan.parallel.shard.pp_layers):
  * the first stage holds the embedding and its layers and runs HF's own LlamaModel.forward
    (input_ids -> hidden states; the final norm replaced by Identity unless it is also last);
  * later stages run LlamaModel.forward from `inputs_embeds` (rotary positions and the causal
    mask are rebuilt there, as HF does), the last one with the final norm and the head
    (LlamaForCausalLM.forward -> logits); the loss is HF's own `model.loss_function`
    (transformers/loss/loss_utils.py ForCausalLMLoss), the schedule's `loss_fn`.
Each stage is a torch.distributed.pipelining.PipelineStage; the schedule (ScheduleGPipe or
Schedule1F1B, `parallel.pp_schedule`) splits the batch of micro_batch_size x
grad_accum_steps rows into grad_accum_steps micro-batches and exchanges activations and their
gradients with gloo send/recv. The optimizer steps the stage's parameters; `steps` steps run
under the exact meter (phases: `sN.fb` = schedule.step, forward and backward interleaved;
`sN.opt`).

    .venv/bin/python bench/parallel/pp_cpu.py --world 2 --out bench/parallel/results-pp-cpu.json
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from fsdp2_cpu import TINY_LLAMA  # noqa: E402
from tp_cpu import TINY_QWEN2, compare, measure_gloo, merge_out  # noqa: E402

GLOO = {"extras": {"dist_backend": "gloo"}}


def _job(model, schedule: str, m: int, b=2, s=128) -> dict:
    return {"model": model, "precision": "fp32", "optimizer": "adamw", "optimizer_impl": "forloop",
            "micro_batch_size": b, "seq_len": s, "grad_accum_steps": m, "backend": "cpu", "attention": "sdpa",
            "parallel": {"pp": 2, "pp_schedule": schedule}}


CASES = [
    {"name": "tiny-llama/b2s128x4/fp32/adamw-forloop/pp-gpipe", "job": _job(TINY_LLAMA, "gpipe", 4)},
    {"name": "tiny-llama/b2s128x4/fp32/adamw-forloop/pp-1f1b", "job": _job(TINY_LLAMA, "1f1b", 4)},
    {"name": "tiny-llama-v32k/b1s256x4/fp32/adamw-forloop/pp-1f1b",
     "job": _job({**TINY_LLAMA, "vocab_size": 32000}, "1f1b", 4, b=1, s=256)},
    {"name": "tiny-qwen2/b2s128x4/fp32/adamw-forloop/pp-1f1b", "job": _job(TINY_QWEN2, "1f1b", 4)},
]


def stage_module(model, stage: int, pp: int):
    """The part of `model` (an HF *ForCausalLM) that pipeline stage `stage` runs; the other
    stages' modules are dropped so their parameters are freed."""
    import torch
    from vramplan.parallel.shard import pp_layers
    layers = pp_layers(len(model.model.layers), pp)[stage]
    base = model.model
    base.layers = torch.nn.ModuleList(base.layers[i] for i in layers)
    first, last = stage == 0, stage == pp - 1
    if not first:
        base.embed_tokens = None
    if not last:
        base.norm = torch.nn.Identity()
        model.lm_head = None

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = model if last else base

        def forward(self, x):
            kw = {"input_ids": x} if first else {"inputs_embeds": x}
            out = self.lm(**kw)
            return out.logits if last else out.last_hidden_state

    return Stage()


def run_rank(rank: int, world: int, job: dict, steps: int) -> dict:
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from tp_cpu import dist_meter, print_trace
    from vramplan.measure.build import build_model, build_optimizer
    from vramplan.measure.run import make_inputs
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(job, "cpu", torch.float32)
    model.train()
    vocab, loss_function = model.config.vocab_size, model.loss_function
    module = stage_module(model, rank, world)
    del model
    m = int(job["grad_accum_steps"])
    stage = PipelineStage(module, rank, world, torch.device("cpu"))

    def loss_fn(logits, labels):
        return loss_function(logits, labels, vocab)

    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[job["parallel"]["pp_schedule"]]
    schedule = kind(stage, n_microbatches=m, loss_fn=loss_fn)
    optimizer = build_optimizer([p for p in module.parameters() if p.requires_grad], job)
    batch = make_inputs({**job, "micro_batch_size": job["micro_batch_size"] * m}, vocab, "cpu")
    ids, labels = (batch["input_ids"], None) if rank == 0 else (None, batch["labels"])
    del batch
    gc.collect()
    meter = dist_meter(bool(os.environ.get("PP_TRACE")))
    meter.register([o for o in gc.get_objects() if isinstance(o, torch.Tensor)], "preexisting")
    with meter:
        for step in range(1, steps + 1):
            with meter.phase(f"s{step}.fb"):
                if rank == 0:
                    schedule.step(ids)
                elif rank == world - 1:
                    losses = []
                    schedule.step(target=labels, losses=losses)
                    del losses
                else:
                    schedule.step()
            with meter.phase(f"s{step}.opt"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    meter.close()
    if meter.trace:
        print_trace(meter, rank=rank)
    return {"rank": rank, "peak_allocated_bytes": meter.peak, "peak_phase": meter.peak_label,
            "phase_peaks": dict(meter.phase_peaks)}


def stage_errors(measured: list[dict], est: dict) -> list[float]:
    """Each stage's estimated peak against that rank's measured peak."""
    peaks = est["parallel"]["pp_stage_peaks"]
    return [(peaks[m["rank"]] - m["peak_allocated_bytes"]) / m["peak_allocated_bytes"] for m in measured]


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
        job = {**case["job"], "parallel": {**case["job"]["parallel"], "pp": args.world, **GLOO}}
        row = compare(case["name"], job, args.world, measure_gloo("pp_cpu", job, args.world, args.steps))
        row["stage_errors"] = stage_errors(row["measured"], row["estimated"])
        print("  per stage: " + " ".join(f"{e:+.2%}" for e in row["stage_errors"]), file=sys.stderr)
        results.append(row)
        if args.out:
            merge_out(args.out, results, [c["name"] for c in CASES])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

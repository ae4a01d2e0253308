#!/usr/bin/env python3
"""Replay a step's tensor events on a real GPU's caching allocator and compare, event by
event, with vramplan's allocator model (vramplan.allocator).

Each alloc event is `torch.empty(nbytes, dtype=torch.uint8, device="cuda")` (no kernel, so
nothing but the caching allocator is exercised), each free drops the tensor; after every
event torch.cuda.memory_allocated() / memory_reserved() are read beside the model's
allocated and reserved bytes. The setup tensors are allocated once, then `--steps` steps
run, as vramplan.allocator.replay does.

    python bench/allocator/replay_cuda.py --spec job.yaml [--alloc-conf expandable_segments:True] [--steps 3]
    python bench/allocator/replay_cuda.py --model llama-3.2-1b --micro-batch-size 4 --seq-len 1024

Without a CUDA device it says so and exits 0 (nothing is written). On a GPU it writes
bench/allocator/results-cuda-<name>.json with the torch and CUDA versions, the GPU, the
first diverging event and the peaks on both sides.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", help="job spec (YAML/JSON); flags below override it")
    p.add_argument("--model")
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--method")
    p.add_argument("--gradient-checkpointing")
    p.add_argument("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF for both sides")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--name", default="case", help="suffix of the results file")
    return p.parse_args()


def load(args):
    import vramplan
    data = {}
    if args.spec:
        from vramplan.files import read_mapping
        data = read_mapping(args.spec)
    for key in ("model", "micro_batch_size", "seq_len", "method", "gradient_checkpointing"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    data["alloc_conf"] = args.alloc_conf or None
    return vramplan.load_spec(data)


def replay_model(events, conf, steps):
    from vramplan.allocator import CachingAllocator
    alloc, live, trace = CachingAllocator(conf), {}, []
    for kind, t, nbytes, *_ in events.setup:
        live[t] = alloc.malloc(nbytes)
    trace.append((alloc.allocated, alloc.reserved))
    for step in range(steps):
        if step == steps - 1:
            alloc.reset_peaks()
        for kind, t, nbytes, *_ in events.first_events() if step == 0 else events.step:
            if kind == "alloc":
                live[t] = alloc.malloc(nbytes)
            else:
                alloc.free(live.pop(t))
            trace.append((alloc.allocated, alloc.reserved))
    return trace, alloc.peak_reserved, alloc.peak_allocated


def replay_torch(torch, events, steps):
    live, trace = {}, []
    for kind, t, nbytes, *_ in events.setup:
        live[t] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    trace.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
    for step in range(steps):
        if step == steps - 1:
            torch.cuda.reset_peak_memory_stats()
        for kind, t, nbytes, *_ in events.first_events() if step == 0 else events.step:
            if kind == "alloc":
                live[t] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            else:
                del live[t]
            trace.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
    return trace, torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()


def main() -> int:
    args = parse()
    if args.alloc_conf:  # must be set before CUDA initialises
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    else:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    import torch
    if not torch.cuda.is_available():
        print("replay_cuda: no CUDA device here; skipped (nothing written)")
        return 0
    from vramplan.estimation import step_events
    from vramplan.spec.alloc_conf import parse_alloc_conf
    spec = load(args)
    events = step_events(spec)
    got, got_res, got_alloc = replay_torch(torch, events, args.steps)
    want, want_res, want_alloc = replay_model(events, parse_alloc_conf(args.alloc_conf), args.steps)
    diverge = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
    worst = max(abs(g[1] - w[1]) for g, w in zip(got, want))
    out = {"spec": spec.to_dict(), "alloc_conf": args.alloc_conf, "steps": args.steps,
           "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
           "events": len(got), "first_divergence": diverge,
           "events_matching": sum(g == w for g, w in zip(got, want)),
           "worst_reserved_gap_bytes": worst,
           "max_memory_reserved": {"torch": got_res, "model": want_res},
           "max_memory_allocated": {"torch": got_alloc, "model": want_alloc}}
    if diverge is not None:
        step_index = diverge - 1
        first = events.first_events()
        ev = (first[step_index] if step_index < len(first) else
              events.step[(step_index - len(first)) % len(events.step)]) if step_index >= 0 else None
        out["divergence_event"] = None if ev is None else list(ev)
        out["divergence_values"] = {"torch": got[diverge], "model": want[diverge]}
    path = os.path.join(HERE, f"results-cuda-{args.name}.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "spec"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

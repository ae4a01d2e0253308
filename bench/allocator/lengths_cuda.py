#!/usr/bin/env python3
"""Replay a dynamically padded run (a spec with a `lengths` section) on a real GPU's caching
allocator and compare max_memory_reserved after every step with the allocator model.

The steps are the ones `vramplan estimate` replays (vramplan.step.lengths: the seeded draw,
the batching policy, one event list per padded length); each alloc is
`torch.empty(nbytes, dtype=torch.uint8, device="cuda")`, each free drops the tensor, so only
the caching allocator is exercised. The model side runs the same steps through
vramplan.allocator.schedule (no capacity limit on either side).

    python bench/allocator/lengths_cuda.py --spec job.yaml [--batching sorted-longest-first] [--name NAME]

Without a CUDA device it says so and exits 0 (nothing written). On a GPU it writes
results-cuda-lengths-<name>.json: per step the length and reserved bytes on both sides, the
first step where they differ, and the run's maximum on both sides.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def steps_of(spec_path: str, batching: str | None):
    """(spec, setup ops, ops_for, step lengths) exactly as the estimate builds them."""
    import vramplan
    from vramplan.components.runtime import blas_workspace_terms
    from vramplan.components.trainable import param_set
    from vramplan.importers.lengths import resolve_lengths
    from vramplan.step.lengths import length_ops, step_lengths
    spec = vramplan.load_spec(spec_path)
    if batching:
        spec = spec.with_(lengths={**spec.lengths.to_dict(), "batching": batching})
    spec = resolve_lengths(spec, os.path.dirname(os.path.abspath(spec_path)))
    est = vramplan.estimate(spec)
    params = param_set(est.model, spec)
    setup, ops_for = length_ops(est.model, spec, params, True,
                                blas_workspace_terms(est.gpu.name if est.gpu else None))
    return spec, setup, ops_for, step_lengths(spec.lengths, spec.micro_batch_size, spec.seq_len)


def replay_torch(torch, setup, ops_for, lengths) -> list[int]:
    live: dict = {}
    for handle, nbytes in setup:
        live[handle] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = []
    for length in lengths:
        for handle, nbytes in ops_for(length):
            if nbytes:
                live[handle] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            else:
                del live[handle]
        out.append(torch.cuda.max_memory_reserved())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True, help="job spec with a lengths section")
    p.add_argument("--batching", help="override lengths.batching")
    p.add_argument("--name", default="case")
    args = p.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("lengths_cuda: no CUDA device here; skipped (nothing written)")
        return 0
    from vramplan.allocator.schedule import replay_schedule
    from vramplan.spec.alloc_conf import parse_alloc_conf
    spec, setup, ops_for, lengths = steps_of(args.spec, args.batching)
    if spec.alloc_conf:
        print("lengths_cuda: set PYTORCH_CUDA_ALLOC_CONF in the environment to the spec's alloc_conf", file=sys.stderr)
    got = replay_torch(torch, setup, ops_for, lengths)
    model = replay_schedule(setup, ops_for, lengths, parse_alloc_conf(spec.alloc_conf))
    first = next((i for i, (g, w) in enumerate(zip(got, model.reserved)) if g != w), None)
    out = {"spec": spec.to_dict(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(0), "steps": len(lengths), "first_differing_step": first,
           "max_memory_reserved": {"torch": max(got), "model": model.reserved_bytes},
           "per_step": [{"length": n, "torch": g, "model": w} for n, g, w in zip(lengths, got, model.reserved)]}
    with open(os.path.join(HERE, f"results-cuda-lengths-{args.name}.json"), "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")
    print(json.dumps({k: v for k, v in out.items() if k not in ("spec", "per_step")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

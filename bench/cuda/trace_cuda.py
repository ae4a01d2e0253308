#!/usr/bin/env python3
"""Record PyTorch's own allocation trace of a grid case's real CUDA training step.

The allocator model replays vramplan's event list exactly (bench/allocator/README.md), yet on
the CUDA grid its `max_memory_reserved` is under the measured one: the real step makes
allocations the event list does not hold. This records what the real step allocates, in
order, with PyTorch's memory history (`torch.cuda.memory._record_memory_history`,
torch/cuda/memory.py): every alloc and free with its size, the segments the allocator maps,
and the innermost Python frames of each alloc; phase boundaries are marked in the trace by
an allocation of a size no tensor of these cases has (`MARK`), made and freed at once.

    python bench/cuda/trace_cuda.py --case NAME --out trace-NAME.json

The JSON (read by bench/allocator/trace_compare.py) holds the measured phase peaks, the
allocator's own statistics and the trace as rows [action, addr, size, frame id], with the
frame strings in a table: `vramplan.measure(job, device="cuda", trace=True)`'s
allocator_trace (vramplan.measure.cuda_trace), what `vramplan measure --device cuda --trace`
records too. Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench", "accuracy"))
sys.path.insert(0, os.path.join(ROOT, "src"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", required=True, help="a case name of the cases file")
    ap.add_argument("--cases", default=os.path.join(ROOT, "bench", "accuracy", "grid_cases.yaml"),
                    help="cases file (default: bench/accuracy/grid_cases.yaml)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("trace_cuda: no CUDA device here; nothing recorded")
        return 0
    import grid
    from pathlib import Path
    from vramplan.measure import measure
    from vramplan.measure.run_modes import apply_alloc_conf

    cases = {c["name"]: c for c in grid.load_cases(Path(args.cases))}
    if args.case not in cases:
        print(f"--case: no case named {args.case!r} in {args.cases}")
        return 2
    apply_alloc_conf(cases[args.case]["job"].get("alloc_conf"))  # before CUDA starts
    gpu = torch.cuda.get_device_name()
    job = grid.cuda_job(dict(cases[args.case]["job"]), gpu)
    result = measure(job, device="cuda", trace=True, steps=args.steps)
    out = {"case": args.case, "cases_file": os.path.basename(args.cases), "job": job, "gpu": gpu,
           "torch": torch.__version__, "cuda": torch.version.cuda, "phase_peaks": result.phase_peaks,
           "max_memory_reserved": result.peak_reserved_bytes,
           "stats": {k: v for k, v in torch.cuda.memory_stats().items()
                     if k.endswith(".all.peak") or "retries" in k or k.startswith("num_")},
           **result.allocator_trace}
    rows, frames = out["trace"], out["frames"]
    with open(args.out, "w") as fh:
        json.dump(out, fh, separators=(",", ":"))
    print(f"{args.case}: {len(rows)} trace entries, {len(frames)} frames, "
          f"reserved peak {result.peak_reserved_bytes / 2**20:.1f} MiB -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

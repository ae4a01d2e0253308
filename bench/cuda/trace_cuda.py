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
frame strings in a table. Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench", "accuracy"))
sys.path.insert(0, os.path.join(ROOT, "src"))

# Marker sizes: 1000 * 512 bytes + the phase's index * 512 (small pool, below 1 MiB).
MARK = 1000 * 512
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "snapshot", "oom")
SKIP_FILES = ("torch/nn/modules/module.py", "torch/utils/_contextlib.py", "contextlib.py",
              "torch/_tensor.py", "torch/autograd/__init__.py", "torch/autograd/graph.py")


def frame_key(frames: list[dict]) -> str:
    """The three innermost frames outside the module-call plumbing, as file:line:function."""
    out = []
    for f in frames:
        name = f.get("filename", "")
        if any(name.endswith(s) for s in SKIP_FILES):
            continue
        parts = name.split("/site-packages/", 1)
        short = parts[-1] if len(parts) > 1 else os.path.basename(name)
        out.append(f"{short}:{f.get('line')}:{f.get('name')}")
        if len(out) == 3:
            break
    return " < ".join(out)


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
    from vramplan.measure.build import build, job_dict
    from vramplan.measure.run import train_steps
    from vramplan.measure.run_modes import CudaPhaseMeter, _apply_alloc_conf

    from pathlib import Path
    cases = {c["name"]: c for c in grid.load_cases(Path(args.cases))}
    if args.case not in cases:
        print(f"--case: no case named {args.case!r} in {args.cases}")
        return 2
    _apply_alloc_conf(cases[args.case]["job"].get("alloc_conf"))  # before CUDA starts
    gpu = torch.cuda.get_device_name()
    job = job_dict(grid.cuda_job(dict(cases[args.case]["job"]), gpu))
    phases: list[str] = []

    class MarkedMeter(CudaPhaseMeter):
        @contextlib.contextmanager
        def phase(self, name: str):
            phases.append(name)
            mark = torch.empty(MARK + 512 * len(phases), dtype=torch.uint8, device="cuda")
            del mark
            with super().phase(name) as m:
                yield m

    torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="alloc", stacks="python")
    torch.manual_seed(0)
    built = build(job, "cuda")
    meter = MarkedMeter()
    try:
        train_steps(built, job, meter, "cuda", args.steps)
    finally:
        meter.close()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    frames: dict[str, int] = {}
    rows = []
    for e in snap["device_traces"][0]:
        key = frame_key(e.get("frames") or []) if e["action"] == "alloc" else ""
        fid = frames.setdefault(key, len(frames)) if key else -1
        rows.append([ACTIONS.index(e["action"]) if e["action"] in ACTIONS else e["action"],
                     e["addr"], e["size"], fid])
    stats = torch.cuda.memory_stats()
    out = {
        "case": args.case, "cases_file": os.path.basename(args.cases), "job": job, "gpu": gpu, "torch": torch.__version__,
        "cuda": torch.version.cuda, "phases": phases, "mark_bytes": MARK,
        "phase_peaks": meter.phase_peaks, "max_memory_reserved": meter.reserved_peak,
        "stats": {k: v for k, v in stats.items() if k.endswith(".all.peak") or "retries" in k
                  or k.startswith("num_")},
        "actions": list(ACTIONS), "frames": sorted(frames, key=frames.get), "trace": rows,
    }
    with open(args.out, "w") as fh:
        json.dump(out, fh, separators=(",", ":"))
    print(f"{args.case}: {len(rows)} trace entries, {len(frames)} frames, "
          f"reserved peak {meter.reserved_peak / 2**20:.1f} MiB -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

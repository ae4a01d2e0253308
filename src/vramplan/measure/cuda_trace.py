"""PyTorch's own allocation trace of a CUDA training step, kept compact.

`torch.cuda.memory._record_memory_history` (torch/cuda/memory.py) makes the caching allocator
record every alloc, free and segment it maps, with the Python frames of each alloc;
`torch.cuda.memory._snapshot()["device_traces"]` returns them. Phase boundaries are marked in
the trace by an allocation no tensor of a step has (`MARK` + 512 bytes per phase, below the
small pool's 1 MiB), made and freed at once. `compact` keeps each entry as [action index,
address, size, frame id] with the frames in a table; vramplan.allocator.trace reads it back
(bench/allocator/trace_compare.py, `vramplan measure --device cuda --trace`).
"""
from __future__ import annotations

import contextlib
import os

MARK = 1000 * 512
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "snapshot", "oom")
_CPP_PLUMBING = ("unwind", "CapturedTraceback", "gather_with_cpp", "CachingAllocator", "::empty",
                 "empty_strided", "empty_cuda", "empty_generic", "wrap_kernel_functor", "c10::impl::",
                 "_ops::", "redispatch", "c10::Dispatcher", "KernelFunction", "BoxedKernel",
                 "anonymous namespace)::wrapper_", "at::_ops")
"""With VRAMPLAN_TRACE_STACKS=all: C++ frames of the allocation and dispatch machinery, skipped
so that the frames kept name the operator and the autograd node that asked for the memory."""
_PLUMBING = ("torch/nn/modules/module.py", "torch/utils/_contextlib.py", "contextlib.py",
             "torch/_tensor.py", "torch/autograd/__init__.py", "torch/autograd/graph.py")


def frame_key(frames: list[dict]) -> str:
    """The innermost frames outside the module-call plumbing, as file:line:function: three,
    or VRAMPLAN_TRACE_FRAMES (with VRAMPLAN_TRACE_STACKS=all, the C++ frames come first)."""
    keep = int(os.environ.get("VRAMPLAN_TRACE_FRAMES", "3"))
    out = []
    for f in frames:
        name = f.get("filename", "")
        if name.endswith(_PLUMBING) or any(p in f.get("name", "") for p in _CPP_PLUMBING):
            continue
        parts = name.split("/site-packages/", 1)
        out.append(f"{parts[-1] if len(parts) > 1 else os.path.basename(name)}:{f.get('line')}:{f.get('name')}")
        if len(out) == keep:
            break
    return " < ".join(out)


def compact(device_trace: list[dict], phases: list[str]) -> dict:
    """One device's trace entries (`_snapshot()["device_traces"][i]`) as the compact form."""
    frames: dict[str, int] = {}
    rows = []
    for e in device_trace:
        action = e["action"]
        key = frame_key(e.get("frames") or []) if action == "alloc" else ""
        fid = frames.setdefault(key, len(frames)) if key else -1
        rows.append([ACTIONS.index(action) if action in ACTIONS else action, e["addr"], e["size"], fid])
    return {"phases": list(phases), "mark_bytes": MARK, "actions": list(ACTIONS),
            "frames": sorted(frames, key=frames.get), "trace": rows}


def mark(torch, index: int) -> None:
    """Mark the start of phase `index` (from 1) in the trace."""
    t = torch.empty(MARK + 512 * index, dtype=torch.uint8, device="cuda")
    del t


@contextlib.contextmanager
def recording(torch, max_entries: int = 2_000_000):
    """Record the caching allocator's history while the block runs (Python frames of allocs)."""
    stacks = os.environ.get("VRAMPLAN_TRACE_STACKS", "python")  # "all": C++ frames too
    torch.cuda.memory._record_memory_history(max_entries=max_entries, context="alloc", stacks=stacks)
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)

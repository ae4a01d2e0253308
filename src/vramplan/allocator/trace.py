"""A real step's allocation trace (vramplan.measure.cuda_trace's compact form) through the
allocator model.

`ops(doc)` reads the trace as (kind "a" | "f", address, size, phase): allocs, and frees as the
allocator completes them (`free_completed`); a phase starts at its marker, which stays in
(it was a real allocation). `replay_ops` runs them through CachingAllocator with the run's
PYTORCH_CUDA_ALLOC_CONF: on 15 of the 16 H100 traces of bench/allocator/traces it gives the
measured max_memory_reserved to the byte (bench/allocator/README.md).
"""
from __future__ import annotations

from vramplan.allocator.model import CachingAllocator
from vramplan.spec.alloc_conf import AllocConf


def ops(doc: dict) -> list[tuple[str, int, int, str]]:
    actions, mark, phases = doc["actions"], doc["mark_bytes"], doc["phases"]
    out, phase = [], "init"
    for act, addr, size, _ in doc["trace"]:
        kind = actions[act] if isinstance(act, int) else act
        if kind == "alloc" and is_marker(doc, size):
            phase = phases[size // 512 - mark // 512 - 1]
        if kind == "alloc":
            out.append(("a", addr, size, phase))
        elif kind == "free_completed":
            out.append(("f", addr, size, phase))
    return out


def is_marker(doc: dict, size: int) -> bool:
    mark = doc["mark_bytes"]
    return mark < size <= mark + 512 * len(doc["phases"]) and size % 512 == 0


def replay_ops(seq: list, conf: AllocConf | None = None) -> tuple[int, dict[str, int]]:
    """(max reserved, {phase: reserved at its end}) of the model on the sequence."""
    alloc, live, top, ends = CachingAllocator(conf), {}, 0, {}
    for kind, addr, size, phase in seq:
        if kind == "a":
            live[addr] = alloc.malloc(size)
        elif addr in live:
            alloc.free(live.pop(addr))
        top = max(top, alloc.reserved)
        ends[phase] = alloc.reserved
    return top, ends

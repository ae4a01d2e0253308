"""Replay a sequence of steps of different lengths through one allocator, state carried over.

With dynamic padding each step pads to its own length, so the caching allocator is handed
a different set of block sizes each step. Cached segments are never returned to the
device without memory pressure (c10/cuda/CUDACachingAllocator.cpp: blocks go back to the
pool on free; only release_cached_blocks, on a failed cudaMalloc or empty_cache, unmaps
them), so a long step after many short ones finds the large pool cut to the short steps'
sizes and opens new segments on top: the reserve a run ends with depends on the order of
its lengths, not only on its longest step.

Cost: a step that neither opens nor releases a segment leaves the allocator as it found
it (every block it split is merged back when its tensors are freed: free_block's
try_merge_blocks), so a step of a length already replayed since the last segment change
is skipped: its outcome is known. A replay of hundreds of steps runs only the few that
change the segment map.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from vramplan.allocator.model import CachingAllocator, OutOfMemory
from vramplan.spec.alloc_conf import AllocConf

Ops = tuple  # ((handle, nbytes), ...): nbytes > 0 allocates `handle`, 0 frees it


@dataclass(frozen=True, slots=True)
class ScheduleResult:
    lengths: tuple[int, ...]
    """The padded length of each step, in replay order."""
    reserved: tuple[int, ...]
    """max_memory_reserved after each step (it never falls without memory pressure)."""
    reserved_bytes: int
    """max_memory_reserved over the run."""
    peak_step: int
    """Index of the first step at which reserved memory reaches its maximum."""
    segments: int
    """Segments (cudaMalloc calls still held) at the end of the run."""
    out_of_memory_step: int | None = None
    """First step that did not fit the capacity even after freeing the cached blocks."""
    retries: int = 0
    """Times malloc freed every cached block and retried (num_alloc_retries)."""
    replayed: int = 0
    """Steps actually run through the allocator (the rest repeated a known outcome)."""

    @property
    def peak_length(self) -> int:
        return self.lengths[self.peak_step]


def replay_schedule(setup: Ops, ops_for: Callable[[int], Ops], lengths: Sequence[int],
                    conf: AllocConf | None = None, capacity: int | None = None) -> ScheduleResult:
    """`setup` once (what lives across steps), then the step of each length in `lengths`
    (`ops_for(length)`: every tensor it allocates it frees). With `capacity`, a step that
    needs more frees the cached blocks and retries as malloc does; one that still fails is
    recorded as out of memory and the run goes on without the limit (its reserve is then
    the unconstrained one)."""
    alloc = CachingAllocator(conf or AllocConf(), capacity=capacity)
    live: dict = {}
    oom = None
    try:
        _run(alloc, setup, live)
    except OutOfMemory:  # what lives across steps (weights, states) overflows: no step runs
        oom = 0
        alloc, live = _unlimited(alloc, conf, setup, ops_for, ())
    done: set[tuple] = set()
    reserved, replayed = [], 0
    for i, length in enumerate(lengths):
        key = (length, alloc.num_device_alloc, alloc.num_device_free)
        if key not in done:
            replayed += 1
            try:
                _run(alloc, ops_for(length), live)
            except OutOfMemory:
                oom = i if oom is None else oom
                alloc, live = _unlimited(alloc, conf, setup, ops_for, lengths[: i + 1])
            if (length, alloc.num_device_alloc, alloc.num_device_free) == key:
                done.add(key)  # served from the cache: the same step again changes nothing
        reserved.append(alloc.peak_reserved)
    top = max(reserved)
    return ScheduleResult(lengths=tuple(lengths), reserved=tuple(reserved), reserved_bytes=top,
                          peak_step=reserved.index(top), segments=len(alloc.segment_sizes()),
                          out_of_memory_step=oom, retries=alloc.num_retries, replayed=replayed)


def _run(alloc: CachingAllocator, ops: Ops, live: dict) -> None:
    malloc, free = alloc.malloc, alloc.free
    for handle, nbytes in ops:
        if nbytes:
            live[handle] = malloc(nbytes)
        else:
            free(live.pop(handle))


def _unlimited(alloc: CachingAllocator, conf, setup: Ops, ops_for, lengths: Sequence[int]):
    """The run so far again without a capacity (the state the reserve would reach had the
    device been large enough), so later steps still report a reserve."""
    fresh = CachingAllocator(conf or AllocConf())
    live: dict = {}
    _run(fresh, setup, live)
    for length in lengths:
        _run(fresh, ops_for(length), live)
    fresh.num_retries += alloc.num_retries
    return fresh, live


__all__ = ["ScheduleResult", "replay_schedule"]

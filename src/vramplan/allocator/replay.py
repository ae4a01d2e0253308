"""Replay a step's tensor events through the allocator model, several steps in a row.

Steady state as a training loop reaches it: what lives across steps (weights, optimizer
states) is allocated first, then the step's events run up to `steps` times, stopping after
a step (not the first) that the cached segments served without a new one. The live peak and
the fragmentation are those of the last step replayed (torch.cuda.reset_peak_memory_stats
before it); reserved memory only grows without memory pressure, so its maximum is the
reserve the earlier steps left.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from vramplan.allocator.model import CachingAllocator, OutOfMemory
from vramplan.spec.alloc_conf import AllocConf

DEFAULT_STEPS = 3


@dataclass(frozen=True, slots=True)
class AllocatorResult:
    reserved_bytes: int
    """max_memory_reserved over the replayed steps."""
    allocated_bytes: int
    """max_memory_allocated: block sizes, so 512-byte rounding and unsplit remainders count."""
    requested_bytes: int
    """The live tensor bytes at the peak (the event list's maximum)."""
    fragmentation_bytes: int
    """Reserved minus the live tensor bytes at the live peak of the last step."""
    inactive_bytes: int
    """Part of it in cached free blocks (reserved - allocated then)."""
    rounding_bytes: int
    """Part of it inside allocated blocks (block size - requested bytes then)."""
    segments: tuple[tuple[str, int], ...] = ()
    """(pool, bytes) per segment after the last step."""
    options: AllocConf = field(default_factory=AllocConf)
    out_of_memory: bool = False
    """The capacity given could not hold the step even after freeing cached blocks."""
    retries: int = 0
    """Times malloc freed all cached blocks and retried (num_alloc_retries)."""

    def to_dict(self) -> dict:
        sizes = [s for _, s in self.segments]
        return {"reserved_bytes": self.reserved_bytes, "max_allocated_bytes": self.allocated_bytes,
                "live_peak_bytes": self.requested_bytes,
                "fragmentation_bytes": self.fragmentation_bytes,
                "fragmentation": {"inactive_blocks": self.inactive_bytes, "rounding": self.rounding_bytes},
                "options": self.options.to_dict(),
                "segments": {"count": len(sizes), "sizes": sorted(sizes, reverse=True)},
                "out_of_memory": self.out_of_memory, "alloc_retries": self.retries}


def replay(prologue: tuple, step: tuple, conf: AllocConf | None = None, capacity: int | None = None,
           steps: int = DEFAULT_STEPS, first: tuple | None = None) -> AllocatorResult:
    """prologue, step: sequences of (handle, nbytes) ops; nbytes > 0 allocates the tensor
    `handle`, nbytes == 0 frees it. Every tensor the step allocates it also frees. `first`:
    the first step's ops where they differ (tensors it makes and keeps, such as optimizer
    states created at the first `step()`; StepEvents.first_step).
    Memoized: identical event lists (one model's repeated estimates) replay once."""
    return _replay(tuple(prologue), tuple(step), conf or AllocConf(), capacity, steps,
                   None if first is None else tuple(first))


@lru_cache(maxsize=16)
def _replay(prologue: tuple, step: tuple, conf: AllocConf, capacity, steps: int,
            first: tuple | None = None) -> AllocatorResult:
    alloc = CachingAllocator(conf, capacity=capacity)
    live: dict[int, object] = {}
    try:
        _run(alloc, prologue, live)
        for i in range(steps):
            made = alloc.num_device_alloc
            alloc.reset_peaks()
            _run(alloc, first if i == 0 and first is not None else step, live)
            if i and alloc.num_device_alloc == made:
                break  # served from the cache: the steady state is reached
    except OutOfMemory:
        return _result(alloc, conf, oom=True)
    return _result(alloc, conf)


def _run(alloc: CachingAllocator, ops: tuple, live: dict) -> None:
    malloc, free = alloc.malloc, alloc.free
    for handle, nbytes in ops:
        if nbytes:
            live[handle] = malloc(nbytes)
        else:
            free(live.pop(handle))


def _result(alloc: CachingAllocator, conf: AllocConf, oom: bool = False) -> AllocatorResult:
    requested, allocated, reserved = alloc.at_peak
    return AllocatorResult(
        reserved_bytes=alloc.peak_reserved, allocated_bytes=alloc.peak_allocated,
        requested_bytes=alloc.peak_requested, fragmentation_bytes=reserved - requested,
        inactive_bytes=reserved - allocated, rounding_bytes=allocated - requested,
        segments=tuple(alloc.segment_sizes()), options=conf, out_of_memory=oom,
        retries=alloc.num_retries)

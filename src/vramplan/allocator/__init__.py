"""A model of PyTorch's CUDA caching allocator that replays a step's tensor events.

`replay(prologue, step, conf)` -> AllocatorResult (max_memory_reserved, fragmentation at
the live peak, the segment map); `CachingAllocator` is the allocator itself
(c10/cuda/CUDACachingAllocator.cpp, DeviceCachingAllocator).
"""
from vramplan.allocator.model import CachingAllocator, OutOfMemory, allocation_size, round_size
from vramplan.allocator.replay import AllocatorResult, replay

__all__ = ["AllocatorResult", "CachingAllocator", "OutOfMemory", "allocation_size", "replay", "round_size"]

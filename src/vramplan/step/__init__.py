"""The step of one rank: its plan (build.py) for the timeline and the allocator."""
from vramplan.step.events import ALLOC, FREE, Pieces, StepEvents, build_events, split_bytes

__all__ = ["ALLOC", "FREE", "Pieces", "StepEvents", "build_events", "split_bytes"]

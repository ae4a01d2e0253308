"""The step as an ordered list of tensor events (see step/events.py)."""
from vramplan.step.events import ALLOC, FREE, Pieces, StepEvents, build_events, split_bytes

__all__ = ["ALLOC", "FREE", "Pieces", "StepEvents", "build_events", "split_bytes"]

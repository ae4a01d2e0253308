"""The step of one rank: its plan (build.py) for the timeline and the allocator."""

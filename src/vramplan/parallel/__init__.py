"""Parallel layouts per rank: sharding of each term, engine buffers, communication and
host memory. `rank_plan` turns the single-GPU StepPlan into the worst rank's StepPlan."""
from vramplan.parallel.layout import Layout
from vramplan.parallel.plan import ParallelReport, rank_plan

__all__ = ["Layout", "ParallelReport", "rank_plan"]

"""Parallel layouts per rank: sharding of each term, engine buffers, communication and
host memory. `rank_plan` turns the single-GPU StepPlan into the worst rank's StepPlan.

The names load on first use (PEP 562): a one-GPU estimate never needs the parallel layer,
and `vramplan estimate` should not pay its import."""

__all__ = ["Layout", "ParallelReport", "rank_plan"]


def __getattr__(name: str):
    if name == "Layout":
        from vramplan.parallel.layout import Layout
        return Layout
    if name in ("ParallelReport", "rank_plan"):
        from vramplan.parallel import plan
        return getattr(plan, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

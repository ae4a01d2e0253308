"""Honest error bars: per metric a relative interval [lo, hi] around the estimate that held
the measured figure on at least 90% of published GPU runs, and the verdicts built on it.

An interval is an empirical quantile over measured rows, not a constant fitted to any row:
with r = measured / estimated for each of n rows, sorted, the interval keeps
k = ceil(target * n) consecutive rows and leaves out the m = n - k most extreme ones,
ceil(m / 2) from the low end and floor(m / 2) from the high end (the high end decides
"fits", so it keeps the odd one). `leave_one_out` reports the coverage the method really
reaches on rows it has not seen. The data file (catalog/bounds.json) is written by
bench/accuracy/bounds.py; nothing here reads files except through the catalog loader.
"""
from __future__ import annotations

import math

FITS = "fits"
LOW_END = "fits only at the low end"
NO_FIT = "does not fit"
METRICS = ("allocated", "reserved", "device")


def interval(ratios: list[float], target: float = 0.9) -> tuple[float, float]:
    """[lo, hi] containing at least `target` of `ratios` (measured / estimated)."""
    if not ratios:
        raise ValueError("an interval needs at least one measured row")
    r = sorted(ratios)
    n = len(r)
    outside = n - math.ceil(target * n - 1e-9)
    low, high = (outside + 1) // 2, outside // 2
    return r[low], r[n - 1 - high]


def coverage(ratios: list[float], lo: float, hi: float) -> float:
    return sum(lo <= x <= hi for x in ratios) / len(ratios)


def leave_one_out(ratios: list[float], target: float = 0.9) -> float | None:
    """Share of rows inside the interval built from all the other rows (None below 2 rows)."""
    if len(ratios) < 2:
        return None
    hits = 0
    for i, x in enumerate(ratios):
        lo, hi = interval(ratios[:i] + ratios[i + 1:], target)
        hits += lo <= x <= hi
    return hits / len(ratios)


def relative_bounds() -> dict[str, tuple[float, float]]:
    """{metric: (lo, hi)} from catalog/bounds.json."""
    from vramplan.catalog.runtime import error_bounds
    return {m: (v["lo"], v["hi"]) for m, v in error_bounds()["metrics"].items()}


def bounds_around(estimates: dict[str, int], rel: dict[str, tuple[float, float]] | None = None
                  ) -> dict[str, list[int]]:
    """{metric: [lo, hi]} in bytes: each estimate times its metric's relative interval."""
    rel = relative_bounds() if rel is None else rel
    return {m: [int(v * rel[m][0]), math.ceil(v * rel[m][1])] for m, v in estimates.items() if m in rel}


def verdict(estimate: int, upper: int | None, capacity: int) -> str:
    """fits: the upper bound fits; fits only at the low end: the estimate fits, its upper
    bound does not; does not fit: the estimate does not fit."""
    if estimate > capacity:
        return NO_FIT
    if upper is not None and upper > capacity:
        return LOW_END
    return FITS


def default_headroom_bytes(capacity: int, rel: dict[str, tuple[float, float]] | None = None) -> int:
    """Memory `fit` keeps free by default: what makes an estimate at the limit have its
    device upper bound at the capacity, capacity * (1 - 1 / hi)."""
    hi = (relative_bounds() if rel is None else rel)["device"][1]
    return max(0, int(capacity - capacity / hi)) if hi > 1 else 0

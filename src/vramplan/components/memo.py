"""Memoization of per-parameter sums, keyed by an immutable owner (a ParamSet).

A search re-estimates one model under many layouts; the sums over every parameter tensor
(weights, gradients, optimizer states) only change with a few spec fields. Results are
Breakdowns, which callers extend, so each call gets a fresh copy.
"""
from __future__ import annotations

from typing import Callable

from vramplan.breakdown import Breakdown

_CACHE: dict[tuple, tuple[object, object]] = {}
_SIZE = 256


def cached(owner: object, key: tuple, compute: Callable[[], "Breakdown | list[Breakdown]"]):
    full = (id(owner),) + key
    hit = _CACHE.get(full)
    if hit is None or hit[0] is not owner:
        if len(_CACHE) >= _SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        hit = (owner, compute())
        _CACHE[full] = hit
    value = hit[1]
    if isinstance(value, Breakdown):
        return Breakdown(dict(value.terms))
    return [Breakdown(dict(b.terms)) for b in value]

"""Memoization of per-parameter sums, keyed by an immutable owner (a ParamSet).

A search re-estimates one model under many layouts; the sums over every parameter tensor
(weights, gradients, optimizer states) only change with a few spec fields. Results are
Breakdowns, which callers extend, so each call gets a fresh copy.
"""
from __future__ import annotations

from collections.abc import Callable

from vramplan.breakdown import Breakdown

_CACHE: dict[tuple, tuple[object, object]] = {}
_SIZE = 256


def cached(owner: object, key: tuple, compute: Callable[[], "Breakdown | list[Breakdown]"]):
    """`compute()` for (owner, key), kept while `owner` is alive; a fresh copy each call.
    A list (per-stage gradients) is kept with its equal entries (same terms in the same
    order: identical layers) as one Breakdown, and handed out the same way, one copy per
    distinct entry: the timeline then sums each once, times its count (timeline._sum),
    which gives the same terms in the same order as summing every entry."""
    full = (id(owner),) + key
    hit = _CACHE.get(full)
    if hit is None or hit[0] is not owner:
        if len(_CACHE) >= _SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        value = compute()
        hit = (owner, value if isinstance(value, Breakdown) else _shared_entries(value))
        _CACHE[full] = hit
    value = hit[1]
    if isinstance(value, Breakdown):
        return Breakdown(dict(value.terms))
    copies: dict[int, Breakdown] = {}
    out = []
    for b in value:
        c = copies.get(id(b))
        if c is None:
            c = copies[id(b)] = Breakdown(dict(b.terms))
        out.append(c)
    return out


def _shared_entries(items: list[Breakdown]) -> list[Breakdown]:
    """`items` with entries of equal content (terms and their order) as one object."""
    seen: dict[tuple, Breakdown] = {}
    return [seen.setdefault(tuple(b.terms.items()), b) for b in items]


# JobSpec fields that no term of one model's saved activations reads (no module of
# components/ or families/ reads them): the model (its ModelDesc is part of the key), the
# layout, the GPU and the run's environment. A search varies several of them.
LAYOUT_FIELDS = frozenset({"model", "gpu", "num_gpus", "parallel", "grad_accum_steps", "cuda_version",
                           "alloc_conf", "lengths", "online", "trust_remote_code", "compile"})
_FIELDS: dict[tuple, Callable] = {}


def _frozen(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if hasattr(value, "to_dict"):  # a spec section holding a mapping (parallel.extras)
        try:
            hash(value)
        except TypeError:
            return (type(value).__name__, _frozen(value.to_dict()))
    return value


# Types whose values _frozen returns unchanged, known without asking each value: builtins
# that are no dict or list, and enums (spec choices) without a to_dict.
_PLAIN_TYPES: dict[type, bool] = {}


def _plain(kind: type) -> bool:
    plain = _PLAIN_TYPES.get(kind)
    if plain is None:
        import enum
        plain = _PLAIN_TYPES[kind] = (
            (kind.__module__ == "builtins" or issubclass(kind, enum.Enum))
            and not issubclass(kind, (dict, list)) and not hasattr(kind, "to_dict"))
    return plain


def spec_key(spec, drop: frozenset = LAYOUT_FIELDS) -> tuple | None:
    """Every field of `spec` but `drop`, as a hashable key; None where one is not hashable."""
    read = _FIELDS.get((type(spec), drop))
    if read is None:
        from dataclasses import fields
        from operator import attrgetter
        names = [f.name for f in fields(spec) if f.name not in drop]
        read = _FIELDS[(type(spec), drop)] = attrgetter(*names) if len(names) > 1 else (
            lambda s, n=tuple(names): tuple(getattr(s, x) for x in n))
    key = read(spec)
    try:
        hash(key)       # every value hashable: each is its own _frozen form (dicts and
        return key      # lists never hash; other values are returned unchanged)
    except TypeError:
        pass
    key = tuple(v if _plain(type(v)) else _frozen(v) for v in key)
    try:
        hash(key)
    except TypeError:
        return None
    return key


_PLANS: dict[tuple, tuple[object, object, object]] = {}


def cached_plan(desc: object, params: object, key: tuple, compute: Callable[[], object]):
    """The value of `compute` for one (ModelDesc, ParamSet) pair and spec key, kept while
    both are alive (their ids are compared by identity, as `cached` does). The caller
    copies what it hands out."""
    full = (id(desc), id(params)) + key
    hit = _PLANS.get(full)
    if hit is None or hit[0] is not desc or hit[1] is not params:
        if len(_PLANS) >= _SIZE:
            _PLANS.pop(next(iter(_PLANS)))
        hit = (desc, params, compute())
        _PLANS[full] = hit
    return hit[2]


_VALUES: dict[tuple, object] = {}


def by_key(key: tuple, compute: Callable[[], object]):
    """`compute()` for a key of plain values (a spec's fields and a GPU name: the allocator
    replay's reserve), kept for the next call with an equal key."""
    if key not in _VALUES:
        if len(_VALUES) >= _SIZE:
            _VALUES.pop(next(iter(_VALUES)))
        _VALUES[key] = compute()
    return _VALUES[key]


def clear() -> None:
    """Forget every value memoized here (a test's cold estimate, the benchmark's cold figure)."""
    _CACHE.clear()
    _PLANS.clear()
    _VALUES.clear()

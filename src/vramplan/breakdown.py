"""Breakdown: named terms 'group/item' -> bytes; the one thing passed between layers.

As in nanoGPT's transformer_sizing table, every number has a key and subtotals are plain
sums over a key prefix. Values are integer bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from operator import mul
from collections.abc import Iterable, Iterator


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor the estimate holds: a saved activation, a gradient, a temporary ..."""

    name: str
    """'group/item' key, e.g. 'activations/layer/mlp/gate'."""
    numel: int
    dtype: str
    count: int = 1
    """How many such tensors (e.g. one per layer)."""

    @property
    def nbytes(self) -> int:
        from vramplan.units import nbytes
        return nbytes(self.numel, self.dtype) * self.count


@dataclass(slots=True)
class Breakdown:
    """An ordered table of named byte counts."""

    terms: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, tensors: Iterable[Tensor]) -> "Breakdown":
        out = cls()
        for t in tensors:
            out.add(t.name, t.nbytes)
        return out

    def add(self, name: str, nbytes: int) -> "Breakdown":
        if nbytes < 0:
            raise ValueError(f"term {name} would be negative ({nbytes} bytes)")
        if nbytes:
            self.terms[name] = self.terms.get(name, 0) + int(nbytes)
        return self

    def merge(self, other: "Breakdown", prefix: str = "", times: int = 1) -> "Breakdown":
        """Add every term of `other` (`times` times over: what merging it that often adds,
        in the same key order; the estimate's hot loop, so `add` is inlined)."""
        terms = self.terms
        if not terms and not prefix and _positive_ints(other.terms):
            # into an empty table (a copy, a scaled or summed part): the same keys in the
            # same order with the same values, copied in C
            if times == 1:
                terms.update(other.terms)
            else:
                terms.update(zip(other.terms, map(mul, other.terms.values(), repeat(times))))
            return self
        for name, value in other.terms.items():
            if value < 0:
                raise ValueError(f"term {prefix + name} would be negative ({value} bytes)")
            if value:
                if prefix:
                    name = prefix + name
                terms[name] = terms.get(name, 0) + int(value) * times
        return self

    def total(self, prefix: str = "") -> int:
        if not prefix:
            return sum(self.terms.values())
        return sum(v for k, v in self.terms.items() if k.startswith(prefix))

    def groups(self, depth: int = 1) -> dict[str, int]:
        """Subtotals by the first `depth` parts of the key."""
        out: dict[str, int] = {}
        for name, value in self.terms.items():
            key = "/".join(name.split("/")[:depth])
            out[key] = out.get(key, 0) + value
        return out

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self.terms.items())

    def __len__(self) -> int:
        return len(self.terms)

    def to_dict(self) -> dict[str, int]:
        return dict(self.terms)


def _positive_ints(terms: dict) -> bool:
    """Every value a plain int above 0 (what `merge` adds unchanged), checked in C."""
    return not terms or (set(map(type, terms.values())) == {int} and min(terms.values()) > 0)


def shared(parts: list[Breakdown]) -> list[Breakdown]:
    """The distinct Breakdowns of `parts` by identity, in order of first place. Lists of a
    plan's stages share one object between equal stages (identical layers): what is added
    to every stage is added to each of these once."""
    seen: set[int] = set()
    out = []
    for p in parts:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def own(parts: list[Breakdown], i: int) -> Breakdown:
    """parts[i] as an object of its own (a copy where another place shares it), for what is
    added to that stage alone."""
    p = parts[i]
    if any(q is p for j, q in enumerate(parts) if j != i % len(parts)):
        p = parts[i] = Breakdown(dict(p.terms))
    return p

"""Read a file of the dataset's token lengths at the edge (spec section `lengths`).

The file holds one integer per line (blank lines and `#` comments skipped) or a JSON list
of integers. It is summarised into the percentiles the core samples from
(spec/lengths.py): min, p1, p5, p10 ... p95, p99, p99.9 and max, by the nearest-rank
method, so the spec stays small and round-trips, and the estimator core never opens it.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import replace

from vramplan.spec.enums import SpecError

MAX_BYTES = 256 * 2**20
"""Largest lengths file read (256 MiB: tens of millions of rows)."""
PERCENTILES = (1, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70, 75, 80, 85, 90, 95, 99, 99.9)
FIELD = "lengths.lengths_file"


def read_lengths(path: str) -> list[int]:
    """The token lengths in `path` (one per line, or a JSON list); SpecError naming the
    field and the line for anything else."""
    text = _text(path)
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError(FIELD, f"{path}: not a JSON list of integers ({exc.msg}, line {exc.lineno})") from None
        except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
            raise SpecError(FIELD, f"{path}: holds a number of thousands of digits; expected token counts") from None
        if not isinstance(values, list):
            raise SpecError(FIELD, f"{path}: not a JSON list of integers")
        rows = [(i + 1, v) for i, v in enumerate(values)]
        where = "item"
    else:
        rows = [(n, line.split("#", 1)[0].strip()) for n, line in enumerate(text.splitlines(), 1)]
        rows = [(n, v) for n, v in rows if v]
        where = "line"
    out = [_length(path, where, n, v) for n, v in rows]
    if not out:
        raise SpecError(FIELD, f"{path}: holds no lengths; write one token count per line or a JSON list")
    return out


def _text(path: str) -> str:
    if not os.path.isfile(path):
        why = ("is a folder" if os.path.isdir(path) else "not a regular file" if os.path.exists(path)
               else "file not found")
        raise SpecError(FIELD, f"{path}: {why}; give a file of token lengths (one per line, or a JSON list)")
    if os.path.getsize(path) > MAX_BYTES:
        raise SpecError(FIELD, f"{path}: larger than {MAX_BYTES // 2**20} MiB; pass percentiles instead")
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(FIELD, f"{path}: cannot be read ({exc.__class__.__name__})") from None


def _length(path: str, where: str, n: int, value) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if isinstance(value, str) and value.isascii() and value.isdigit():
        if len(value) > 30:  # past any row (spec/lengths caps max); int() refuses 4,300+ digits
            raise SpecError(FIELD, f"{path}: {where} {n} is a {len(value):,}-digit number; expected a token count")
        value, ok = int(value), True
    if not ok or value < 1:
        raise SpecError(FIELD, f"{path}: {where} {n} is {value!r}; expected a positive token count")
    return value


def summarise(values: list[int]) -> dict:
    """min, the PERCENTILES (nearest rank: the smallest value with at least p% of the rows at
    or below it) and max of `values`."""
    ordered = sorted(values)
    n = len(ordered)
    out = {"min": ordered[0], "max": ordered[-1], "rows": n}
    out["percentiles"] = tuple((p, ordered[max(0, math.ceil(p / 100 * n) - 1)]) for p in PERCENTILES)
    return out


def resolve_lengths(spec, base_dir: str | None = None):
    """The spec with its lengths file read and summarised (unchanged without one, or when
    the distribution is already given). A relative path is taken from `base_dir` (the spec
    file's folder) where the file is there, else from the working directory."""
    cfg = spec.lengths
    if cfg is None or cfg.lengths_file is None or cfg.resolved:
        return spec
    path = os.path.expanduser(cfg.lengths_file)
    if base_dir and not os.path.isabs(path) and os.path.isfile(os.path.join(base_dir, path)):
        path = os.path.join(base_dir, path)
    summary = summarise(read_lengths(path))
    return replace(spec, lengths=replace(cfg, **summary))


__all__ = ["read_lengths", "resolve_lengths", "summarise"]

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
from collections import Counter
from dataclasses import replace

from vramplan.spec.enums import SpecError

MAX_BYTES = 256 * 2**20
"""Largest lengths file read (256 MiB: tens of millions of rows)."""
MAX_JSON_BYTES = 32 * 2**20
"""Largest JSON list of lengths (parsed whole: a few million rows)."""
PERCENTILES = (1, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70, 75, 80, 85, 90, 95, 99, 99.9)
FIELD = "lengths.lengths_file"


def read_lengths(path: str) -> list[int]:
    """The token lengths in `path` (one per line, or a JSON list); SpecError naming the
    field and the line for anything else."""
    out = list(_lengths(path))
    if not out:
        raise SpecError(FIELD, f"{path}: holds no lengths; write one token count per line or a JSON list")
    return out


def _lengths(path: str):
    """The lengths one by one: a file of lines is read as a stream (a list of its lines'
    strings took 1.2 GB for 5 million rows), a JSON list (at most MAX_JSON_BYTES) whole."""
    _check_file(path)
    try:
        with open(path, encoding="utf-8") as fh:
            head = fh.read(4096)
            if head.lstrip().startswith("["):
                if os.path.getsize(path) > MAX_JSON_BYTES:
                    raise SpecError(FIELD, f"{path}: a JSON list larger than {MAX_JSON_BYTES // 2**20} MiB; "
                                           "write one token count per line")
                for i, v in enumerate(_json_list(path, head + fh.read()), 1):
                    yield _length(path, "item", i, v)
                return
            fh.seek(0)
            for n, line in enumerate(fh, 1):
                value = line.split("#", 1)[0].strip()
                if value:
                    yield _length(path, "line", n, value)
    except UnicodeDecodeError:  # was "cannot be read (UnicodeDecodeError)"
        raise SpecError(FIELD, f"{path}: not UTF-8 text; write one token count per line "
                               "or a JSON list") from None
    except OSError as exc:
        raise SpecError(FIELD, f"{path}: cannot be read ({exc.strerror or exc.__class__.__name__})") from None


def _json_list(path: str, text: str) -> list:
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(FIELD, f"{path}: not a JSON list of integers ({exc.msg}, line {exc.lineno})") from None
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise SpecError(FIELD, f"{path}: holds a number of thousands of digits; expected token counts") from None
    except RecursionError:  # [[[[... nested past the parser's stack: was exit 70
        raise SpecError(FIELD, f"{path}: not a JSON list of integers (nested lists)") from None
    if not isinstance(values, list):
        raise SpecError(FIELD, f"{path}: not a JSON list of integers")
    return values


def _check_file(path: str) -> None:
    if not os.path.isfile(path):
        why = ("is a folder" if os.path.isdir(path) else "not a regular file" if os.path.exists(path)
               else "file not found")
        raise SpecError(FIELD, f"{path}: {why}; give a file of token lengths (one per line, or a JSON list)")
    if os.path.getsize(path) > MAX_BYTES:
        raise SpecError(FIELD, f"{path}: larger than {MAX_BYTES // 2**20} MiB; pass percentiles instead")


def _length(path: str, where: str, n: int, value) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if isinstance(value, str) and value.isascii() and value.isdigit():
        if len(value) > 30:  # past any row (spec/lengths caps max); int() refuses 4,300+ digits
            raise SpecError(FIELD, f"{path}: {where} {n} is a {len(value):,}-digit number; expected a token count")
        value, ok = int(value), True
    if not ok or value < 1:
        raise SpecError(FIELD, f"{path}: {where} {n} is {value!r}; expected a positive token count")
    return value


def summarise(values) -> dict:
    """min, the PERCENTILES (nearest rank: the smallest value with at least p% of the rows at
    or below it) and max of `values` (any iterable: counted, so memory follows the distinct
    lengths, not the rows)."""
    counts = Counter(values)
    ordered = sorted(counts)
    n = sum(counts.values())
    ranks = [max(1, math.ceil(p / 100 * n)) for p in PERCENTILES]
    picked, seen, i = [], 0, 0
    for value in ordered:
        seen += counts[value]
        while i < len(ranks) and ranks[i] <= seen:
            picked.append((PERCENTILES[i], value))
            i += 1
    return {"min": ordered[0], "max": ordered[-1], "rows": n, "percentiles": tuple(picked)}


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
    counts = Counter(_lengths(path))
    if not counts:
        raise SpecError(FIELD, f"{path}: holds no lengths; write one token count per line or a JSON list")
    summary = summarise(counts)
    return replace(spec, lengths=replace(cfg, **summary))


__all__ = ["read_lengths", "resolve_lengths", "summarise"]

"""PYTORCH_CUDA_ALLOC_CONF: the caching allocator's options, parsed and validated.

The grammar and the checks follow PyTorch's own parser (c10/core/AllocatorConfig.cpp,
AllocatorConfig::parseArgs / lexArgs and the parse* helpers; in PyTorch 2.0-2.7
c10/cuda/CUDAAllocatorConfig.cpp, CUDAAllocatorConfig::parseArgs): `key:value` pairs
separated by commas, spaces ignored, roundup_power2_divisions either one power of two or a
list `[256:1,512:2,>:4]` keyed by request size in MB. A bad option raises SpecError naming
it, as PyTorch would refuse it at start-up.
"""
from __future__ import annotations

import re

from dataclasses import dataclass
from functools import lru_cache

from vramplan.spec.enums import SpecError

MiB = 2**20
# c10/cuda/CUDACachingAllocator.cpp kLargeBuffer: max_split_size_mb and
# max_non_split_rounding_mb must be at least this many MB.
_LARGE_BUFFER_MB = 20
# AllocatorConfig: 16 intervals of request sizes for roundup_power2_divisions, 1 MB .. 64 GB.
ROUNDUP_INTERVALS = 16
_FIELD = "alloc_conf"

KNOWN_OPTIONS = ("max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
                 "roundup_power2_divisions", "expandable_segments", "backend",
                 "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                 "pinned_num_register_threads", "pinned_use_background_threads")


@dataclass(frozen=True, slots=True)
class AllocConf:
    """The options that change where the caching allocator puts blocks (the pinned-memory
    and locking options are accepted and ignored: they do not change device memory)."""

    max_split_size: int | None = None
    """Bytes; blocks this large or larger are never split (None: unlimited, the default)."""
    max_non_split_rounding: int = _LARGE_BUFFER_MB * MiB
    """An oversize cached block serves a request only if at most this much larger."""
    garbage_collection_threshold: float = 0.0
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    """Per power-of-two interval of the request size (1 MB, 2 MB, ... 32 GB+)."""
    expandable_segments: bool = False
    backend: str = "native"
    """native (the caching allocator) or cudaMallocAsync (the driver's pool)."""

    def to_dict(self) -> dict:
        return {"max_split_size_mb": None if self.max_split_size is None else self.max_split_size // MiB,
                "max_non_split_rounding_mb": self.max_non_split_rounding // MiB,
                "garbage_collection_threshold": self.garbage_collection_threshold,
                "roundup_power2_divisions": list(self.roundup_power2_divisions),
                "expandable_segments": self.expandable_segments, "backend": self.backend}


def _lex(text: str) -> list[str]:
    """AllocatorConfig::lexArgs: ',', ':', '[' and ']' are tokens; spaces are dropped."""
    out, buf = [], []
    for ch in text:
        if ch in ",:[]":
            if buf:
                out.append("".join(buf))
                buf = []
            out.append(ch)
        elif ch != " ":
            buf.append(ch)
    if buf:
        out.append("".join(buf))
    return out


def _bad(option: str, why: str) -> SpecError:
    return SpecError(_FIELD, f"{option}: {why} (PYTORCH_CUDA_ALLOC_CONF syntax: "
                             "'expandable_segments:True,max_split_size_mb:128')")


def _int(option: str, text: str) -> int:
    # c10's std::stoi/stoull read ASCII digits only: Python's int() would also take '1_000'
    # and other scripts' digits ('١٢٨'), which PyTorch rejects or misreads
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        raise _bad(option, f"expected an integer, got {text!r}")
    return int(text)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _bool(option: str, text: str) -> bool:
    if text not in ("True", "False"):
        raise _bad(option, f"expected True or False, got {text!r}")
    return text == "True"


def check_text(value: object) -> None:
    """The spec's alloc_conf is the variable's text: str() of a list or mapping is none."""
    if not isinstance(value, str):
        raise SpecError(_FIELD, f"expected a string like 'expandable_segments:True,max_split_size_mb:128', "
                                f"got a {type(value).__name__}")


@lru_cache(maxsize=256)
def parse_alloc_conf(text: str | None) -> AllocConf:
    """AllocConf from a PYTORCH_CUDA_ALLOC_CONF string ('' or None: the defaults)."""
    if not text or not text.strip():
        return AllocConf()
    toks = _lex(text)
    values: dict = {}
    i = 0
    while i < len(toks):
        key = toks[i]
        if key not in KNOWN_OPTIONS:
            import difflib
            hint = difflib.get_close_matches(key, KNOWN_OPTIONS, n=1)
            raise _bad(key, "unknown option" + (f"; did you mean {hint[0]!r}?" if hint else
                                                 f"; known: {', '.join(KNOWN_OPTIONS)}"))
        if i + 1 >= len(toks) or toks[i + 1] != ":" or i + 2 >= len(toks):
            raise _bad(key, "expected key:value")
        i = _option(key, toks, i + 2, values)
        if i + 1 < len(toks):
            if toks[i + 1] != ",":
                raise _bad(key, f"expected ',' after the value, got {toks[i + 1]!r}")
            i += 1
        i += 1
    return AllocConf(**values)


def _option(key: str, toks: list[str], i: int, values: dict) -> int:
    """Parse the value of `key` starting at toks[i]; returns the index of its last token."""
    val = toks[i]
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        mb = _int(key, val)
        if mb < _LARGE_BUFFER_MB:
            raise _bad(key, f"too small, must be >= {_LARGE_BUFFER_MB}")
        values["max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding"] = mb * MiB
    elif key == "garbage_collection_threshold":
        try:
            frac = float(val)
        except ValueError:
            raise _bad(key, f"expected a number in (0, 1), got {val!r}") from None
        if not 0.0 < frac < 1.0:
            raise _bad(key, "must be in (0.0, 1.0)")
        values["garbage_collection_threshold"] = frac
    elif key == "roundup_power2_divisions":
        divs, i = _divisions(toks, i)
        values["roundup_power2_divisions"] = divs
    elif key == "expandable_segments":
        values["expandable_segments"] = _bool(key, val)
    elif key == "backend":
        if val not in ("native", "cudaMallocAsync"):
            raise _bad(key, f"unknown backend {val!r}; options are native and cudaMallocAsync")
        values["backend"] = val
    elif key in ("release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_use_background_threads"):
        _bool(key, val)
    elif key == "pinned_num_register_threads" and not _pow2(_int(key, val)):
        raise _bad(key, "must be a power of 2")
    return i


def _divisions(toks: list[str], i: int) -> tuple[tuple[int, ...], int]:
    """AllocatorConfig::parseRoundUpPower2Divisions."""
    key = "roundup_power2_divisions"
    if toks[i] != "[":
        n = _int(key, toks[i])
        if not _pow2(n):
            raise _bad(key, "the divisions have to be a power of 2")
        return (n,) * ROUNDUP_INTERVALS, i
    divs = [0] * ROUNDUP_INTERVALS
    first, last = True, 0
    i += 1
    while i < len(toks) and toks[i] != "]":
        size = toks[i]
        if i + 2 >= len(toks) or toks[i + 1] != ":":
            raise _bad(key, "expected [size_mb:divisions, ...]")
        n = _int(key, toks[i + 2])
        if n != 0 and not _pow2(n):
            raise _bad(key, "the divisions have to be a power of 2 or 0")
        if size == ">":
            for j in range(last, ROUNDUP_INTERVALS):
                divs[j] = n
        else:
            mb = _int(key, size)
            if not _pow2(mb):
                raise _bad(key, f"the interval {mb} has to be a power of 2")
            idx = min(mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                for j in range(idx):
                    divs[j] = n
                first = False
            divs[idx] = n
            last = idx
        i += 3
        if i < len(toks) and toks[i] == ",":
            i += 1
    if i >= len(toks):
        raise _bad(key, "missing ']'")
    return tuple(divs), i

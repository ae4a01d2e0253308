"""Dtypes in bits, byte arithmetic and labelled formatting. Imports nothing of ours.

Bytes are integers everywhere inside vramplan; only display converts. GiB is 2**30 bytes
(what PyTorch and nvidia-smi's MiB figures count), GB is 10**9 bytes (what GPUs are sold in).
"""
from __future__ import annotations

import math

GiB = 2**30
MiB = 2**20
GB = 10**9

# Width in bits of each storage dtype vramplan models (tinygrad keeps widths in bits too,
# so 4-bit weights are exact). nf4/fp4 pack two values per byte (bitsandbytes Params4bit).
DTYPE_BITS: dict[str, int] = {
    "fp32": 32,
    "tf32": 32,
    "fp16": 16,
    "bf16": 16,
    "fp8": 8,
    "int8": 8,
    "uint8": 8,
    "bool": 8,  # torch.bool occupies one byte per element
    "int32": 32,
    "int64": 64,
    "nf4": 4,
    "fp4": 4,
    # GPTQ/AWQ/HQQ/torchao codes by width (their packed layouts: components/quant.py)
    "int1": 1,
    "int2": 2,
    "int3": 3,
    "int4": 4,
}


def dtype_bits(dtype: str) -> int:
    try:
        return DTYPE_BITS[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BITS)}") from None


def nbytes(numel: int, dtype: str) -> int:
    """Bytes to hold `numel` elements of `dtype`, rounded up to whole bytes."""
    bits = DTYPE_BITS.get(dtype)      # (the hottest call of an estimate: inlined dtype_bits)
    return -(-numel * (bits if bits is not None else dtype_bits(dtype)) // 8)


def numel(*dims: int) -> int:
    return math.prod(dims)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def fmt_gib(n: int, digits: int = 2) -> str:
    return f"{n / GiB:.{digits}f} GiB"


def fmt_gb(n: int, digits: int = 2) -> str:
    return f"{n / GB:.{digits}f} GB"


def fmt_bytes(n: int) -> str:
    """Human size in binary units, labelled (B, KiB, MiB, GiB, TiB)."""
    sign = "-" if n < 0 else ""
    v = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{sign}{v:.2f} {unit}" if unit != "B" else f"{sign}{int(v)} B"
        v /= 1024
    return f"{sign}{v:.2f} TiB"


def parse_count(text: str | int | float) -> int:
    """'8e9', '7B', '125M', 70000000000 -> an integer count. Raises ValueError."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        t = text.strip().upper().replace("_", "")
        scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:], 1.0)
        try:
            value = float(t[:-1] if scale != 1.0 else t) * scale
        except ValueError:
            raise ValueError(f"expected a count like 7e9, 7B or 125M, got {_shown(text)}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{_shown(text)} is not a finite positive count")
    return int(round(value))


def _shown(value: object) -> str:
    """repr cut to a line's worth: a pasted 5,000-digit number stays a one-line error."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

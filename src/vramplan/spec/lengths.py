"""The `lengths` section: the dataset's token lengths and how batches are formed from them.

With dynamic padding (transformers' DataCollatorWithPadding, TRL's SFT collator) each
micro-batch is padded to its own longest row, so the step's activations change from step
to step and the caching allocator sees a different set of block sizes each time. The
section describes the distribution of row lengths, either as percentiles with the maximum

    lengths: {p50: 600, p90: 1500, p99: 3000, max: 4096}

or as a file of the dataset's token lengths (`lengths_file: path`, one integer per line or
a JSON list), which the CLI and `vramplan.estimate` read at the edge
(vramplan.importers.lengths) and summarise into the same percentiles; the core never opens
it. `seq_len` stays the padding cap: rows are truncated to it (tokenizer max_length).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Mapping

from vramplan.spec.enums import SpecError
from vramplan.spec.sections import positive_int

BATCHING = ("random", "sorted-longest-first", "group-by-length")
"""random: a shuffled dataset cut into micro-batches (transformers' RandomSampler);
sorted-longest-first: rows sorted by length, longest first; group-by-length: transformers'
LengthGroupedSampler (group_by_length=True: shuffled mega-batches of 50 micro-batches, each
sorted longest first, the batch holding the longest row moved to the front)."""

MAX_STEPS = 10_000
MAX_PADDED_LENGTHS = 32
"""Padded lengths one replay may build a step for: each is a full event list (~0.04 s for a
1B model, ~0.2 s for a 70B one); the default bucket (seq_len / 16) makes 16 or 17."""
MAX_ROWS = 1_000_000
"""Rows one replay draws (steps x micro_batch_size): a few seconds at the bound."""
_KEYS = ("min", "max", "lengths_file", "rows", "batching", "cap", "pad_to_multiple_of", "steps", "seed", "bucket")


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthsConfig:
    """Row lengths in tokens and the batching policy of a dynamically padded run."""

    percentiles: tuple[tuple[float, int], ...] = ()
    """(percentile in (0, 100), tokens) pairs, percentile rising, tokens non-decreasing."""
    max: int | None = None
    """The longest row, in tokens (before truncation to seq_len or `cap`)."""
    min: int | None = None
    """The shortest row; None: 1 token (the distribution falls linearly to it below the
    lowest percentile given)."""
    lengths_file: str | None = None
    """A file of the dataset's token lengths, read at the edge into the fields above."""
    rows: int | None = None
    """Rows the lengths file held (provenance; set by the edge that read it)."""
    batching: str = "random"
    """How rows become micro-batches: one of BATCHING."""
    cap: int | None = None
    """Truncate rows to this many tokens (below seq_len to buy memory)."""
    pad_to_multiple_of: int | None = None
    """DataCollatorWithPadding(pad_to_multiple_of=...): padded lengths round up to it."""
    steps: int = 100
    """Micro-batches the allocator replays, in the policy's order."""
    seed: int = 0
    """Seed of the shuffle and of the draws from the distribution (deterministic)."""
    bucket: int | None = None
    """Padded lengths round up to a multiple of this many tokens before the replay (one
    step's event list per bucket); None: seq_len / 16 rounded up to 64."""

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass)
        for name in ("max", "min", "cap", "pad_to_multiple_of", "bucket", "rows"):
            if getattr(self, name) is not None:
                set_(name, positive_int(f"lengths.{name}", getattr(self, name)))
        set_("steps", positive_int("lengths.steps", self.steps, maximum=MAX_STEPS))
        set_("seed", positive_int("lengths.seed", self.seed, minimum=0))
        if self.batching not in BATCHING:
            raise SpecError("lengths.batching", f"expected one of {', '.join(BATCHING)}, got {self.batching!r}")
        if self.lengths_file is not None and (not isinstance(self.lengths_file, str) or not self.lengths_file.strip()):
            raise SpecError("lengths.lengths_file", f"expected a file path, got {self.lengths_file!r}")
        set_("percentiles", _check_percentiles(self.percentiles, self.max))
        if self.max is None and self.lengths_file is None:
            raise SpecError("lengths.max", "required: the longest row in tokens (with percentiles such as "
                            "p50, p90, p99), or lengths_file: a file of the dataset's token lengths")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise SpecError("lengths.min", f"{self.min} is above max {self.max}")
        low = self.percentiles[0][1] if self.percentiles else None
        if self.min is not None and low is not None and self.min > low:
            raise SpecError("lengths.min", f"{self.min} is above p{_pct(self.percentiles[0][0])} {low}")

    @property
    def resolved(self) -> bool:
        """Whether the distribution is known (a lengths file has been read)."""
        return self.max is not None

    def quantiles(self) -> list[tuple[float, int]]:
        """The inverse CDF's anchors: (fraction in [0, 1], tokens), from min to max."""
        return ([(0.0, self.min or 1)] + [(p / 100, v) for p, v in self.percentiles] + [(1.0, self.max)])

    def to_dict(self) -> dict:
        out: dict[str, object] = {f"p{_pct(p)}": v for p, v in self.percentiles}
        for key in _KEYS:
            value = getattr(self, key)
            if value is not None and not (key == "steps" and value == 100) and not (key == "seed" and value == 0):
                out[key] = value
        return out


def _pct(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else repr(float(p))


def _check_percentiles(pairs, top: int | None) -> tuple[tuple[float, int], ...]:
    out, last_p, last_v = [], 0.0, 0
    for p, v in sorted(((float(p), v) for p, v in pairs), key=lambda pv: pv[0]):
        name = f"lengths.p{_pct(p)}"
        if not 0 < p < 100 or not math.isfinite(p):
            raise SpecError(name, "a percentile lies strictly between 0 and 100 (p50, p90, p99.9)")
        tokens = positive_int(name, v)
        if tokens < last_v:
            raise SpecError(name, f"{tokens} is below p{_pct(last_p)} {last_v}; percentiles do not decrease")
        if top is not None and tokens > top:
            raise SpecError(name, f"{tokens} is above max {top}")
        out.append((p, tokens))
        last_p, last_v = p, tokens
    return tuple(out)


def parse_job_lengths(value: object, seq_len: int, batch: int, packing: bool) -> LengthsConfig:
    """The section of a job: parsed, and checked against the job's packing and sizes."""
    cfg = parse_lengths(value)
    if packing:
        raise SpecError("lengths", "packing fills every row to seq_len; drop packing or the lengths section")
    check_replay_size(cfg, seq_len, batch)
    return cfg


def check_replay_size(cfg: LengthsConfig, seq_len: int, batch: int) -> None:
    """A replay that would build thousands of steps' events or draw billions of rows (a
    bucket of 1 token, a huge batch) is refused, naming the field that sets its size."""
    limit = min(seq_len, cfg.cap or seq_len)
    count = -(-limit // cfg.bucket) if cfg.bucket else 0
    if count > MAX_PADDED_LENGTHS:
        raise SpecError("lengths.bucket", f"a bucket of {cfg.bucket:,} tokens cuts {limit:,} tokens into {count:,} "
                        f"padded lengths, each replayed as its own step (at most {MAX_PADDED_LENGTHS}); use "
                        f"bucket >= {-(-limit // MAX_PADDED_LENGTHS):,}, or leave it out (seq_len / 16)")
    if batch > MAX_ROWS:
        raise SpecError("micro_batch_size", f"a micro-batch of {batch:,} rows is past what a lengths replay draws "
                        f"({MAX_ROWS:,} rows); lower micro_batch_size or drop the lengths section")
    if cfg.steps * batch > MAX_ROWS:
        raise SpecError("lengths.steps", f"{cfg.steps:,} steps of {batch:,} rows draw {cfg.steps * batch:,} rows "
                        f"(at most {MAX_ROWS:,}); use steps <= {MAX_ROWS // batch:,}")


def parse_lengths(value: object) -> LengthsConfig | None:
    """The section from a spec mapping: `pNN` keys are percentiles, the rest are fields."""
    if value is None or isinstance(value, LengthsConfig):
        return value
    if not isinstance(value, Mapping):
        raise SpecError("lengths", f"expected a mapping like {{p50: 600, p99: 3000, max: 4096}} "
                        f"or {{lengths_file: lengths.txt}}, got {value!r}")
    pairs, fields, seen = [], {}, {}
    for key, v in value.items():
        if not isinstance(key, str):
            raise SpecError(f"lengths.{key}", f"keys are field names or percentiles like p90, got {key!r}")
        if key.startswith("p") and key[1:].isascii() and key[1:].replace(".", "", 1).isdigit():  # not p٣ (float reads it)
            if float(key[1:]) in seen:  # p50 and p50.0 (or p050): one percentile, two values
                raise SpecError(f"lengths.{key}", f"{seen[float(key[1:])]} and {key} both give percentile "
                                f"{_pct(float(key[1:]))}; keep one of them")
            seen[float(key[1:])] = key
            pairs.append((float(key[1:]), v))
        elif key in _KEYS:
            fields[key] = v
        else:
            from difflib import get_close_matches
            hint = get_close_matches(key, list(_KEYS), n=1)
            raise SpecError(f"lengths.{key}", "unknown key; expected percentiles like p50, p90, p99 or one of "
                            + ", ".join(_KEYS) + (f"; did you mean {hint[0]!r}?" if hint else ""))
    if "batching" in fields:
        fields["batching"] = str(fields["batching"]).strip().lower().replace("_", "-")
    return LengthsConfig(percentiles=tuple(pairs), **fields)


__all__ = ["BATCHING", "LengthsConfig", "check_replay_size", "parse_job_lengths", "parse_lengths"]

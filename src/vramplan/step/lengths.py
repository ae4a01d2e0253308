"""Steps of dynamically padded micro-batches: their lengths, their events, their reserve.

`step_lengths` draws the rows of `lengths.steps` micro-batches from the spec's distribution
(deterministic: random.Random(lengths.seed)), truncates them to seq_len (and `cap`), orders
them by the batching policy and pads each micro-batch to its longest row as
transformers' DataCollatorWithPadding does (padding="longest", then up to
pad_to_multiple_of), then rounds up to the replay's bucket. `LengthsReplay` builds one step
of tensor events per bucket (vramplan.step.events, the same builder as the fixed-length
replay) and replays the order through one allocator (vramplan.allocator.schedule), beside
longest-first, all-longest and capped orders of the same rows.

A window of `steps` micro-batches stands for the run: over an epoch every row is seen, so
the window holds the dataset's longest row once. In random order it comes in the last
micro-batch: in a run of N steps it arrives at a uniformly random step, after the first 100
with probability 1 - 100/N, i.e. after the cache has seen the typical lengths (the "out of
memory at step 120 on one long sample" pattern). sorted-longest-first and group-by-length
put it first, as the samplers do.
With grad_accum_steps > 1 every micro-step of a replayed step has the step's length.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from typing import Callable

from vramplan.allocator.schedule import ScheduleResult, replay_schedule
from vramplan.i18n import Msg
from vramplan.spec.lengths import LengthsConfig

TOKENS_PER_BUCKET_MIN = 64
BUCKETS = 16
# transformers trainer_pt_utils.get_length_grouped_indices: mega-batches of
# min(len(lengths) // (batch_size * 4), 50) micro-batches.
MEGABATCH_MULT = 50


def bucket_width(cfg: LengthsConfig, seq_len: int) -> int:
    """Tokens per replay bucket: lengths.bucket, else seq_len / 16 rounded up to 64."""
    if cfg.bucket:
        return cfg.bucket
    step = -(-seq_len // BUCKETS)
    return -(-step // TOKENS_PER_BUCKET_MIN) * TOKENS_PER_BUCKET_MIN


def _inverse_cdf(anchors: list[tuple[float, int]], u: float) -> int:
    """Piecewise-linear inverse CDF through the (fraction, tokens) anchors."""
    for (f0, v0), (f1, v1) in zip(anchors, anchors[1:]):
        if u <= f1:
            t = 0.0 if f1 == f0 else (u - f0) / (f1 - f0)
            return max(1, round(v0 + t * (v1 - v0)))
    return anchors[-1][1]


def draw_rows(cfg: LengthsConfig, n: int) -> list[int]:
    """n row lengths from the distribution in dataset (shuffled) order, the last one the
    longest (see the module docstring); before truncation. The first n - 1 are the first
    draws of random.Random(cfg.seed), kept per distribution, so that a search over batch
    sizes (fit --maximize micro_batch_size) draws each row once, not once per probe."""
    rng, drawn = _DRAWN.pop(cfg, None) or (random.Random(cfg.seed), [])
    if len(drawn) < n - 1:
        anchors = cfg.quantiles()
        drawn.extend(_inverse_cdf(anchors, rng.random()) for _ in range(n - 1 - len(drawn)))
    if len(_DRAWN) >= 4:
        _DRAWN.pop(next(iter(_DRAWN)))
    _DRAWN[cfg] = (rng, drawn)
    return drawn[:n - 1] + [cfg.max]


_DRAWN: dict = {}
"""LengthsConfig -> (its generator, the rows drawn from it so far): the last four used."""


def padded(longest: int, multiple: int | None) -> int:
    """DataCollatorWithPadding (tokenizer.pad, padding='longest'): the batch pads to its
    longest row, rounded up to pad_to_multiple_of when given."""
    return -(-longest // multiple) * multiple if multiple else longest


def order_rows(rows: list[int], batching: str, batch: int, seed: int) -> list[int]:
    """Rows in the order the sampler yields them."""
    if batching == "sorted-longest-first":
        return sorted(rows, reverse=True)
    if batching == "group-by-length":
        # transformers trainer_pt_utils.get_length_grouped_indices: shuffled indices cut into
        # mega-batches, each sorted longest first; the mega-batch holding the longest row
        # swaps its first row with the first mega-batch's, so the first batch is the longest.
        mult = max(1, min(len(rows) // (batch * 4), MEGABATCH_MULT))
        shuffled = rows[:]
        random.Random(seed + 1).shuffle(shuffled)
        size = mult * batch
        megas = [sorted(shuffled[i:i + size], reverse=True) for i in range(0, len(shuffled), size)]
        top = max(range(len(megas)), key=lambda k: megas[k][0])
        megas[0][0], megas[top][0] = megas[top][0], megas[0][0]
        return [r for m in megas for r in m]
    return rows


def step_lengths(cfg: LengthsConfig, batch: int, seq_len: int, *, batching: str | None = None,
                 cap: int | None = None, rows: list[int] | None = None) -> list[int]:
    """The padded length of each replayed step, rounded up to the bucket width but never
    past the longest row's padded length."""
    rows = draw_rows(cfg, cfg.steps * batch) if rows is None else rows
    limit = min(x for x in (seq_len, cfg.cap, cap) if x)
    rows = [min(r, limit) for r in rows]
    ordered = order_rows(rows, batching or cfg.batching, batch, cfg.seed)
    top = padded(max(rows), cfg.pad_to_multiple_of)  # the longest step stays exact
    width = bucket_width(cfg, seq_len)
    out = []
    for i in range(0, len(ordered), batch):
        length = padded(max(ordered[i:i + batch]), cfg.pad_to_multiple_of)
        out.append(min(-(-length // width) * width, top))
    return out


@dataclass(slots=True)
class LengthsReplay:
    """The runs compared: the policy's order, longest first, every step at the longest
    length, and (when it cuts anything) the same rows capped at the 99th percentile."""

    cfg: LengthsConfig
    run: ScheduleResult
    longest_first: ScheduleResult
    all_longest: ScheduleResult
    capped: ScheduleResult | None = None
    cap_tokens: int | None = None
    bucket_tokens: int = 0
    longest_padded: int = 0
    seq_len: int = 0
    buckets: list[int] = field(default_factory=list)
    applied_bytes: int = 0
    """The part of extra_bytes the estimate's reserved_bytes took (see `applied`)."""

    @property
    def extra_bytes(self) -> int:
        """What the order of lengths adds to the reserve of a run of only its longest step:
        the term the estimate's reserved_bytes gains (allocator fragmentation across steps)."""
        return self.run.reserved_bytes - self.all_longest.reserved_bytes

    def applied(self, reserved: int, capacity: int | None, replayed: bool = False) -> int:
        """What the order adds to an estimate's `reserved` bytes: extra_bytes (or, where
        `reserved` is itself the allocator's replay of one step, what the run's replay holds
        beyond it), except that cached blocks beyond what the device holds are released when
        a request fails and the request retried (malloc: release_cached_blocks, then
        cudaMalloc again), so a run the replay found no out-of-memory in reserves at most the
        capacity."""
        extra = max(0, self.run.reserved_bytes - reserved) if replayed else self.extra_bytes
        if capacity is not None and self.run.out_of_memory_step is None:
            extra = min(extra, max(0, capacity - reserved))
        self.applied_bytes = extra
        return extra

    def summary(self) -> str:
        """One line for the text answer."""
        gib = 2**30
        run = self.run
        # Msg parts: English text the report edge can print translated (vramplan.i18n.tr)
        parts = [Msg("lengths ({batching}, {steps} steps): reserved peaks at step {step} (length {length}) at "
                     "{reserved} GiB, {extra} GiB against only {longest}-token steps; longest-first {first} GiB",
                     batching=self.cfg.batching, steps=len(run.lengths), step=run.peak_step,
                     length=run.peak_length, reserved=f"{run.reserved_bytes / gib:,.2f}",
                     extra=f"{self.extra_bytes / gib:+,.2f}", longest=self.longest_padded,
                     first=f"{self.longest_first.reserved_bytes / gib:,.2f}")]
        if self.capped is not None:
            parts.append(Msg("cap {tokens} {reserved} GiB", tokens=self.cap_tokens,
                             reserved=f"{self.capped.reserved_bytes / gib:,.2f}"))
        if run.out_of_memory_step is not None:
            parts.append(Msg("out of memory at step {step}", step=run.out_of_memory_step))
        return Msg.join("; ", parts)

    def to_dict(self) -> dict:
        def one(r: ScheduleResult) -> dict:
            return {"reserved_bytes": r.reserved_bytes, "peak_step": r.peak_step, "peak_length": r.peak_length,
                    "segments": r.segments, "out_of_memory_step": r.out_of_memory_step,
                    "alloc_retries": r.retries, "replayed_steps": r.replayed}
        out = {"distribution": self.cfg.to_dict(), "batching": self.cfg.batching, "steps": len(self.run.lengths),
               "bucket_tokens": self.bucket_tokens, "longest_padded_length": self.longest_padded,
               "peak": {"step": self.run.peak_step, "length": self.run.peak_length,
                        "reserved_bytes": self.run.reserved_bytes},
               "reserved_bytes": self.run.reserved_bytes,
               "all_longest_reserved_bytes": self.all_longest.reserved_bytes,
               "extra_over_all_longest_bytes": self.extra_bytes,
               "added_to_reserved_bytes": self.applied_bytes,
               "run": {**one(self.run), "lengths": list(self.run.lengths)},
               "longest_first": {**one(self.longest_first),
                                 "saves_bytes": self.run.reserved_bytes - self.longest_first.reserved_bytes},
               "all_longest": one(self.all_longest),
               "basis": ("the caching-allocator model replaying one step's tensor events per padded length, "
                         "allocator state carried from step to step; the estimate's reserved_bytes gains "
                         "added_to_reserved_bytes (on one GPU, up to this run's reserved_bytes; on several, "
                         "extra_over_all_longest_bytes), up to the device's capacity where the replay frees "
                         "cached blocks and retries without running out")}
        if self.capped is not None:
            out["cap"] = {"tokens": self.cap_tokens, **one(self.capped),
                          "saves_bytes": self.run.reserved_bytes - self.capped.reserved_bytes}
        return out


def replay_lengths(cfg: LengthsConfig, batch: int, seq_len: int, setup: tuple,
                   ops_for: Callable[[int], tuple], conf=None, capacity: int | None = None) -> LengthsReplay:
    """The runs of LengthsReplay through the allocator model; `ops_for(length)` gives the
    step's (handle, nbytes) ops at that padded length (memoize it: lengths repeat)."""
    run_lengths, sorted_first, capped, cap = _orders(cfg, batch, seq_len)
    top = max(run_lengths)

    def go(lengths):
        return replay_schedule(setup, ops_for, lengths, conf, capacity)
    run = go(run_lengths)
    out = LengthsReplay(cfg=cfg, run=run, longest_first=run if sorted_first == run_lengths else go(sorted_first),
                        all_longest=go([top] * len(run_lengths)), bucket_tokens=bucket_width(cfg, seq_len),
                        longest_padded=top, seq_len=seq_len, buckets=sorted(set(run_lengths)))
    if capped is not None and max(capped) < top:
        out.capped, out.cap_tokens = go(capped), cap
    return out


@functools.lru_cache(maxsize=32)
def _orders(cfg: LengthsConfig, batch: int, seq_len: int) -> tuple:
    """The steps' padded lengths in the policy's order, longest first and capped at the 99th
    percentile (with that cap): drawn once per (distribution, batch, seq_len), since a
    search (fit, compare) estimates the same rows under many layouts (~1 s per 100,000 rows)."""
    rows = draw_rows(cfg, cfg.steps * batch)
    run_lengths = tuple(step_lengths(cfg, batch, seq_len, rows=rows))
    sorted_first = tuple(step_lengths(cfg, batch, seq_len, rows=rows, batching="sorted-longest-first"))
    cap = _p99_cap(cfg, seq_len)
    capped = None if cap is None else tuple(step_lengths(cfg, batch, seq_len, rows=rows, cap=cap))
    return run_lengths, sorted_first, capped, cap


def _p99_cap(cfg: LengthsConfig, seq_len: int) -> int | None:
    """The 99th percentile (the capping users reach for: drop the longest 1% of tokens)."""
    anchors = cfg.quantiles()
    p99 = _inverse_cdf(anchors, 0.99)
    return p99 if p99 < min(cfg.max, seq_len, cfg.cap or seq_len) else None


def lengths_notes(spec, rep: LengthsReplay | None) -> list[str]:
    """What the estimate says about a `lengths` section it did not fully use."""
    if rep is None:
        return [Msg("lengths: the order of step lengths is replayed for training on the cuda backend only; "
                    "the terms are those of seq_len")]
    if rep.longest_padded < spec.seq_len:
        return [Msg("lengths: the longest row pads to {longest} tokens, below seq_len {seq_len}; "
                    "the terms are at seq_len (seq_len: {longest} gives the run's own peak)",
                    longest=rep.longest_padded, seq_len=spec.seq_len)]
    return []


# Step tensors get handles above every setup tensor's (ids restart per event list).
_STEP_HANDLES = 1 << 40


def length_ops(desc, spec, params, split: bool, extra_static=()):
    """(setup ops, ops_for(length)) of a single-model job: the setup of the step built at
    seq_len (weights, optimizer states, `extra_static` such as the cuBLAS workspaces), and
    per padded length the step's (handle, nbytes) ops, memoized. The batch is the one part
    of the setup that follows the length: each step copies its own batch in first and drops
    it last. `split`: tensors per parameter (single-GPU plans, vramplan.step.pieces)."""
    from vramplan.components.activations import plan_activations
    from vramplan.step.build import rank_step
    from vramplan.step.events import ALLOC, build_events
    from vramplan.step.pieces import tensor_pieces
    memo: dict[int, tuple] = {}

    def events(length: int):
        s = spec.with_(seq_len=length, lengths=None)
        plan = rank_step(desc, s, params, plan_activations(desc, s, params))
        for key, value in extra_static:
            plan.static.add(key, value)
        return build_events(plan, tensor_pieces(desc, params, plan) if split else None)

    def ops_for(length: int) -> tuple:
        hit = memo.get(length)
        if hit is None:
            ev = events(length)
            batch = [(t + _STEP_HANDLES, b) for _, t, b, term, _ in ev.setup if term.startswith("batch/")]
            body = [(t + _STEP_HANDLES, b if k is ALLOC else 0) for k, t, b, _, _ in ev.step]
            hit = memo[length] = tuple(batch + body + [(t, 0) for t, _ in batch])
        return hit
    base = events(spec.seq_len)
    # What the first step makes and keeps (optimizer states, cuBLAS workspaces) is set up
    # before the run here: the schedule replays steps of many lengths, not a first step.
    setup = tuple((t, b) for _, t, b, term, _ in base.setup + base.lazy if not term.startswith("batch/"))
    return setup, ops_for


__all__ = ["LengthsReplay", "length_ops", "lengths_notes", "bucket_width", "draw_rows", "order_rows", "padded", "replay_lengths", "step_lengths"]

"""Inverse solves: the largest micro-batch or sequence length that fits, the fewest GPUs.

Each relies on memory being monotone in the quantity solved for, everything else fixed:
non-decreasing in micro-batch and sequence length (every activation is a multiple of b and
of s, attention scores of s^2), non-increasing in the number of GPUs a layout shards over.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vramplan.estimation import Estimate
from vramplan.model import PositionKind
from vramplan.plan.evaluate import Evaluator, apply_changes
from vramplan.plan.space import default_axes, enumerate_candidates
from vramplan.plan.steptime import StepTime
from vramplan.spec import JobSpec, SpecError
from vramplan.spec.grpo import batch_step

MAXIMIZABLE = ("micro_batch_size", "seq_len")
_CHECKPOINT_ORDER = {"full": 0, "selective": 1, "op-selective": 1, "none": 2}


def largest_value(ev: Evaluator, spec: JobSpec, name: str, *, lo: int = 1, hi: int | None = None,
                  cap: int = 1 << 22, step: int = 1) -> int | None:
    """Largest multiple of `step` as `name` in [lo, hi] for which `spec` fits (None if the
    first one from lo does not fit). Without hi, doubles from lo until it stops fitting (at
    most `cap`). The search runs over k = value / step."""
    def fits(k: int) -> bool:
        return ev.fits(spec.with_(**{name: k * step}))

    lo, cap = -(-lo // step), max(1, cap // step)
    if hi is not None:
        hi //= step
        if hi < lo:
            return None
    if not fits(lo):
        return None
    if hi is None:
        hi = lo
        while hi < cap and fits(min(hi * 2, cap)):
            hi = min(hi * 2, cap)
        if hi >= cap:
            return cap * step
        good, bad = hi, min(hi * 2, cap)
    else:
        if fits(hi):
            return hi * step
        good, bad = lo, hi
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good * step


@dataclass(slots=True)
class Solved:
    name: str
    value: int | None
    spec: JobSpec | None
    estimate: Estimate | None
    step: StepTime | None
    layouts_tried: int
    sweep: list[tuple[int, int]] = field(default_factory=list)
    """(value, device_bytes) points of the winning layout, for plots."""

    def to_dict(self) -> dict:
        return {"maximize": self.name, "value": self.value,
                "spec": None if self.spec is None else self.spec.to_dict(),
                "estimate": None if self.estimate is None else self.estimate.to_dict(),
                "step_time_s": None if self.step is None or not self.step.modelled else self.step.total_s,
                "layouts_tried": self.layouts_tried,
                "sweep": [{"value": v, "device_bytes": b} for v, b in self.sweep]}


def _lean_first(spec: JobSpec) -> tuple:
    p = spec.parallel
    return (_CHECKPOINT_ORDER[spec.gradient_checkpointing.value], -p.zero_stage,
            p.offload_optimizer == "none", -p.tp * p.pp)


def maximize(ev: Evaluator, spec: JobSpec, name: str, *, axes: dict | None = None,
             hi: int | None = None) -> Solved:
    """The largest `name` any layout of the space fits, and the fastest layout reaching it."""
    if name not in MAXIMIZABLE:
        raise SpecError("maximize", f"choose one of {', '.join(MAXIMIZABLE)}")
    if name == "seq_len" and spec.task.value == "diffusion":  # it answered the search's cap, 2048
        raise SpecError("maximize", "a diffusion job reads no seq_len (its tokens come from height, width "
                        "and num_frames); maximize micro_batch_size")
    if name == "seq_len" and hi is None:
        limit = ev.desc.max_position_embeddings if ev.desc is not None else 0
        # a seq_len not given is the default, not a length asked for: the model's positions bound it
        hi = max(limit, spec.seq_len) if spec.seq_len_given or not limit else limit
    replay_cap = None
    if name == "micro_batch_size" and spec.lengths is not None and hi is None:
        # a lengths replay draws steps x micro_batch_size rows, at most MAX_ROWS (spec/lengths.py)
        from vramplan.spec.lengths import MAX_ROWS
        hi = replay_cap = MAX_ROWS // spec.lengths.steps
    space = default_axes(spec, ev.desc) if axes is None else axes
    layouts = sorted((c.spec for c in enumerate_candidates(spec, ev.desc, space, vary_micro_batch=False)),
                     key=_lean_first)
    best, winners = 0, []
    for layout in layouts:
        # GRPO takes micro-batches whose generation batch is whole groups: multiples of `step`
        step = batch_step(layout) if name == "micro_batch_size" else 1
        above = (best // step + 1) * step  # the least value past best this layout takes
        # Only a layout that fits at `above` can beat the best so far; one that fits at
        # best exactly ties it. Neither needs a search of its own.
        # Past hi, `above` is past the model's positions (a refusal, not a misfit).
        if best and ((hi is not None and above > hi) or not ev.fits(layout.with_(**{name: above}))):
            if best % step == 0 and ev.fits(layout.with_(**{name: best})):
                winners.append(layout.with_(**{name: best}))
            continue
        value = largest_value(ev, layout, name, lo=above, hi=hi, step=step)
        if value is None:
            continue
        if value > best:
            best, winners = value, []
        winners.append(layout.with_(**{name: value}))
    if not winners:
        return Solved(name, None, None, None, None, len(layouts))
    if best == replay_cap:  # more may fit: say where the search stopped rather than answer the cap
        raise SpecError("lengths.steps", f"micro_batch_size {best:,} still fits, and a lengths replay of "
                        f"{spec.lengths.steps:,} steps draws at most {best * spec.lengths.steps:,} rows; lower "
                        "lengths.steps to search larger micro-batches")
    # Fastest first; among equals the simpler layout (less sharding and offload).
    fastest = min(winners, key=lambda s: (ev.step_time(s, ev.estimate(s)).total_s, s.parallel.zero_stage,
                                          s.parallel.offload_optimizer != "none"))
    v = ev.verdict(fastest)
    learned = ev.desc is not None and ev.desc.position is PositionKind.LEARNED and ev.desc.max_position_embeddings
    sweep = _sweep(ev, fastest, name, best, ev.desc.max_position_embeddings if name == "seq_len" and learned else None)
    return Solved(name, best, fastest, v.estimate, v.step, len(layouts), sweep)


def _sweep(ev: Evaluator, spec: JobSpec, name: str, best: int, stop: int | None,
           points: int = 12) -> list[tuple[int, int]]:
    """Device bytes at up to `points` values to 1.5 x best; `stop`: a learned-positions model's
    last position (past it, the job is refused)."""
    top = max(2, int(best * 1.5)) if stop is None else min(max(2, int(best * 1.5)), stop)
    step = batch_step(spec) if name == "micro_batch_size" else 1  # GRPO: whole groups only
    values = sorted({max(1, round(top * i / points / step)) * step for i in range(1, points + 1)} | {best})
    return [(v, ev.estimate(spec.with_(**{name: v})).device_bytes) for v in values]


def fewest_gpus(spec: JobSpec, gpu=None, *, axes: dict | None = None, max_gpus: int = 1024,
                evaluator: Evaluator | None = None, **fit_kwargs):
    """The smallest power-of-two GPU count at which `fit` finds a layout, and that fit.
    Bisects over counts (memory per GPU does not grow with more GPUs to shard over)."""
    from vramplan.plan.fit import fit
    if isinstance(max_gpus, bool) or not isinstance(max_gpus, int) or max_gpus < 1:
        raise SpecError("max_gpus", f"expected an integer >= 1, got {max_gpus!r}")
    ev = evaluator or Evaluator.for_spec(spec, gpu, headroom_bytes=fit_kwargs.pop("headroom_bytes", 0))
    counts = [1 << i for i in range(max_gpus.bit_length()) if (1 << i) <= max_gpus]
    rows = spec.micro_batch_size * spec.grad_accum_steps * max(1, spec.num_gpus // spec.parallel.model_parallel)
    reports: dict[int, object] = {}

    def attempt(n: int):
        if n not in reports:
            s = apply_changes(spec, {"num_gpus": n, "grad_accum_steps": max(1, rows // (spec.micro_batch_size * n))})
            space = default_axes(s, ev.desc) if axes is None else axes
            reports[n] = fit(s, axes=space, evaluator=ev, top_k=1, suggest=False, **fit_kwargs)
        return reports[n]

    lo, hi = 0, len(counts) - 1
    if not attempt(counts[hi]).results:
        return None, reports[counts[hi]]
    while lo < hi:
        mid = (lo + hi) // 2
        if attempt(counts[mid]).results:
            hi = mid
        else:
            lo = mid + 1
    return counts[lo], attempt(counts[lo])

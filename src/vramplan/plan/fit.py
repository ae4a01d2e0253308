"""fit: every layout in a space that fits, ranked by estimated step time.

Exact with respect to vramplan's own estimate: a layout is returned only if its estimate
fits with the requested headroom, and the top-k are the k fastest fitting layouts of the
space (ties: larger micro-batch first, then enumeration order). These facts keep it fast
without approximating:
  1. the model is resolved once and every estimate is cached by the fields it reads;
  2. memory never falls as the micro-batch grows with everything else fixed (every
     activation, logit and input tensor is a multiple of b), so each group of layouts
     that differ only in micro-batch needs one estimate to rule it out, or a binary search
     to find its largest fitting micro-batch;
  3. weights, optimizer states and runtime buffers do not change with the activation axes
     (micro-batch, checkpointing, loss, attention, sequence), so one estimate per family of
     layouts alike in everything else gives a floor that can rule the whole family out;
  4. layouts are visited in order of a step-time lower bound known before estimating (the
     whole step-time model, or all but its communication when the estimator reports its own,
     refined, for the layouts the walk reaches, with each collective at its least volume
     over the pipeline stages), and the walk stops once k fitting layouts beat the next bound;
  5. a floor on a layout's device memory, known without estimating it (plan/floor.py: terms
     the estimate adds at events it always has), rules a group out when its smallest
     micro-batch's floor exceeds the limit, and orders the search for the closest layout
     when nothing fits.
Multi-model jobs (DPO reference, teacher, diffusion parts) are estimated by the job
estimator; their step time counts the trained model's FLOPs only.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable

from vramplan.device import reserve_is_replayed
from vramplan.estimation import Estimate
from vramplan.plan.evaluate import Evaluator, accum_of, fit_inputs, memory_key
from vramplan.plan.explain import explain
from vramplan.plan.floor import MemoryFloor
from vramplan.plan.space import Candidate, default_axes, enumerate_candidates
from vramplan.plan.steptime import StepTime
from vramplan.report.emit import paste_forms
from vramplan.spec import JobSpec

FIT_SCHEMA_VERSION = 1


@dataclass(slots=True)
class FitResult:
    spec: JobSpec
    changes: dict
    estimate: Estimate
    step: StepTime
    fits: bool
    why: list[str] = field(default_factory=list)

    @property
    def step_time_s(self) -> float | None:
        """Seconds per step; None where the step time is not modelled (StepTime.modelled)."""
        return self.step.total_s if self.step.modelled else None

    def to_dict(self) -> dict:
        return {"spec": self.spec.to_dict(), "changes": dict(self.changes),
                "estimate": self.estimate.to_dict(), "step_time_s": self.step_time_s,
                "step_time": self.step.to_dict(), "fits": self.fits, "why": list(self.why),
                "paste": paste_forms(self.spec)}


@dataclass(slots=True)
class FitReport:
    candidates_evaluated: int
    """Layouts whose outcome the search settled (all of the space unless interrupted)."""
    candidates_total: int
    estimates_computed: int
    """Calls into the estimator core; the rest were settled by facts 2-5 above."""
    elapsed_s: float
    limit_bytes: int
    results: list[FitResult]
    headroom_bytes: int = 0
    """Memory kept free below the GPU's capacity (default: vramplan.bounds.default_headroom_bytes)."""
    interrupted: bool = False
    closest: FitResult | None = None
    """When nothing fits: the layout with the smallest device memory."""
    suggestions: list = field(default_factory=list)
    candidates_checked: int = 0
    """Layouts whose memory the walk checked (through their group's estimates or a family's
    floor); the rest of those settled were ruled out by the step-time bound alone."""

    def _repr_html_(self) -> str:
        """Notebook display: the ranked layouts as an HTML table (report/answers.py)."""
        from vramplan.report.answers import fit_table
        gpu = self.results[0].estimate.gpu if self.results else None
        return fit_table(self, gpu.name if gpu is not None else "the GPU").to_html()

    def to_dict(self) -> dict:
        return {"schema_version": FIT_SCHEMA_VERSION,
                "candidates_evaluated": self.candidates_evaluated,
                "candidates_total": self.candidates_total,
                "candidates_checked": self.candidates_checked,
                "estimates_computed": self.estimates_computed,
                "elapsed_s": self.elapsed_s, "limit_bytes": self.limit_bytes,
                "headroom_bytes": self.headroom_bytes,
                "interrupted": self.interrupted,
                "results": [r.to_dict() for r in self.results],
                "closest": None if self.closest is None else self.closest.to_dict(),
                "suggestions": [s.to_dict() for s in self.suggestions]}


# Axes that change only activation-side memory (saved tensors, logits, inputs); terms under
# _STATIC_PREFIXES (weights, optimizer states, runtime buffers) do not depend on them.
_ACTIVATION_AXES = ("micro_batch_size", "grad_accum_steps", "gradient_checkpointing", "loss_impl",
                    "attention", "seq_len")
_STATIC_PREFIXES = ("weights/", "optimizer/", "master_weights/", "runtime/")


def static_floor(est: Estimate) -> int:
    """A lower bound on device_bytes for every layout that differs from `est`'s only in
    _ACTIVATION_AXES: the static terms alive in every event, plus what device_bytes adds
    on top of reserved (the CUDA context)."""
    memo: dict = {}  # events share parts (the static terms, earlier stages' activations)
    floor = min(e.subtotal(_STATIC_PREFIXES, memo) for e in est.events) if est.events else 0
    return floor + (est.device_bytes - est.reserved_bytes)


class _Groups:
    """Layouts that differ only in micro-batch; each group's largest fitting micro-batch."""

    def __init__(self, ev: Evaluator):
        self.ev = ev
        self.floor = MemoryFloor(ev.desc, ev.gpu)
        self.members: dict[tuple, list[Candidate]] = {}
        self.largest_fit: dict[tuple, int] = {}
        self.static_floor: dict[tuple, int] = {}
        self.group_floor: dict[tuple, int | None] = {}
        self.direct: dict[int, bool] = {}   # per_candidate layouts: index -> fits
        self._families: dict[tuple, tuple] = {}

    @staticmethod
    def key(c: Candidate) -> tuple:
        return (c.values, accum_of(c.grad_accum_steps, c.layout.parallel))

    @staticmethod
    def family_of(c: Candidate) -> tuple:
        """The axes' values but the activation axes'."""
        return tuple((k, v) for k, v in c.values if k not in _ACTIVATION_AXES)

    def family(self, c: Candidate) -> tuple:
        """family_of(c), kept per combination of the axes (shared by its splits)."""
        fam = self._families.get(c.values)
        if fam is None:
            fam = self._families[c.values] = self.family_of(c)
        return fam

    def add(self, c: Candidate) -> None:
        self.members.setdefault(self.key(c), []).append(c)

    @staticmethod
    def per_candidate(c: Candidate) -> bool:
        """Where the reserve is the caching allocator's replay of the step
        (device.reserve_is_replayed), a larger micro-batch can leave it lower (its blocks reuse
        the cached segments better), so no group's fit follows from its neighbours': each
        candidate is decided by its own estimate."""
        return reserve_is_replayed(c.layout)

    def fits(self, c: Candidate) -> bool:
        if self.per_candidate(c):
            if c.index not in self.direct:
                self.direct[c.index] = self._fits(c)
            return self.direct[c.index]
        key = self.key(c)
        if key not in self.largest_fit:
            ordered = sorted(self.members[key], key=lambda m: m.micro_batch_size)
            floor = self._floor(key, ordered[0])
            if floor is not None:
                # the floor rules the group out or finds it worth estimating; the family's
                # static floor (one more estimate) would only repeat what its estimates say
                self.largest_fit[key] = 0 if floor > self.ev.limit_bytes else self._resolve(ordered)
            elif self._family_too_big(c):
                self.largest_fit[key] = 0
            else:
                self.largest_fit[key] = self._resolve(ordered)
        return c.micro_batch_size <= self.largest_fit[key]

    def known(self, c: Candidate) -> bool:
        """Whether `fits(c)` is settled without another estimate."""
        if self.per_candidate(c):
            if c.index not in self.direct:
                floor = self.floor.device_floor(c.spec, self.ev.limit_bytes, c.layout)
                if floor is not None and floor > self.ev.limit_bytes:
                    self.direct[c.index] = False
            return c.index in self.direct
        key = self.key(c)
        if key in self.largest_fit:
            return True
        floor = self.static_floor.get(self.family(c))
        if floor is not None and floor > self.ev.limit_bytes:
            return True
        smallest = min(self.members[key], key=lambda m: m.micro_batch_size)
        floor = self._floor(key, smallest)
        if floor is not None and floor > self.ev.limit_bytes:
            self.largest_fit[key] = 0     # what fits() decides from the same floor
            return True
        return False

    def _floor(self, key: tuple, smallest: Candidate) -> int | None:
        """plan/floor.py's floor of the group's smallest micro-batch (kept per group): a
        lower bound on its device memory known without estimating it; by fact 2 no larger
        micro-batch of the group needs less. None where no floor is claimed."""
        if key not in self.group_floor:
            self.group_floor[key] = self.floor.device_floor(smallest.spec, self.ev.limit_bytes, smallest.layout)
        return self.group_floor[key]

    def _family_too_big(self, c: Candidate) -> bool:
        """Whether memory that no activation axis changes already exceeds the limit."""
        fam = self.family(c)
        if fam not in self.static_floor:
            self.static_floor[fam] = static_floor(self.ev.estimate(c.spec))
        return self.static_floor[fam] > self.ev.limit_bytes

    def _fits(self, c: Candidate) -> bool:
        """The estimate's verdict, unless the floor already says no (plan/floor.py)."""
        floor = self.floor.device_floor(c.spec, self.ev.limit_bytes, c.layout)
        if floor is not None and floor > self.ev.limit_bytes:
            return False
        return self.ev.fits(c.spec)

    def _resolve(self, ordered: list[Candidate]) -> int:
        """Largest fitting micro-batch of a group (0 if none): smallest first, then bisect."""
        if not self.ev.fits(ordered[0].spec):
            return 0
        lo, hi = 0, len(ordered) - 1          # ordered[lo] fits; find the last that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits(ordered[mid]):
                lo = mid
            else:
                hi = mid - 1
        return ordered[lo].micro_batch_size


def default_fit_headroom(capacity_bytes: int) -> int:
    """fit's default headroom: the layouts it returns keep the upper bound of their
    nvidia-smi estimate (catalog/bounds.json, "device") within the GPU, so none of its
    maxima count on every byte of the card."""
    from vramplan.bounds import default_headroom_bytes
    return default_headroom_bytes(capacity_bytes)


def fit(spec: JobSpec, gpu=None, *, axes: dict | None = None, top_k: int = 5,
        headroom_bytes: int | None = None, evaluator: Evaluator | None = None,
        progress: Callable[[int, int, int], None] | None = None,
        max_micro_batch: int = 256, suggest: bool = True, progress_every: int = 500,
        **ev_kwargs) -> FitReport:
    """The top-k fastest layouts of `axes` (default: `default_axes`) that fit on `gpu`; `headroom_bytes`
    None keeps the default headroom (`default_fit_headroom`), an `evaluator` brings its own."""
    start = time.perf_counter()
    spec, top_k = fit_inputs(spec, top_k)
    ev = evaluator or Evaluator.for_spec(spec, gpu, headroom_bytes=headroom_bytes or 0, **ev_kwargs)
    if evaluator is None and headroom_bytes is None:
        ev.headroom_bytes = default_fit_headroom(ev.capacity_bytes)
    calls_before = ev.calls
    reports_comm = ev.reports_communication(spec)
    space = default_axes(spec, ev.desc) if axes is None else axes
    cands = list(enumerate_candidates(spec, ev.desc, space, max_micro_batch=max_micro_batch))
    groups = _Groups(ev)
    base_key = memory_key(spec)
    heap = []
    times, layout = None, None
    for c in cands:
        groups.add(c)
        if c.layout is not layout:            # a layout's splits come one after another
            layout = c.layout
            times = ev.layout_time(layout)
        heap.append((ev.bound_at(times, c.micro_batch_size, c.grad_accum_steps, reports_comm),
                     -c.micro_batch_size, c.index, False, c))
    heapq.heapify(heap)
    total = len(heap)
    found: list[tuple[float, int, int, Candidate]] = []
    settled, checked, interrupted = 0, 0, False
    try:
        while heap:
            bound, neg_mb, index, refined, c = heapq.heappop(heap)
            if len(found) >= top_k and bound > found[top_k - 1][0]:
                settled = total               # every later bound is larger still
                break
            if reports_comm and not refined and not groups.known(c):
                # the bound with each collective at its least volume, computed only for the
                # layouts the walk reaches whose memory needs an estimate (any order of the
                # others gives the same answers); it is no less than the first, so the heap
                # still hands out layouts in order of a lower bound (the family key: this
                # search's spec and the axes no activation depends on)
                floor = ev.step_time_floor(c.spec, (base_key, groups.family(c)))
                heapq.heappush(heap, (floor, neg_mb, index, True, c))
                continue
            settled += 1
            if progress and settled % progress_every == 0:
                progress(settled, total, len(found))
            checked += 1
            if not groups.fits(c):
                continue
            true = ev.step_time(c.spec, ev.estimate(c.spec)).total_s if reports_comm else bound
            found.append((true, neg_mb, index, c))
            found.sort(key=lambda t: t[:3])
        else:
            settled = total
    except KeyboardInterrupt:
        interrupted = True
    if progress and not interrupted:  # the last count: the bound can settle the rest at once
        progress(settled, total, len(found))
    results = [_result(ev, c, True) for _, _, _, c in found[:top_k]]
    explain(results, ev)
    report = FitReport(candidates_evaluated=settled, candidates_total=total,
                       estimates_computed=ev.calls - calls_before,
                       elapsed_s=0.0, limit_bytes=ev.limit_bytes, results=results,
                       headroom_bytes=ev.headroom_bytes,
                       interrupted=interrupted, candidates_checked=checked)
    if not results and not interrupted:
        report.closest = _closest(ev, cands, groups.floor)
        if suggest:
            from vramplan.plan.suggest import suggestions
            report.suggestions = suggestions(ev, spec)
    report.estimates_computed = ev.calls - calls_before
    report.elapsed_s = time.perf_counter() - start
    return report


def _result(ev: Evaluator, c: Candidate, fits: bool) -> FitResult:
    v = ev.verdict(c.spec)
    return FitResult(spec=c.spec, changes=c.change_dict, estimate=v.estimate, step=v.step, fits=v.fits)


_LEAN = {"full": 0, "selective": 1, "op-selective": 1, "none": 2, "fused-linear-cross-entropy": 0, "chunked": 1,
         "standard": 2, "flash": 0, "sdpa": 1, "eager": 2}


def _lean_key(c: Candidate) -> tuple:
    s = c.layout                              # the candidate's spec but for the batch split
    return (_LEAN[s.gradient_checkpointing.value], _LEAN[s.loss_impl.value], _LEAN[s.attention.value],
            c.micro_batch_size, c.index)


def _closest(ev: Evaluator, cands: list[Candidate], floor: MemoryFloor | None = None) -> FitResult | None:
    """When nothing fits: the layout needing the least device memory, taken per family
    (layouts alike but for activation axes) at its leanest activation settings. With a
    `floor` (plan/floor.py), families are estimated in order of their floor until the
    next floor exceeds the least memory found: no family left can reach it (ties go to the
    earlier family, as min() over them all would)."""
    leanest: dict[tuple, Candidate] = {}
    for c in cands:
        fam = _Groups.family_of(c)
        if fam not in leanest or _lean_key(c) < _lean_key(leanest[fam]):
            leanest[fam] = c
    order = list(leanest.values())
    if not order:
        return None
    floors = [(floor.device_floor(c.spec, layout=c.layout) if floor is not None else None) or 0 for c in order]
    best: tuple[int, int] | None = None
    for i in sorted(range(len(order)), key=lambda i: floors[i]):
        if best is not None and floors[i] > best[0]:
            break
        d = ev.estimate(order[i].spec).device_bytes
        if best is None or (d, i) < best:
            best = (d, i)
    return _result(ev, order[best[1]], False)

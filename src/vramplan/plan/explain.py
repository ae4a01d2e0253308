"""Why `fit` ranks its layouts as it does: one line per reason for each result (spare memory,
where the step's time goes, and what the next layout loses), in the answers' language."""
from __future__ import annotations

from vramplan.i18n import Msg
from vramplan.plan.evaluate import Evaluator
from vramplan.plan.steptime import StepTime
from vramplan.units import GiB


def _top_terms(step: StepTime, n: int = 2) -> str:
    total = step.total_s or 1.0
    parts = sorted(step.terms.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v / total:.0%}" for k, v in parts)


def explain(results: list, ev: Evaluator) -> None:
    """One line per reason: spare memory, where the time goes, and what it beats."""
    if results and not results[0].step.modelled:
        _explain_untimed(results, ev)
        return
    for i, r in enumerate(results):
        r.why.append(_spare(r, ev))
        r.why.append(Msg("{seconds:.3f} s/step ({terms})", seconds=r.step_time_s, terms=_top_terms(r.step)))
        if i + 1 < len(results):
            nxt = results[i + 1]
            r.why.append(Msg("faster than #{rank} by {pct}: {gap}", rank=i + 2,
                             pct=_pct(nxt.step_time_s, r.step_time_s), gap=_largest_gap(r.step, nxt.step)))
        if i == 0:
            r.why.insert(0, Msg("fastest layout that fits"))


def _explain_untimed(results: list, ev: Evaluator) -> None:
    """Without a step-time model every layout ties on time: they keep the search space's
    order (no sharding before ZeRO stages, no offload before offload, the larger
    micro-batch first), and no line claims one is faster."""
    for i, r in enumerate(results):
        r.why.append(_spare(r, ev))
        if i == 0:
            r.why.insert(0, Msg("first layout of the search space that fits"))
            r.why.append(Msg("step time not modelled for this model (no FLOPs model for diffusion or video "
                             "pipelines): layouts in the search space's order, not ranked by speed"))


def _spare(r, ev: Evaluator) -> Msg:
    spare = (ev.limit_bytes - r.estimate.device_bytes) / GiB
    if ev.headroom_bytes:
        return Msg("fits with {gib:.2f} GiB to spare after keeping {kept:.2f} GiB free", gib=spare,
                   kept=ev.headroom_bytes / GiB)
    return Msg("fits with {gib:.2f} GiB to spare", gib=spare)


def _pct(slow: float, fast: float) -> str:
    return "0%" if slow <= 0 else f"{(slow - fast) / slow:.1%}"


def _largest_gap(a: StepTime, b: StepTime) -> str:
    keys = set(a.terms) | set(b.terms)
    if not keys:
        return Msg("same step time")
    key = max(keys, key=lambda k: b.terms.get(k, 0.0) - a.terms.get(k, 0.0))
    gap = b.terms.get(key, 0.0) - a.terms.get(key, 0.0)
    if gap <= 0:
        return Msg("same step time; larger micro-batch or earlier in the space")
    return Msg("{term} {seconds:.3f} s less", term=key, seconds=gap)

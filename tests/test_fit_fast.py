"""fit's fast path gives the plain estimator's answers.

fit settles layouts through memoized terms (components/memo.py: per-parameter sums, the
saved activations shared by layouts alike but for their layout), the parallel layer's
memoized sets, its evaluator's cache, the static floor of each family of layouts and the
bisection of each group's micro-batch. Ground truth: `vramplan.estimate` of each sampled
layout from cold (every memo cleared first)."""
from __future__ import annotations

import pytest

from vramplan import estimate
from vramplan.components import memo
from vramplan.plan import Evaluator, fit
from vramplan.plan.fit import default_fit_headroom
from vramplan.plan.space import default_axes, enumerate_candidates
from vramplan.spec import load_spec

JOBS = {
    # the default-axes search: ZeRO stage x offload x checkpointing x TP x PP x micro-batch
    "8b-8gpu-default-axes": ({"model": "llama-3.1-8b", "gpu": "a100-40gb", "num_gpus": 8, "micro_batch_size": 4,
                              "grad_accum_steps": 4, "seq_len": 4096}, None),
    # LoRA on one GPU with activation axes: the activation memo misses, the static terms hit
    "0.5b-lora-1gpu": ({"model": "qwen2.5-0.5b", "gpu": "rtx-4090", "method": "lora", "micro_batch_size": 16,
                        "grad_accum_steps": 2, "seq_len": 2048},
                       {"gradient_checkpointing": ("none", "selective", "full"),
                        "loss_impl": ("standard", "chunked"), "optimizer": ("adamw", "adamw-8bit")}),
}


def numbers(est) -> dict:
    return {"device": est.device_bytes, "reserved": est.reserved_bytes, "peak": est.peak_allocated_bytes,
            "event": est.peak_event, "phases": dict(est.phases), "components": est.components.to_dict(),
            "timeline": [(e.phase, e.label, e.total) for e in est.events]}


@pytest.mark.parametrize("name", JOBS)
def test_fit_matches_cold_estimates(name):
    job, axes = JOBS[name]
    spec = load_spec(job)
    ev = Evaluator.for_spec(spec)
    ev.headroom_bytes = default_fit_headroom(ev.capacity_bytes)
    report = fit(spec, evaluator=ev, axes=axes, top_k=10**6, suggest=False)  # every fitting layout
    fitting = {tuple(r.changes.items()): r for r in report.results}
    cands = list(enumerate_candidates(spec, ev.desc, axes or default_axes(spec, ev.desc)))
    assert report.candidates_total == len(cands) and report.candidates_evaluated == len(cands)
    assert fitting and len(fitting) < len(cands)  # the sample sees both verdicts
    fits_sample = [c for c in cands if c.changes in fitting][::max(1, len(fitting) // 8)]
    sample = cands[::max(1, len(cands) // 16)] + fits_sample
    for c in sample:
        fast = numbers(ev.estimate(c.spec))
        memo.clear()
        truth = estimate(c.spec)
        assert fast == numbers(truth), c.changes
        assert (truth.device_bytes <= report.limit_bytes) == (c.changes in fitting), c.changes
        if c.changes in fitting:
            assert numbers(fitting[c.changes].estimate) == numbers(truth)

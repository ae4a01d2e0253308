"""fit's pruned search returns what the full search returns.

The full search estimates every layout of the space, keeps those whose device memory fits
under the limit and ranks them by step time with the estimate's own communication (ties:
larger micro-batch, then enumeration order). fit settles most layouts without estimating
them (the static floor of a family, the micro-batch bisection of a group, the step-time
lower bounds, refined with each collective at its least volume over the pipeline stages); its top-k
must be the full search's top-k, layout for layout, with the same step times."""
from __future__ import annotations

import pytest

from vramplan.plan import Evaluator, fit
from vramplan.plan.fit import default_fit_headroom
from vramplan.plan.space import default_axes, enumerate_candidates
from vramplan.spec import load_spec

JOBS = {
    # the default axes: ZeRO stage x offload x checkpointing x TP x PP x micro-batch
    "8b-8gpu-default-axes": ({"model": "llama-3.1-8b", "gpu": "a100-40gb", "num_gpus": 8, "micro_batch_size": 4,
                              "grad_accum_steps": 4, "seq_len": 4096}, None, 5),
    # a small model on 4 GPUs: many layouts fit, the comm floor decides where the walk stops
    "0.5b-4gpu-parallel-axes": ({"model": "qwen2.5-0.5b", "gpu": "rtx-4090", "num_gpus": 4, "micro_batch_size": 8,
                                 "grad_accum_steps": 2, "seq_len": 2048},
                                {"parallel.zero_stage": (0, 1, 2, 3), "parallel.offload_optimizer": ("none", "cpu"),
                                 "gradient_checkpointing": ("none", "full"), "parallel.tp": (1, 2),
                                 "parallel.pp": (1, 2, 4), "loss_impl": ("standard", "chunked")}, 10),
    # pipelines only, GPipe and 1F1B alike in the walk: uneven stages make the floor bind
    "1.5b-8gpu-pipelines": ({"model": "qwen2.5-1.5b", "gpu": "a100-40gb", "num_gpus": 8, "micro_batch_size": 8,
                             "grad_accum_steps": 8, "seq_len": 2048},
                            {"parallel.pp": (1, 2, 4, 8), "parallel.tp": (1, 2), "parallel.zero_stage": (0, 1),
                             "optimizer": ("adamw", "adamw-8bit")}, 7),
    # LoRA on one GPU: no communication; activation axes only
    "0.5b-lora-1gpu": ({"model": "qwen2.5-0.5b", "gpu": "rtx-4090", "method": "lora", "micro_batch_size": 16,
                        "grad_accum_steps": 2, "seq_len": 2048},
                       {"gradient_checkpointing": ("none", "selective", "full"),
                        "loss_impl": ("standard", "chunked"), "optimizer": ("adamw", "adamw-8bit")}, 4),
    # nothing fits: both searches return nothing
    "8b-4xrtx4090-nothing-fits": ({"model": "llama-3.1-8b", "gpu": "rtx-4090", "num_gpus": 4,
                                   "micro_batch_size": 4, "grad_accum_steps": 4, "seq_len": 4096},
                                  {"parallel.zero_stage": (0, 1, 2, 3), "parallel.tp": (1, 2, 4),
                                   "parallel.pp": (1, 2, 4), "gradient_checkpointing": ("none", "full")}, 5),
}


def full_search(spec, axes, top_k: int) -> list[tuple]:
    """Every layout estimated (an evaluator of its own, so nothing fit settled is reused)."""
    ev = Evaluator.for_spec(spec)
    ev.headroom_bytes = default_fit_headroom(ev.capacity_bytes)
    rows = []
    for c in enumerate_candidates(spec, ev.desc, axes or default_axes(spec, ev.desc)):
        est = ev.estimate(c.spec)
        true = ev.step_time(c.spec, est).total_s
        # what fit walks by are lower bounds, layout by layout, the refined one the larger
        cheap = ev.step_time_bound(c.spec, reports_comm=est.parallel is not None)
        refined = ev.step_time_floor(c.spec) if est.parallel is not None else cheap
        assert cheap <= refined <= true, c.changes
        if est.device_bytes <= ev.limit_bytes:
            rows.append((true, -c.spec.micro_batch_size, c.index, c, est))
    rows.sort(key=lambda r: r[:3])
    return [(dict(c.changes), t, est.device_bytes) for t, _, _, c, est in rows[:top_k]]


@pytest.mark.parametrize("name", JOBS)
def test_fit_returns_the_full_search(name):
    job, axes, top_k = JOBS[name]
    spec = load_spec(job)
    report = fit(spec, axes=axes, top_k=top_k, suggest=False)
    fast = [(r.changes, r.step_time_s, r.estimate.device_bytes) for r in report.results]
    assert fast == full_search(spec, axes, top_k)
    assert report.estimates_computed < report.candidates_total  # the search did prune

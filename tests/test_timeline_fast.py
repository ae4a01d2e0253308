"""The estimate's fast paths give what the plain definitions give: each event's total is the
total of its merged live set, peak_total is the largest event of the walk, a merge copied in
C is the merge term by term, and the allocator reserve read from the events' parts is the one
read from their merged live sets."""
from __future__ import annotations

import pytest

from vramplan import load_spec
from vramplan.breakdown import Breakdown
from vramplan.components.activations import plan_activations
from vramplan.components.trainable import param_set
from vramplan.device import _group, reserved_bytes
from vramplan.estimation import model_spec
from vramplan.sources import resolve_model
from vramplan.step.build import rank_step
from vramplan.timeline import peak_event, peak_total, walk

BASE = {"model": "qwen2.5-0.5b", "gpu": "a100-80gb", "micro_batch_size": 2, "seq_len": 512}
JOBS = {
    "one GPU": {},
    "accumulation, checkpointing": {"grad_accum_steps": 4, "gradient_checkpointing": "full"},
    "LoRA": {"method": "lora"},
    "optimizer in backward": {"optimizer_in_backward": True},
    "ZeRO-2 (a second backward moment)": {"model": "llama-3.1-8b", "num_gpus": 8, "parallel": {"zero_stage": 2}},
    "ZeRO-3, TP 2": {"num_gpus": 8, "parallel": {"zero_stage": 3, "tp": 2}},
    "pipeline 1F1B, accumulation": {"num_gpus": 4, "grad_accum_steps": 8, "parallel": {"pp": 4}},
    "FSDP, CPU offload": {"num_gpus": 8, "parallel": {"fsdp": "full-shard", "offload_params": "cpu"}},
    "keep_logits": {"keep_logits": True},
}


def _plan(job: dict):
    spec = load_spec({**BASE, **job})
    desc = resolve_model(spec)
    spec = model_spec(desc, spec)
    params = param_set(desc, spec)
    return rank_step(desc, spec, params, plan_activations(desc, spec, params))


@pytest.mark.parametrize("job", list(JOBS.values()), ids=list(JOBS))
def test_event_totals_and_peak_total_match_the_merged_events(job):
    plan = _plan(job)
    events = walk(plan)
    assert [e.total for e in events] == [e.live.total() for e in events]
    assert peak_total(plan) == max(e.total for e in events)


@pytest.mark.parametrize("job", list(JOBS.values()), ids=list(JOBS))
def test_reserve_from_parts_matches_the_merged_live_sets(job):
    events = walk(_plan(job))
    top = peak_event(events)
    ends = [e for e in events if e.label.startswith(("end of forward", "loss backward"))]
    largest = max((v for e in ends for v in _group(e.live, "logits")), default=0)
    churn = max(sum(_group(e.live, "activations")) + sum(_group(e.live, "backward"))
                for e in [top, *(e for e in ends if e.label.startswith("loss backward"))])
    from vramplan.components.runtime import reserved_from_allocated
    assert reserved_bytes(events, top) == reserved_from_allocated(top.live.total(), largest, churn)


def _merged_by_adding(terms: dict, into: dict, times: int) -> dict:
    out = Breakdown(dict(into))
    for name, value in terms.items():
        out.add(name, int(value) * times)
    return out.terms


@pytest.mark.parametrize("terms", [{"a/x": 3, "b/y": 5}, {"a/x": 0, "b/y": 2}, {"a/x": 2.0, "b": 1}, {}, {"a": True}])
@pytest.mark.parametrize("into", [{}, {"b/y": 1, "c": 4}])
@pytest.mark.parametrize("times", [1, 3])
def test_merge_is_adding_each_term(terms, into, times):
    got = Breakdown(dict(into)).merge(Breakdown(dict(terms)), times=times).terms
    want = _merged_by_adding(terms, into, times)
    assert got == want and list(got) == list(want)
    assert all(type(v) is int for v in got.values())

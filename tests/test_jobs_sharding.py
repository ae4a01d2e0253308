"""Multi-model jobs under data-parallel sharding: per-rank terms shrink as the engine says."""
import pytest

import vramplan
from vramplan.spec import SpecError


def est(**kw):
    base = {"model": "llama-3.2-1b", "task": "dpo", "micro_batch_size": 1, "seq_len": 512}
    base.update(kw)
    return vramplan.estimate(vramplan.load_spec(base))


def test_zero_stages_shard_states_then_grads_then_weights():
    single = est()
    ends = {z: est(num_gpus=4, parallel={"zero_stage": z}) for z in (1, 2, 3)}
    opt = lambda e: [x for x in e.events if x.phase == "optimizer"][0].live  # noqa: E731
    assert opt(ends[1]).total("policy/optimizer") * 4 == pytest.approx(opt(single).total("policy/optimizer"), rel=1e-6)
    assert opt(ends[1]).total("policy/gradients") == opt(single).total("policy/gradients")
    assert opt(ends[2]).total("policy/gradients") * 4 == pytest.approx(opt(single).total("policy/gradients"), rel=1e-6)
    assert opt(ends[3]).total("reference/weights") * 4 == pytest.approx(opt(single).total("reference/weights"), rel=1e-6)
    peaks = [single.peak_allocated_bytes] + [ends[z].peak_allocated_bytes for z in (1, 2, 3)]
    assert peaks == sorted(peaks, reverse=True)


def test_model_parallel_multi_model_is_a_clear_error():
    with pytest.raises(SpecError, match="parallel"):
        est(num_gpus=4, parallel={"tp": 2})

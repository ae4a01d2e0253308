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
    # ZeRO-1 makes whole gradients in backward but keeps only its partition at the step
    # (DeepSpeed stage_1_and_2.py epilogue; bench/parallel/results-deepspeed-cpu.json)
    bwd = lambda e: max(x.live.total("policy/gradients") for x in e.events if x.phase == "backward")  # noqa: E731
    assert bwd(ends[1]) == bwd(single)
    assert opt(ends[1]).total("policy/gradients") == opt(ends[2]).total("policy/gradients")
    assert opt(ends[2]).total("policy/gradients") * 4 == pytest.approx(opt(single).total("policy/gradients"), rel=1e-6)
    assert opt(ends[3]).total("reference/weights") * 4 == pytest.approx(opt(single).total("reference/weights"), rel=1e-6)
    peaks = [single.peak_allocated_bytes] + [ends[z].peak_allocated_bytes for z in (1, 2, 3)]
    assert peaks == sorted(peaks, reverse=True)


def _terms(e, word):
    return {k: v for ev in e.events for k, v in ev.live if word in k}


def test_sft_and_dpo_gather_the_same_zero3_parameters():
    """One mechanism (parallel.engines.zero3_live through rank_plan) for every trained role."""
    kw = {"model": "llama-3.1-8b", "seq_len": 1024, "num_gpus": 8, "parallel": {"zero_stage": 3}}
    sft = vramplan.estimate(vramplan.load_spec(kw))
    dpo = vramplan.estimate(vramplan.load_spec({**kw, "task": "dpo"}))
    assert sft.components.total("zero/gathered_params") > 0
    assert max(_terms(dpo, "policy/zero/gathered_params").values()) == max(_terms(sft, "zero/gathered_params").values())
    # the frozen reference gathers its own layers during its forward, not through the step
    ref_fwd = next(ev for ev in dpo.events if ev.label.startswith("reference"))
    assert ref_fwd.live.total("engine/gathered_layer") > 0


def test_dpo_with_tensor_parallelism_cuts_both_models():
    one = est()
    tp = est(num_gpus=2, parallel={"tp": 2})
    for role in ("policy/weights", "reference/weights"):
        assert tp.components.total(role) < 0.51 * one.components.total(role)
    assert tp.parallel is not None and tp.parallel.layout.tp == 2
    assert tp.peak_allocated_bytes < one.peak_allocated_bytes


def test_diffusion_under_zero3_compare_and_fit_run():
    from vramplan.plan.compare import compare
    spec = vramplan.load_spec({"model": "cogvideox-2b", "task": "diffusion", "num_gpus": 8,
                               "parallel": {"zero_stage": 3}})
    z3 = vramplan.estimate(spec)
    single = vramplan.estimate(vramplan.load_spec({"model": "cogvideox-2b", "task": "diffusion"}))
    assert 0 < z3.peak_allocated_bytes < single.peak_allocated_bytes
    assert z3.components.total("engine/gathered_layer") > 0
    from vramplan.catalog import find_gpu
    from vramplan.plan.fit import fit
    base = vramplan.load_spec({"model": "cogvideox-2b", "task": "diffusion"})
    rows = compare(base, find_gpu("a100-80gb"))
    zero3 = [r for r in rows if r.estimate is not None and r.spec.parallel.zero_stage == 3]
    assert zero3 and all(r.estimate.peak_allocated_bytes > 0 for r in zero3)
    eight = vramplan.load_spec({"model": "cogvideox-2b", "task": "diffusion", "num_gpus": 8})
    report = fit(eight, find_gpu("a100-40gb"), axes={"parallel.zero_stage": (2, 3)}, top_k=2)
    assert report.results and all(r.fits for r in report.results)


def test_diffusion_model_parallel_is_a_clear_error():
    with pytest.raises(SpecError, match="parallel"):
        vramplan.load_spec({"model": "cogvideox-2b", "task": "diffusion", "num_gpus": 2, "parallel": {"tp": 2}})

"""plan: fit against exhaustive enumeration, inverse solves, compare, tiers."""
from __future__ import annotations

import pytest

from vramplan.catalog import find_gpu
from vramplan.estimation import estimate_model
from vramplan.plan import Evaluator, compare, fit, gpu_tiers, maximize
from vramplan.plan.compare import Strategy
from vramplan.plan.solve import fewest_gpus, largest_value
from vramplan.plan.space import enumerate_candidates
from vramplan.sources import resolve_model
from vramplan.spec import load_spec
from vramplan.units import GiB

SMALL_AXES = {"gradient_checkpointing": ("none", "full"),
              "parallel.zero_stage": (0, 2),
              "parallel.offload_optimizer": ("none", "cpu"),
              "optimizer": ("adamw", "adamw-8bit")}


@pytest.fixture(scope="module")
def job():
    return load_spec({"model": "qwen2.5-0.5b", "gpu": "rtx-4090", "num_gpus": 2,
                      "micro_batch_size": 4, "grad_accum_steps": 4, "seq_len": 2048})


@pytest.fixture(scope="module")
def ev(job):
    return Evaluator(resolve_model(job), find_gpu("rtx-4090"))


def brute_force(spec, desc, gpu, axes, limit, top_k, mfu=0.4):
    """Every candidate estimated by the core directly: the ground truth for fit."""
    fresh = Evaluator(desc, gpu, mfu=mfu)
    rows = []
    for c in enumerate_candidates(spec, desc, axes):
        est = estimate_model(desc, c.spec, gpu)
        if est.device_bytes <= limit:
            # The same step time fit reports: with the estimator's communication if it has one.
            rows.append((fresh.step_time(c.spec, est).total_s, -c.spec.micro_batch_size, c.index, c))
    rows.sort(key=lambda r: r[:3])
    return [r[3].change_dict for r in rows[:top_k]], len(rows)


PIPE_AXES = {"gradient_checkpointing": ("none", "full"), "parallel.pp": (1, 2),
             "loss_impl": ("standard", "chunked"), "method": ("full", "lora"),
             "precision": ("bf16", "mixed-bf16")}


def test_fit_matches_exhaustive_enumeration_with_pipelines_and_pruned_families(job):
    # qwen2.5-3b in full mixed precision holds ~42 GB of weights and states: that whole
    # family is ruled out by its static floor; LoRA layouts fit.
    gpu = find_gpu("rtx-4090")
    spec = job.with_(model="qwen2.5-3b", seq_len=1024)
    desc = resolve_model(spec)
    report = fit(spec, gpu, axes=PIPE_AXES, top_k=8)
    # fit keeps its default headroom (the upper bound of the nvidia-smi estimate on the card):
    # the exhaustive search takes the same limit
    expected, n_fit = brute_force(spec, desc, gpu, PIPE_AXES, report.limit_bytes, 8)
    assert n_fit > 8
    assert [r.changes for r in report.results] == expected


ONE_GPU_AXES = {"gradient_checkpointing": ("none", "full"), "loss_impl": ("standard", "chunked"),
                "optimizer": ("adamw", "adamw-8bit")}


def test_fit_on_one_gpu_matches_exhaustive_enumeration(job):
    # one GPU: the reserve is the caching allocator's replay, which need not grow with the
    # micro-batch, so fit decides each layout by its own estimate (plan/fit.py per_candidate)
    gpu = find_gpu("rtx-4090")
    one = job.with_(num_gpus=1, seq_len=1024)
    report = fit(one, gpu, axes=ONE_GPU_AXES, top_k=6, headroom_bytes=0)
    expected, n_fit = brute_force(one, resolve_model(one), gpu, ONE_GPU_AXES, report.limit_bytes, 6)
    assert n_fit > 6
    assert [r.changes for r in report.results] == expected
    assert all(r.estimate.parallel is None for r in report.results)


@pytest.mark.parametrize("headroom_gib", [0, 6])
def test_fit_top_k_matches_exhaustive_enumeration(job, headroom_gib):
    gpu = find_gpu("rtx-4090")
    desc = resolve_model(job)
    report = fit(job, gpu, axes=SMALL_AXES, top_k=6, headroom_bytes=headroom_gib * GiB)
    expected, n_fit = brute_force(job, desc, gpu, SMALL_AXES, gpu.memory_bytes - headroom_gib * GiB, 6)
    assert n_fit > 6, "the space must hold more fitting layouts than k for the test to mean anything"
    assert [r.changes for r in report.results] == expected
    for r in report.results:
        assert r.fits and r.estimate.device_bytes + headroom_gib * GiB <= gpu.memory_bytes
    assert report.candidates_evaluated == report.candidates_total
    assert report.estimates_computed < report.candidates_total   # pruning did something


def test_fit_ranks_by_step_time_and_explains(job):
    report = fit(job, axes=SMALL_AXES, top_k=4)
    times = [r.step_time_s for r in report.results]
    assert times == sorted(times)
    assert report.results[0].why[0] == "fastest layout that fits"
    assert all(len(r.why) >= 2 for r in report.results)


def test_fit_nothing_fits_reports_closest_and_working_suggestions():
    spec = load_spec({"model": "qwen2.5-7b", "gpu": "rtx-4090", "micro_batch_size": 2, "seq_len": 2048})
    report = fit(spec, axes={"gradient_checkpointing": ("none", "full")})
    assert report.results == []
    assert report.closest is not None and report.closest.estimate.device_bytes > report.limit_bytes
    assert report.suggestions, "a 7B job must fit somewhere: QLoRA or a bigger GPU"
    for s in report.suggestions:
        gpu = find_gpu(s.gpu) if s.gpu else find_gpu("rtx-4090")
        assert s.estimate.device_bytes <= gpu.memory_bytes


def test_fit_interrupt_returns_best_so_far(job):
    calls = []

    def progress(done, total, found):
        calls.append(done)
        raise KeyboardInterrupt

    axes = dict(SMALL_AXES, **{"gradient_checkpointing": ("none", "selective", "full"),
                               "loss_impl": ("standard", "chunked")})
    report = fit(job, axes=axes, top_k=50, progress=progress, progress_every=20)
    assert calls and report.interrupted
    assert report.candidates_evaluated < report.candidates_total
    assert all(r.fits for r in report.results)


def test_memory_is_monotone_in_micro_batch_and_seq_len(job, ev):
    # fit's pruning and the inverse solves rely on this.
    for ckpt in ("none", "full"):
        spec = job.with_(gradient_checkpointing=ckpt)
        mb = [ev.estimate(spec.with_(micro_batch_size=b)).device_bytes for b in (1, 2, 3, 4, 8)]
        seq = [ev.estimate(spec.with_(seq_len=s)).device_bytes for s in (128, 500, 1024, 4096)]
        assert mb == sorted(mb) and seq == sorted(seq)


def test_largest_value_is_the_boundary(job, ev):
    spec = job.with_(gradient_checkpointing="full")
    best = largest_value(ev, spec, "micro_batch_size")
    assert best is not None and best >= 1
    assert ev.fits(spec.with_(micro_batch_size=best))
    assert not ev.fits(spec.with_(micro_batch_size=best + 1))


def test_maximize_seq_len_beats_every_layout(job, ev):
    axes = {"gradient_checkpointing": ("none", "full"), "parallel.zero_stage": (0, 3)}
    solved = maximize(ev, job, "seq_len", axes=axes)
    assert solved.value and ev.fits(solved.spec)
    for c in enumerate_candidates(job, ev.desc, axes, vary_micro_batch=False):
        assert not ev.fits(c.spec.with_(seq_len=solved.value + 1))
    assert solved.sweep and any(b > ev.limit_bytes for _, b in solved.sweep)


def test_fewest_gpus_is_the_smallest_count_that_fits():
    spec = load_spec({"model": "qwen2.5-1.5b", "gpu": "a10g", "micro_batch_size": 1, "seq_len": 1024})
    axes = {"gradient_checkpointing": ("none", "full")}
    n, report = fewest_gpus(spec, axes=axes, max_gpus=8)
    assert n is not None and report.results
    if n > 1:
        smaller = fit(spec.with_(num_gpus=n // 2), axes=axes, suggest=False)
        assert smaller.results == []


def test_compare_rows_against_baseline(job, ev):
    rows = compare(job, evaluator=ev)
    base = rows[0]
    assert base.strategy.name == "baseline" and base.saving_bytes == 0
    ckpt = next(r for r in rows if r.strategy.name == "checkpointing")
    assert ckpt.saving_bytes == base.estimate.device_bytes - ckpt.estimate.device_bytes > 0
    assert ckpt.relative_step_time > 1.0          # recompute costs time
    lora = next(r for r in rows if r.strategy.name == "lora")
    assert lora.relative_step_time < 1.0          # no weight gradients for the frozen base


def test_compare_user_strategy_and_inapplicable_row(job, ev):
    cpu = job.with_(backend="cpu", gpu=None)
    # AWQ's default gemm kernel is CUDA-only (spec/sections.py check_cpu_quant); bitsandbytes runs on CPU
    rows = compare(cpu, evaluator=ev, strategies=[Strategy.parse("qlora method=qlora,quantization.type=awq"),
                                                   Strategy.parse("short seq_len=256,micro_batch_size=1")])
    assert [r.strategy.name for r in rows] == ["baseline", "qlora", "short"]
    assert rows[1].estimate is None and "not applicable" in rows[1].note
    assert rows[2].spec.seq_len == 256 and rows[2].saving_bytes > 0


def test_gpu_tiers_are_consistent_with_capacity():
    spec = load_spec({"model": "qwen2.5-1.5b", "micro_batch_size": 1, "seq_len": 1024})
    rows = gpu_tiers(spec, gpus=[find_gpu(n) for n in ("h100-80gb", "a100-40gb", "rtx-4090", "t4")])
    by = {r.gpu: r for r in rows}
    assert by["h100-80gb"].tier == "80 GB and up" and by["t4"].tier == "under 24 GB"
    assert by["rtx-4090"].tier == "24-40 GB"
    for r in rows:
        if r.best is not None:
            assert r.best.estimate.device_bytes <= r.memory_bytes
    # More memory never holds less: once a smaller card fits, every larger one does.
    fits = [r.best is not None for r in sorted(rows, key=lambda r: r.memory_bytes)]
    assert fits == sorted(fits)
    assert by["h100-80gb"].best.strategy.name == "baseline"

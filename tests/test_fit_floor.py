"""plan/floor.py's memory floor never exceeds the estimate it stands in for.

fit rules a group of layouts out when this floor of its smallest micro-batch exceeds the
GPU's limit, without estimating it; that is exact only if floor <= device_bytes of the
estimate for every layout. Ground truth: the estimator (vramplan.estimation.estimate_model)
of each layout, over models, ZeRO stages 0-3, FSDP, TP/PP/CP, offload, LoRA/QLoRA,
precisions, optimizers, checkpointing, loss implementations and micro-batches."""
from __future__ import annotations

import itertools

import pytest

from vramplan.plan import Evaluator
from vramplan.plan.floor import MemoryFloor
from vramplan.plan.space import enumerate_candidates
from vramplan.spec import SpecError, load_spec

JOBS = {
    "8b-8gpu-zero-tp-pp": ({"model": "llama-3.1-8b", "gpu": "a100-40gb", "num_gpus": 8, "micro_batch_size": 2,
                            "grad_accum_steps": 4, "seq_len": 2048},
                           {"parallel.zero_stage": (0, 1, 2, 3), "parallel.offload_optimizer": ("none", "cpu"),
                            "parallel.tp": (1, 2, 4), "parallel.pp": (1, 2, 4),
                            "gradient_checkpointing": ("none", "full")}),
    "1.5b-4gpu-fsdp-cp-precision": ({"model": "qwen2.5-1.5b", "gpu": "a100-80gb", "num_gpus": 4,
                                     "micro_batch_size": 2, "grad_accum_steps": 2, "seq_len": 4096},
                                    {"parallel.fsdp": ("none", "full-shard", "shard-grad-op"),
                                     "parallel.cp": (1, 2), "precision": ("bf16", "mixed-bf16"),
                                     "optimizer": ("adamw", "adamw-8bit", "adafactor"),
                                     "loss_impl": ("standard", "chunked")}),
    "0.5b-1gpu-lora-qlora": ({"model": "qwen2.5-0.5b", "gpu": "rtx-4090", "micro_batch_size": 8,
                              "grad_accum_steps": 1, "seq_len": 1024},
                             {"method": ("full", "lora", "qlora"), "precision": ("bf16", "mixed-bf16"),
                              "gradient_checkpointing": ("none", "selective", "full"),
                              "optimizer": ("adamw", "adamw-8bit")}),
    # tied embeddings and logit softcapping, on 4 GPUs with ZeRO, TP and PP
    "gemma2-2b-4gpu": ({"model": "gemma-2-2b", "gpu": "rtx-4090", "num_gpus": 4, "micro_batch_size": 4,
                        "grad_accum_steps": 2, "seq_len": 2048},
                       {"parallel.zero_stage": (0, 1, 3), "parallel.tp": (1, 2), "parallel.pp": (1, 2),
                        "gradient_checkpointing": ("none", "selective"), "precision": ("bf16", "amp-bf16")}),
    # a mixture of experts, ZeRO-3 and parameter offload, sequence-sharded context parallelism
    "mixtral-8gpu": ({"model": "mixtral-8x7b", "gpu": "h100", "num_gpus": 8, "micro_batch_size": 1,
                      "grad_accum_steps": 8, "seq_len": 4096},
                     {"parallel.zero_stage": (2, 3), "parallel.offload_params": ("none", "cpu"),
                      "parallel.tp": (1, 2), "parallel.cp": (1, 2), "gradient_checkpointing": ("none", "full")}),
    # a state-space model and GPT-2 (learned positions), keep_logits and packing
    "mamba2-2gpu": ({"model": "mamba2-2.7b", "gpu": "a100-40gb", "num_gpus": 2, "micro_batch_size": 2,
                     "grad_accum_steps": 2, "seq_len": 2048, "keep_logits": True},
                    {"parallel.fsdp": ("none", "full-shard"), "gradient_checkpointing": ("none", "full"),
                     "optimizer": ("adamw", "adafactor")}),
    "gpt2-1gpu-packing": ({"model": "gpt2", "gpu": "rtx-4090", "micro_batch_size": 8, "grad_accum_steps": 1,
                           "seq_len": 1024, "packing": True},
                          {"method": ("full", "lora"), "attention": ("sdpa", "flash"),
                           "loss_impl": ("standard", "chunked", "fused-linear-cross-entropy")}),
    # the cpu backend: the device level is the live peak, no allocator reserve
    "0.5b-cpu": ({"model": "qwen2.5-0.5b", "gpu": "rtx-4090", "backend": "cpu", "micro_batch_size": 4,
                  "grad_accum_steps": 2, "seq_len": 512},
                 {"gradient_checkpointing": ("none", "full"), "method": ("full", "lora"),
                  "precision": ("fp32", "bf16")}),
}


@pytest.mark.parametrize("name", JOBS)
def test_floor_at_most_the_estimate(name):
    job, axes = JOBS[name]
    spec = load_spec(job)
    ev = Evaluator.for_spec(spec)
    floor = MemoryFloor(ev.desc, ev.gpu)
    cands = list(enumerate_candidates(spec, ev.desc, axes, max_micro_batch=8))
    claimed = tried = 0
    for c in itertools.islice(cands, 0, None, max(1, len(cands) // 150)):
        try:
            est = ev.estimate(c.spec)
        except SpecError:
            continue                     # a refused layout: fit never counts it as fitting
        tried += 1
        f = floor.device_floor(c.spec)
        if f is None:
            continue
        claimed += 1
        assert 0 < f <= est.device_bytes, (c.change_dict, f, est.device_bytes)
        # the same floor from the layout's kept model spec, layout and parameter set
        assert floor.device_floor(c.spec, layout=c.layout) == f, c.change_dict
        # with `above`, the weaker floors (without the states, from the micro-batch-1 plan)
        for above in (0, est.device_bytes // 2, f - 1):
            weak = floor.device_floor(c.spec, above=above)
            assert weak is not None and 0 < weak <= f, (c.change_dict, above, weak, f)
    assert claimed >= 0.8 * tried          # the floor is claimed on most layouts it is tried on


NOTHING_FITS = ({"model": "llama-3.1-8b", "gpu": "rtx-4090", "num_gpus": 4, "micro_batch_size": 4,
                 "grad_accum_steps": 4, "seq_len": 4096},
                {"parallel.zero_stage": (0, 1, 2, 3), "parallel.tp": (1, 2, 4), "parallel.pp": (1, 2, 4),
                 "gradient_checkpointing": ("none", "full")})


def test_fit_with_the_floor_answers_as_without_it(monkeypatch):
    """The floor only saves estimates: fit's layouts, and where nothing fits the closest
    layout, are those of fit with no floor claimed (every group and family estimated)."""
    from vramplan.plan import fit

    def answers(report):
        closest = report.closest and (report.closest.changes, report.closest.estimate.device_bytes)
        return [(r.changes, r.step_time_s, r.estimate.device_bytes) for r in report.results], closest

    job, axes = NOTHING_FITS
    spec = load_spec(job)
    with_floor = fit(spec, axes=axes, top_k=5, suggest=False)
    monkeypatch.setattr(MemoryFloor, "device_floor", lambda self, spec, above=None, layout=None: None)
    without = fit(spec, axes=axes, top_k=5, suggest=False)
    assert with_floor.closest is not None and answers(with_floor) == answers(without)
    assert with_floor.estimates_computed < without.estimates_computed


# Engines and options the searches above do not vary: pipeline schedules, frameworks,
# parameter offload, FSDP versions, paged and fused-in-backward optimizers, other tasks.
VARIANT_BASE = {"model": "qwen2.5-1.5b", "gpu": "a100-80gb", "num_gpus": 8, "micro_batch_size": 2,
                "grad_accum_steps": 8, "seq_len": 2048}
VARIANTS = [
    {"parallel": {"pp": 4, "pp_schedule": "gpipe"}},
    {"parallel": {"pp": 4, "pp_schedule": "interleaved"}},
    {"parallel": {"pp": 2, "tp": 2, "sp": True}},
    {"parallel": {"pp": 2}, "stack": {"framework": "deepspeed"}},
    {"parallel": {"pp": 2, "tp": 2}, "stack": {"framework": "megatron"}},
    {"parallel": {"zero_stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu"}},
    {"parallel": {"fsdp": "full-shard", "fsdp_version": 2, "tp": 2}},
    {"parallel": {"fsdp": "full-shard", "fsdp_version": 1}},
    {"parallel": {"fsdp": "shard-grad-op", "offload_params": "cpu"}},
    {"parallel": {"zero_stage": 2}, "optimizer": "paged-adamw-8bit"},
    {"parallel": {"zero_stage": 1}, "optimizer_in_backward": True, "grad_accum_steps": 1},
    {"task": "sequence-classification", "num_labels": 3, "parallel": {"zero_stage": 2}},
    {"method": "qlora", "parallel": {"zero_stage": 3}},
    {"keep_logits": True, "parallel": {"tp": 2}},
    {"precision": "amp-bf16", "parallel": {"zero_stage": 2, "tp": 2}},
    {"model": "llama-3.2-1b", "parallel": {"pp": 2, "zero_stage": 1}, "loss_impl": "fused-linear-cross-entropy"},
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}" for k in v))
def test_floor_at_most_the_estimate_across_engines(variant):
    for mb, ckpt in itertools.product((1, 4), ("none", "full")):
        spec = load_spec(dict(VARIANT_BASE, **variant, micro_batch_size=mb, gradient_checkpointing=ckpt))
        ev = Evaluator.for_spec(spec)
        f = MemoryFloor(ev.desc, ev.gpu).device_floor(spec)
        assert f is not None and 0 < f <= ev.estimate(spec).device_bytes, (variant, mb, ckpt)

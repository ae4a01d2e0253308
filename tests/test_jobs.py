"""Multi-model jobs: spec fields, estimates against exact CPU measurements, mechanisms."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import vramplan
from vramplan.spec import SpecError

TINY = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "tie_word_embeddings": False}
# The full-logits head (TRL 0.x get_batch_logps): what vramplan.measure.jobs' hand-written steps
# compute; TRL 1.x's chunked head is checked against the real trainers in test_trainers.py.
BASE = {"model": TINY, "micro_batch_size": 2, "seq_len": 64, "optimizer": "adamw",
        "optimizer_impl": "foreach", "attention": "sdpa", "backend": "cpu", "logprob_head": "full"}
RESULTS = Path(__file__).resolve().parents[1] / "bench" / "jobs" / "results.json"


def as_measured(job: dict) -> dict:
    """These steps were measured by bench/jobs (measure/jobs.py, measure/vlm.py), which build
    the model in the precision's dtype and run it without autocast: pure 16-bit. Under the
    default stack (HF Trainer) the word `bf16` now means autocast over the load dtype, so
    the committed job is read with the word for what ran."""
    if job.get("precision") in ("bf16", "fp16"):
        return {**job, "precision": "pure-" + job["precision"]}
    return job


def est(**fields):
    return vramplan.estimate({**BASE, **fields})


def test_spec_fields_validate_against_task():
    with pytest.raises(SpecError, match="teacher"):
        vramplan.load_spec({**BASE, "task": "sft", "teacher": TINY})
    with pytest.raises(SpecError, match="teacher"):
        vramplan.load_spec({**BASE, "task": "distill"})
    with pytest.raises(SpecError, match="num_generations"):
        vramplan.load_spec({**BASE, "task": "dpo", "num_generations": 4})
    spec = vramplan.load_spec({**BASE, "task": "dpo", "reference_model": "PRECOMPUTED"})
    assert spec.reference_model == "precomputed"
    assert vramplan.load_spec(spec.to_dict()) == spec


def test_dpo_breakdown_has_a_section_per_model_and_peaks_in_the_reference_forward():
    e = est(task="dpo", precision="bf16")
    groups = e.components.groups(1)
    assert groups["policy"] > 0 and groups["reference"] > 0
    assert e.peak_event.startswith("reference forward")
    # the reference's weights equal the policy's (same architecture, frozen, bf16)
    assert e.components.terms["reference/weights/frozen"] == e.components.terms["policy/weights/trainable"]


def test_precomputed_reference_and_lora_policy_hold_no_reference_weights():
    full, pre = est(task="dpo", precision="bf16"), est(task="dpo", precision="bf16", reference_model="precomputed")
    assert not any(k.startswith("reference/") for k in pre.components.terms)
    assert pre.peak_allocated_bytes < full.peak_allocated_bytes
    lora = est(task="dpo", precision="bf16", method="lora")
    assert not any(k.startswith("reference/weights") for k, _ in lora.events[1].live)
    assert any("adapter disabled" in n for n in lora.notes)


def test_chosen_and_rejected_double_the_policy_rows():
    dpo, sft = est(task="dpo", precision="fp32", reference_model="precomputed"), est(task="sft", precision="fp32")
    v, s, b = TINY["vocab_size"], BASE["seq_len"], BASE["micro_batch_size"]
    assert dpo.components.total("policy/logits/log_softmax") == 2 * b * (s - 1) * v * 4 or \
        max(e.live.total("policy/logits/log_softmax") for e in dpo.events) == 2 * b * (s - 1) * v * 4
    assert dpo.peak_allocated_bytes > sft.peak_allocated_bytes


def test_distill_peaks_in_the_loss_with_both_logits():
    e = est(task="distill", precision="bf16", teacher=dict(TINY, num_hidden_layers=3))
    assert e.peak_event.startswith("distillation loss")
    assert e.components.total("teacher/logits") > 0 and e.components.total("student/logits") > 0


def test_distill_rejects_a_teacher_with_another_vocabulary():
    with pytest.raises(ValueError, match="vocabulary"):
        est(task="distill", teacher=dict(TINY, vocab_size=4096))


def test_grpo_generation_kv_cache_by_hand():
    e = est(task="grpo", precision="bf16", max_new_tokens=256, num_generations=2, seq_len=16)
    gen = next(ev for ev in e.events if ev.phase == "generation")
    # 2 (K, V) x layers x rows x kv_heads x (prompt + completion - 1) x head_dim x 2 bytes:
    # the last sampled token is never fed back through the model
    assert gen.live.terms["policy/generation/kv_cache"] == 2 * 2 * 2 * 2 * 271 * 16 * 2
    assert "generation" in e.phases


def test_vllm_engine_reserves_its_fraction_of_the_gpu():
    spec = {**BASE, "backend": "cuda", "task": "grpo", "max_new_tokens": 32, "gpu": "h100-80gb", "num_generations": 2,
            "generation": {"engine": "vllm", "gpu_memory_utilization": 0.5}}
    e = vramplan.estimate(spec)
    assert e.components.terms["generation/vllm_engine"] == e.gpu.memory_bytes // 2


def test_ppo_trains_actor_and_critic():
    e = est(task="ppo", precision="bf16", max_new_tokens=16, seq_len=16)
    opt = next(ev for ev in e.events if ev.phase == "optimizer")
    assert opt.live.total("actor/gradients") > 0 and opt.live.total("critic/gradients") > 0


@pytest.mark.parametrize("name", ["dpo/bf16/full/ref-same", "dpo/fp32/full/ref-same",
                                  "dpo/bf16/lora/adapter-disabled", "dpo/bf16/full/ref-precomputed",
                                  "distill/bf16/full/teacher-6l",
                                  "reward-model/bf16/full", "reward-model/fp32/full/b4",
                                  "grpo/bf16/full/g4-c128", "grpo/fp32/full/g4-c32",
                                  "grpo/bf16/lora/adapter-disabled", "grpo/bf16/full/gc/b4",
                                  "ppo/fp32/full/c32", "ppo/bf16/full/c64"])
def test_estimates_match_committed_cpu_measurements(name):
    row = json.loads(RESULTS.read_text())[name]
    measured = row["measured"]["peak_allocated_bytes"]
    estimated = vramplan.estimate(as_measured(row["job"])).peak_allocated_bytes
    assert abs(estimated / measured - 1) < 0.02, (estimated, measured)


def test_tiny_dpo_and_distill_measured_live():
    pytest.importorskip("torch")
    from vramplan.measure.jobs import measure_job
    for fields in ({"task": "dpo", "precision": "bf16"},
                   {"task": "distill", "precision": "bf16", "teacher": dict(TINY, num_hidden_layers=3)}):
        job = {**BASE, **fields}
        m = measure_job(job)
        e = vramplan.estimate(job)
        assert abs(e.peak_allocated_bytes / m.peak_allocated_bytes - 1) < 0.05, (fields, e.peak_allocated_bytes, m)


def test_tiny_grpo_with_generation_measured_live_per_phase():
    pytest.importorskip("torch")
    from vramplan.measure.rl import measure_grpo
    job = {**BASE, "task": "grpo", "precision": "fp32", "micro_batch_size": 4, "seq_len": 16,
           "num_generations": 2, "max_new_tokens": 16}
    m, e = measure_grpo(job), vramplan.estimate(job)
    assert abs(e.peak_allocated_bytes / m.peak_allocated_bytes - 1) < 0.02, (e.peak_allocated_bytes, m)
    for phase in ("generation", "forward", "backward", "optimizer"):
        assert abs(e.phases[phase] / m.phases[phase] - 1) < 0.02, (phase, e.phases, m.phases)


def test_pipeline_catalog_token_counts_from_frames_resolution_vae_and_patches():
    from vramplan.catalog.pipelines import denoiser_tokens, find_pipeline, find_vlm, image_tokens, latent_shape
    cog = find_pipeline("THUDM/CogVideoX-5b")
    # 49 frames -> 13 latent frames (causal VAE), 480x720 / 8 / patch 2 -> 30 x 45 patches
    assert latent_shape(cog, 2, 480, 720, 49) == (2, 16, 13, 60, 90)
    assert denoiser_tokens(cog, 480, 720, 49) == {"image": 13 * 30 * 45, "text": 226, "context": 0}
    assert denoiser_tokens(find_pipeline("flux.1-dev"), 1024, 1024, 1) == {"image": 4096, "text": 512, "context": 0}
    assert denoiser_tokens(find_pipeline("stable-diffusion-3-medium"), 1024, 1024, 1)["text"] == 77 + 256
    assert denoiser_tokens(find_pipeline("stable-diffusion-v1-5"), 512, 512, 1) == {"image": 4096, "text": 0, "context": 0}
    assert image_tokens(find_vlm("llava-1.5-7b"), 336) == 576
    assert image_tokens(find_vlm("qwen2-vl-7b"), 448) == 256


def test_tiny_ppo_measured_live():
    """TRL PPOTrainer's update (measure/ppo.py): rollout with output_scores, reference, value
    and reward forwards under no_grad, then the PolicyAndValueWrapper forward/backward/step."""
    pytest.importorskip("torch")
    from vramplan.measure.ppo import measure_ppo
    job = {**BASE, "task": "ppo", "precision": "fp32", "micro_batch_size": 4, "seq_len": 16,
           "max_new_tokens": 16, "reward_model": TINY}
    m, e = measure_ppo(job), vramplan.estimate(job)
    assert m.params_bytes == e.components.total("actor/weights") + e.components.total("critic/weights")
    assert abs(e.peak_allocated_bytes / m.peak_allocated_bytes - 1) < 0.01, (e.peak_allocated_bytes, m)
    for phase in ("generation", "forward", "backward", "optimizer"):
        assert abs(e.phases[phase] / m.phases[phase] - 1) < 0.01, (phase, e.phases, m.phases)


def test_grpo_under_zero3_gathers_the_whole_policy_for_generation():
    # TRL's unwrap_model_for_generation wraps generate in GatheredParameters(model.parameters()):
    # each rank holds every full 16-bit weight beside its partition, unless the switch is off
    job = {"model": "qwen2.5-0.5b", "task": "grpo", "precision": "bf16", "micro_batch_size": 2, "seq_len": 128,
           "max_new_tokens": 64, "num_generations": 2, "num_gpus": 4, "parallel": {"zero_stage": 3}}
    e = vramplan.estimate(job)
    one = vramplan.estimate({**job, "num_gpus": 1, "parallel": {"zero_stage": 0}})
    gen = max((ev for ev in e.events if ev.phase == "generation"), key=lambda ev: ev.live.total())
    full = one.components.total("policy/weights/")
    held = gen.live.total("policy/weights/") + gen.live.total("policy/generation/zero3_gathered_weights")
    assert held == full
    off = vramplan.estimate({**job, "generation": {"ds3_gather_for_generation": False}})
    assert off.phases["generation"] == e.phases["generation"] - (full - gen.live.total("policy/weights/"))
    with pytest.raises(vramplan.SpecError, match="generation.ds3_gather_for_generation"):
        vramplan.load_spec({**job, "generation": {"ds3_gather_for_generation": "no"}})

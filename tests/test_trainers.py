"""The real TRL trainers under the exact CPU meter, and the chunked log-prob head's terms."""
from __future__ import annotations

import pytest
from conftest import measure_fresh

import vramplan
from vramplan.jobs.logprob import TOKEN_CHUNK, VOCAB_CHUNK, chunked_head, resolve_head
from vramplan.spec import LogprobHead

TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "tie_word_embeddings": False}
BASE = {"model": TINY, "micro_batch_size": 2, "seq_len": 32, "optimizer": "adamw",
        "optimizer_impl": "foreach", "attention": "sdpa", "backend": "cpu"}


def test_auto_head_is_trl_1_16s_per_task():
    spec = lambda **kw: vramplan.load_spec({**BASE, **kw})  # noqa: E731
    assert resolve_head(spec(task="dpo")) is LogprobHead.CHUNKED
    assert resolve_head(spec(task="kto")) is LogprobHead.CHUNKED
    # trl/experimental/orpo, cpo: full logits scored by selective_log_softmax (get_batch_logps)
    assert resolve_head(spec(task="orpo")) is LogprobHead.SELECTIVE
    assert resolve_head(spec(task="simpo")) is LogprobHead.SELECTIVE
    assert resolve_head(spec(task="dpo", logprob_head="full")) is LogprobHead.FULL


def test_chunked_head_terms_by_hand():
    # 4 rows x 31 shifted tokens, vocab 512 (one tile), bf16 on CPU: the scratch buffer is
    # always 32768 columns wide; backward holds 7 fp32 tiles and one bool tile.
    spec = vramplan.load_spec({**BASE, "task": "dpo", "precision": "bf16"})
    head = chunked_head(spec, 4, 32, 64, 512)
    n = 4 * 31
    assert head.scratch() == min(n, TOKEN_CHUNK) * VOCAB_CHUNK * 2
    bwd = head.backward_fold(head_trainable=True)
    assert bwd.terms["logprob/tile_fp32_temporaries"] == 7 * n * 512 * 4
    assert bwd.terms["logprob/grad_weight_fp32"] == 512 * 64 * 4
    assert head.forward_fold().terms["logprob/tile_fp32_temporaries"] == 3 * n * 512 * 4
    cuda = chunked_head(spec.with_(backend="cuda"), 4, 32, 64, 512)
    assert "logprob/tile_fp32_temporaries" not in cuda.backward_fold(True).terms  # Triton: in registers
    # softcapping: backward keeps tanh's t as well (8 tiles); the forward transform frees each
    # tile as it rebinds z, so its fold stays at 3 (measured: sft/bf16/full/sft-trainer/gemma2)
    capped = chunked_head(spec, 4, 32, 64, 512, softcap=True)
    assert capped.backward_fold(True).terms["logprob/tile_fp32_temporaries"] == 8 * n * 512 * 4
    assert capped.forward_fold().terms["logprob/tile_fp32_temporaries"] == 3 * n * 512 * 4


def test_chunked_dpo_never_holds_full_logits():
    e = vramplan.estimate({**BASE, "task": "dpo", "precision": "bf16", "seq_len": 256})
    assert not any("log_softmax" in k for ev in e.events for k in ev.live.terms)
    full = vramplan.estimate({**BASE, "task": "dpo", "precision": "bf16", "seq_len": 256, "logprob_head": "full"})
    assert any("log_softmax" in k for ev in full.events for k in ev.live.terms)


def test_trl_dpo_trainer_measured_live_within_tolerance():
    pytest.importorskip("trl")
    job = {**BASE, "task": "dpo", "precision": "bf16"}
    m = measure_fresh(job)
    assert m["runner"]["library"] == "trl" and m["runner"]["entry"] == "DPOTrainer"
    e = vramplan.estimate(job)
    assert abs(e.peak_allocated_bytes / m["peak_allocated_bytes"] - 1) < 0.02, (e.peak_allocated_bytes, m)
    for phase in ("forward", "backward", "optimizer"):
        assert abs(e.phases[phase] / m["phases"][phase] - 1) < 0.05, (phase, e.phases, m["phases"])


def test_sft_head_follows_the_stack_and_trl_release():
    spec = lambda **kw: vramplan.load_spec({**BASE, "task": "sft", **kw})  # noqa: E731
    assert resolve_head(spec(stack="trl")) is LogprobHead.CHUNKED  # SFTTrainer's fused_lm_head
    assert resolve_head(spec(stack="hf-trainer")) is LogprobHead.FULL  # the model's own loss
    assert resolve_head(spec()) is LogprobHead.FULL
    assert resolve_head(spec(stack={"framework": "trl", "trl": "1.9"})) is LogprobHead.FULL


@pytest.mark.parametrize("method", ["full", "lora"])
def test_trl_sft_trainer_measured_live_within_tolerance(method):
    pytest.importorskip("trl")
    job = {**BASE, "task": "sft", "stack": "trl", "precision": "bf16", "method": method}
    if method == "lora":
        job["lora"] = {"r": 8, "target_modules": ["q_proj", "v_proj"]}
    m = measure_fresh(job)
    assert m["runner"]["library"] == "trl" and m["runner"]["entry"] == "SFTTrainer"
    e = vramplan.estimate(job)
    assert abs(e.peak_allocated_bytes / m["peak_allocated_bytes"] - 1) < 0.02, (e.peak_allocated_bytes, m)
    for phase in ("forward", "backward", "optimizer"):
        assert abs(e.phases[phase] / m["phases"][phase] - 1) < 0.05, (phase, e.phases, m["phases"])
    # the model's own cross-entropy (the HF Trainer's SFT) is not what SFTTrainer runs
    full = vramplan.estimate({**job, "logprob_head": "full"})
    assert abs(full.peak_allocated_bytes / m["peak_allocated_bytes"] - 1) > 0.2


def test_selective_head_saves_each_rows_16bit_log_softmax():
    # selective_log_softmax on bf16 logits: a row loop of log_softmax, each output saved in bf16
    e = vramplan.estimate({**BASE, "task": "dpo", "precision": "bf16", "logprob_head": "selective"})
    rows, s, v = 2 * BASE["micro_batch_size"], BASE["seq_len"], TINY["vocab_size"]
    saved = max(ev.live.total("policy/logits/log_softmax") for ev in e.events)
    assert saved == rows * (s - 1) * v * 2

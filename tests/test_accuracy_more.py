"""GPT-NeoX, BLOOM, OPT and Falcon estimates against real training steps under the exact CPU meter.

Each case runs two real steps of a tiny random-init transformers model under
vramplan.measure (CPU, exact live-tensor bytes) and checks the estimate of the same spec:
the peak within 2% and every phase within 5% (the accuracy targets of the benchmark).
BLOOM has no SDPA path in transformers (BloomAttention is its own eager code), so its jobs
say `attention: eager`, which is what loading it without an attn_implementation gives.
"""
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import vramplan  # noqa: E402
from vramplan.measure import measure  # noqa: E402

TINY = {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
NEOX = {"model_type": "gpt_neox", **TINY, "intermediate_size": 256}
OPT = {"model_type": "opt", **TINY, "ffn_dim": 256, "max_position_embeddings": 128}

CASES = {
    "gpt_neox-fp32-sdpa-parallel-residual": {"model": NEOX},
    "gpt_neox-sequential-full-rotary-dropout-eager": {
        "model": NEOX | {"use_parallel_residual": False, "rotary_pct": 1.0, "hidden_dropout": 0.1},
        "attention": "eager"},
    "gpt_neox-bf16-gc": {"model": NEOX, "precision": "bf16", "gradient_checkpointing": "full"},
    "gpt_neox-lora-qkv": {"model": NEOX, "method": "lora", "lora": {"r": 4, "target_modules": ["query_key_value"]}},
    "bloom-tied": {"model": {"model_type": "bloom", **TINY}, "attention": "eager"},
    # no attention named: transformers runs BLOOM eager (its _supports_sdpa is False), and so do
    # the estimate and the measure harness (catalog/attention_support.json)
    "bloom-default-attention": {"model": {"model_type": "bloom", **TINY}},
    "bloom-bf16-dropout": {"model": {"model_type": "bloom", **TINY, "hidden_dropout": 0.1,
                                     "attention_dropout": 0.1}, "precision": "bf16", "attention": "eager"},
    "falcon-7b-shape-multi-query": {"model": {"model_type": "falcon", **TINY}},
    "falcon-7b-shape-bf16": {"model": {"model_type": "falcon", **TINY}, "precision": "bf16"},
    "falcon-40b-shape-new-arch": {"model": {"model_type": "falcon", **TINY, "new_decoder_architecture": True,
                                            "num_kv_heads": 2}},
    "falcon-sequential-mha-bias-dropout": {"model": {"model_type": "falcon", **TINY, "multi_query": False,
                                                     "parallel_attn": False, "bias": True, "hidden_dropout": 0.1}},
    "opt-fp32-sdpa-dropout": {"model": OPT},
    "opt-350m-shape-post-norm-proj": {"model": OPT | {"word_embed_proj_dim": 32, "do_layer_norm_before": False}},
    "opt-bf16-eager": {"model": OPT, "precision": "bf16", "attention": "eager"},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_estimate_matches_measured_cpu_step(name):
    job = {"backend": "cpu", "precision": "fp32", "micro_batch_size": 2, "seq_len": 64,
           "optimizer_impl": "foreach", **CASES[name]}
    measured = measure(job, device="cpu").to_dict()
    est = vramplan.estimate(vramplan.load_spec(job))
    assert est.peak_allocated_bytes == pytest.approx(measured["peak_allocated_bytes"], rel=0.02)
    for phase in ("forward", "backward", "optimizer"):
        assert est.phases[phase] == pytest.approx(measured["phases"][phase], rel=0.05), phase

"""Whole estimates against real training steps measured by the exact CPU meter.

Each case runs two real steps of a small random-init transformers model under
vramplan.measure (CPU, exact live-tensor bytes) and checks the estimate of the same spec:
the peak within 2% and every phase within 5% (the accuracy targets of the benchmark).
"""
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import vramplan  # noqa: E402
from vramplan.measure import measure  # noqa: E402


def tiny(model_type="llama", **kw):
    cfg = {"model_type": model_type, "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 160,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "tie_word_embeddings": False}
    cfg.update(kw)
    return cfg


CASES = {
    "llama-fp32-full-sdpa": {"model": tiny()},
    "llama-bf16-gc": {"model": tiny(), "precision": "bf16", "gradient_checkpointing": "full"},
    "llama-amp-lora": {"model": tiny(), "precision": "amp-bf16", "method": "lora",
                       "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}},
    "llama-eager-sgd": {"model": tiny(), "attention": "eager", "optimizer": "sgd", "momentum": 0.9},
    "qwen2-bf16-lora-all-linear-dropout": {"model": tiny("qwen2", tie_word_embeddings=True), "precision": "bf16",
                                           "method": "lora",
                                           "lora": {"r": 8, "dropout": 0.1, "target_modules": "all-linear"}},
    "gpt2-fp32-dropout": {"model": {"model_type": "gpt2", "vocab_size": 1000, "n_embd": 64, "n_layer": 2,
                                    "n_head": 4}},
    "llama-freeze-last-layer": {"model": tiny(num_hidden_layers=3), "method": "freeze",
                                "freeze": {"trainable_layers": [-1]}},
    "llama-bf16-lora-gc-input-leaf": {"model": tiny(), "precision": "bf16", "method": "lora",
                                      "gradient_checkpointing": "full",
                                      "lora": {"r": 4, "target_modules": "all-linear"}},
    "llama-amp-gc-autocast-cache": {"model": tiny(), "precision": "amp-bf16", "gradient_checkpointing": "full"},
    "llama-grad-accum": {"model": tiny(), "grad_accum_steps": 2, "optimizer_impl": "fused"},
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

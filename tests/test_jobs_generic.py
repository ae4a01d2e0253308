"""The generic `models` list: a section per model, methods, precisions and placements."""
from __future__ import annotations

import vramplan

TINY = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "tie_word_embeddings": False}
BASE = {"model": TINY, "micro_batch_size": 2, "seq_len": 64, "optimizer": "adamw", "optimizer_impl": "foreach",
        "attention": "sdpa", "backend": "cpu", "precision": "bf16"}


def est(*models):
    return vramplan.estimate({**BASE, "models": list(models)})


def test_frozen_model_on_this_gpu_is_its_own_section():
    sft, e = vramplan.estimate(BASE), est({"role": "judge", "model": TINY})
    assert e.components.groups(1)["policy"] == sft.peak_allocated_bytes
    assert e.components.terms["judge/weights/frozen"] == vramplan.estimate(BASE).components.terms["weights/trainable"]
    assert any(ev.label == "judge forward (no_grad)" for ev in e.events)


def test_placements_cpu_and_other_gpu():
    sft = vramplan.estimate(BASE)
    cpu = est({"role": "judge", "model": TINY, "placement": "cpu"})
    other = est({"role": "judge", "model": TINY, "placement": "other-gpu"})
    assert other.peak_allocated_bytes == sft.peak_allocated_bytes
    judge = next(ev for ev in cpu.events if ev.label.startswith("judge"))
    assert "judge/weights/frozen" in judge.live.terms
    assert not any("judge/" in k for k in cpu.events[-1].live.terms)  # gone by the optimizer step


def test_trained_roles_add_gradients_and_optimizer_state_in_their_precision():
    full = est({"role": "critic", "model": TINY, "method": "full"})
    lora = est({"role": "critic", "model": TINY, "method": "lora", "precision": "fp32"})
    opt = full.events[-1].live
    assert opt.total("critic/optimizer") > 0 and opt.total("critic/weights/trainable") > 0
    assert lora.events[-1].live.total("critic/weights/lora_adapters") > 0
    assert lora.events[-1].live.terms["critic/weights/frozen"] == full.events[-1].live.terms["critic/weights/trainable"] * 2


def test_frozen_role_on_this_device_measured_live_per_phase():
    """measure/generic.py: the trained model's causal-LM step plus a frozen judge's no_grad
    forward (its own, wider architecture) after the trained forward, under the exact meter."""
    import pytest
    pytest.importorskip("torch")
    from vramplan.measure.generic import measure_generic
    judge = dict(TINY, num_hidden_layers=3, hidden_size=96, intermediate_size=256, num_key_value_heads=4)
    for precision in ("bf16", "fp32"):
        job = {**BASE, "precision": precision, "models": [{"role": "judge", "model": judge}]}
        m, e = measure_generic(job), vramplan.estimate(job)
        assert abs(e.peak_allocated_bytes / m.peak_allocated_bytes - 1) < 0.01, (precision, e.peak_allocated_bytes, m)
        for phase in ("forward", "backward", "optimizer"):
            assert abs(e.phases[phase] / m.phases[phase] - 1) < 0.01, (precision, phase, e.phases, m.phases)

"""The step-time model against hand arithmetic."""
from __future__ import annotations

import pytest

from vramplan.catalog import find_gpu
from vramplan.plan.steptime import ModelCounts, _reported_bytes, step_time
from vramplan.sources import resolve_model
from vramplan.spec import load_spec


@pytest.fixture(scope="module")
def counts():
    return ModelCounts.of(resolve_model(load_spec({"model": "qwen2.5-0.5b"})))


def test_full_training_is_6N_plus_palm_attention(counts):
    spec = load_spec({"model": "qwen2.5-0.5b", "micro_batch_size": 2, "seq_len": 1024, "grad_accum_steps": 3})
    gpu = find_gpu("a100-80gb")
    st = step_time(counts, spec, gpu, mfu=0.5)
    T = 2 * 3 * 1024
    n = counts.active_params - counts.embedding_params
    attn = 12 * counts.num_layers * counts.attn_width * 1024 * T      # PaLM appendix B
    assert st.flops == pytest.approx(6 * n * T + attn)
    assert st.total_s == pytest.approx(st.flops / (312e12 * 0.5))
    assert not any(k.startswith("comm/") for k in st.terms)          # one GPU talks to no one


def test_checkpointing_adds_one_forward_and_lora_drops_weight_grads(counts):
    gpu = find_gpu("a100-80gb")
    base = load_spec({"model": "qwen2.5-0.5b"})
    plain = step_time(counts, base, gpu)
    ckpt = step_time(counts, base.with_(gradient_checkpointing="full"), gpu)
    lora = step_time(counts, base.with_(method="lora"), gpu, trainable_params=1_000_000)
    fwd = plain.terms["compute/forward"]
    assert ckpt.terms["compute/recompute"] == pytest.approx(fwd)
    assert ckpt.total_s == pytest.approx(plain.total_s + fwd)
    # Full backward is 2x the matmul forward plus 2x attention; a frozen base skips the
    # weight-gradient half, one matmul forward's worth.
    T, s = base.seq_len * base.micro_batch_size, base.seq_len
    attn_fwd = 4 * counts.num_layers * counts.attn_width * s * T
    rate = 312e12 * 0.40
    matmul_fwd = fwd - attn_fwd / rate
    assert lora.terms["compute/backward"] == pytest.approx(plain.terms["compute/backward"] - matmul_fwd)


def test_dp_gradient_all_reduce_is_ring_volume(counts):
    gpu = find_gpu("a100-40gb")
    spec = load_spec({"model": "qwen2.5-0.5b", "num_gpus": 8})
    st = step_time(counts, spec, gpu)
    grad_bytes = counts.num_params * 2                                 # bf16 gradients
    assert st.comm_bytes == pytest.approx(2 * 7 / 8 * grad_bytes)
    assert st.terms["comm/dp_grads"] == pytest.approx(st.comm_bytes / (gpu.interconnect_gbps * 1e9))
    z3 = step_time(counts, spec.with_(parallel={"zero_stage": 3}), gpu)
    assert z3.comm_bytes == pytest.approx(1.5 * st.comm_bytes)        # ZeRO paper, section 7


def test_reported_communication_is_read_when_present():
    assert _reported_bytes({"total_bytes": 123}) == 123
    assert _reported_bytes({"dp": {"all_reduce_bytes": 10}, "tp": {"bytes": 5}}) == 15
    assert _reported_bytes({"note": "x"}) is None


def test_step_time_uses_the_estimators_communication_per_group(counts):
    gpu = find_gpu("a100-40gb")
    spec = load_spec({"model": "qwen2.5-0.5b", "num_gpus": 8})
    reported = {"dp": {"bytes": 3e9, "formula": "..."}, "tp": {"bytes": 1e9}}
    st = step_time(counts, spec, gpu, communication=reported)
    assert st.comm_bytes == pytest.approx(4e9)
    assert st.terms["comm/dp"] == pytest.approx(3e9 / (gpu.interconnect_gbps * 1e9))
    assert "comm/dp_grads" not in st.terms                     # our own model stands aside

"""Estimator components against hand arithmetic, and properties of whole estimates."""
import pytest

import vramplan
from vramplan import load_spec
from vramplan.components.graph import Param, Recorder
from vramplan.estimation import estimate

TINY = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": False}


def job(**kw):
    base = {"model": TINY, "backend": "cpu", "precision": "fp32", "micro_batch_size": 2, "seq_len": 16}
    base.update(kw)
    return load_spec(base)


def test_weights_gradients_adam_states_fp32_full():
    est = estimate(job(optimizer_impl="fused"))
    n = est.num_params
    c = est.components
    opt_phase = [e for e in est.events if e.phase == "optimizer"][0].live
    assert opt_phase.total("weights") == 4 * n
    assert opt_phase.total("gradients") == 4 * n
    # exp_avg + exp_avg_sq in fp32, and a 4-byte step tensor per parameter tensor on CPU
    assert opt_phase.total("optimizer") == 8 * n + 4 * len(est.model.params)
    assert c.total("temporaries/optimizer") == 0


def test_foreach_adamw_temporary_is_parameter_sized():
    fused = estimate(job(optimizer_impl="fused")).phases["optimizer"]
    foreach = estimate(job(optimizer_impl="foreach")).phases["optimizer"]
    n = estimate(job()).num_params
    assert foreach - fused == 4 * n


def test_pure_bf16_halves_states():
    fp32 = [e for e in estimate(job(optimizer_impl="fused")).events if e.phase == "optimizer"][0].live
    bf16 = [e for e in estimate(job(optimizer_impl="fused", precision="bf16")).events if e.phase == "optimizer"][0].live
    assert bf16.total("weights") * 2 == fp32.total("weights")
    assert bf16.total("gradients") * 2 == fp32.total("gradients")


def test_lora_trainable_count_matches_peft_formula():
    spec = job(method="lora", lora={"r": 8, "target_modules": ["q_proj", "v_proj"]})
    est = estimate(spec)
    h, kv = 64, 2 * 16  # hidden, kv heads * head_dim
    per_layer = 8 * (h + h) + 8 * (h + kv)  # q: A(8,h) B(h,8); v: A(8,h) B(kv,8)
    assert est.trainable_params == 2 * per_layer


def test_unmatched_lora_target_warns():
    est = estimate(job(method="lora", lora={"r": 4, "target_modules": ["q_proj", "query"]}))
    assert any("'query'" in n for n in est.notes)


def test_recorder_linear_saves_input_only_for_trained_weight():
    rec = Recorder()
    x = rec.new("x", (8, 16), "fp32", True)
    rec.linear(x, Param("w", (4, 16), "fp32", False))
    assert rec.saved_bytes() == 0
    rec.linear(x, Param("w2", (4, 16), "fp32", True))
    assert rec.saved_bytes() == 8 * 16 * 4


def test_recorder_mul_saves_other_operand_only_when_needed():
    rec = Recorder()
    q = rec.new("q", (4, 8), "bf16", True)
    cos = rec.new("cos", (4, 8), "bf16", False)
    rec.mul(q, cos)  # grad wrt q needs cos; cos needs no grad, so q is not kept
    assert [n for n, _ in rec.saved_items()] == ["cos"]


def test_sdpa_saves_qkv_out_and_lse():
    rec = Recorder()
    q = rec.new("q", (2, 4, 16, 8), "bf16", True)
    k = rec.new("k", (2, 2, 16, 8), "bf16", True)
    v = rec.new("v", (2, 2, 16, 8), "bf16", True)
    rec.sdpa(q, k, v, (2, 16, 4, 8), "attn")
    # q and out (b, a, s, d), k and v (b, k, s, d) in bf16, lse (b, a, s) in fp32
    assert rec.saved_bytes() == 2 * (2 * 4 * 16 * 8) * 2 + 2 * (2 * 2 * 16 * 8) * 2 + 4 * 2 * 4 * 16


@pytest.mark.parametrize("field, small, large", [("micro_batch_size", 1, 4), ("seq_len", 16, 64)])
def test_memory_grows_with_batch_and_sequence(field, small, large):
    assert estimate(job(**{field: small})).peak_allocated_bytes < estimate(job(**{field: large})).peak_allocated_bytes


@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
@pytest.mark.parametrize("method", ["full", "lora"])
def test_checkpointing_never_raises_activations(precision, method):
    none = estimate(job(precision=precision, method=method, seq_len=128, gradient_checkpointing="none"))
    full = estimate(job(precision=precision, method=method, seq_len=128, gradient_checkpointing="full"))
    assert full.phases["forward"] <= none.phases["forward"]
    assert full.peak_allocated_bytes <= none.peak_allocated_bytes


def test_terms_never_negative_and_peak_is_sum():
    est = estimate(job(method="lora", precision="bf16"))
    assert all(v > 0 for v in est.components.terms.values())
    assert est.peak_allocated_bytes == est.components.total()
    assert est.peak_allocated_bytes == max(est.phases.values())


def test_eager_saves_probabilities():
    sdpa = estimate(job(attention="sdpa", seq_len=64))
    eager = estimate(job(attention="eager", seq_len=64))
    heads, layers = 4, 2
    # per layer: the fp32 softmax output (b, a, s, s) is saved, sdpa's fp32 lse (b, a, s) is
    # not, and repeat_kv materializes k and v at all 4 heads instead of the 2 KV heads.
    kv_repeat = 2 * (2 * (heads - 2) * 64 * 16 * 4)
    extra = layers * (2 * heads * 64 * 64 * 4 - 2 * heads * 64 * 4 + kv_repeat)
    assert eager.components.total("activations") - sdpa.components.total("activations") == extra


def test_cuda_estimate_reports_device_levels():
    est = estimate(load_spec({"model": "llama-3.2-1b", "gpu": "a100-80gb", "seq_len": 512}))
    assert est.device_bytes > est.reserved_bytes >= est.peak_allocated_bytes
    assert est.fits is True
    d = est.to_dict()
    for key in ("schema_version", "model", "peak_allocated_bytes", "peak_phase", "phases", "components",
                "reserved_bytes", "device_bytes", "gpu", "fits"):
        assert key in d


def test_raw_size_model_counts_close_to_request():
    est = vramplan.estimate(load_spec({"num_params": "7B"}))
    assert abs(est.num_params - 7e9) / 7e9 < 0.001


def test_paged_optimizer_state_is_outside_the_allocator_but_on_nvidia_smi():
    plain = estimate(load_spec({"model": "llama-3.2-1b", "optimizer": "adamw", "seq_len": 256, "gpu": "a100-80gb"}))
    paged = estimate(load_spec({"model": "llama-3.2-1b", "optimizer": "paged-adamw-32bit", "seq_len": 256,
                                "gpu": "a100-80gb", "precision": "bf16"}))
    assert paged.managed_bytes > 0
    assert not any(k.startswith("optimizer_paged") for k in paged.components.terms)
    assert paged.device_bytes >= paged.reserved_bytes + paged.managed_bytes
    assert paged.peak_allocated_bytes < plain.peak_allocated_bytes


def test_selective_checkpointing_drops_only_the_attention_core():
    eager = dict(attention="eager", seq_len=128)
    none = estimate(job(**eager))
    sel = estimate(job(**eager, gradient_checkpointing="selective"))
    full = estimate(job(**eager, gradient_checkpointing="full"))
    acts = lambda e: [x for x in e.events if x.label.startswith("end of forward")][0].live.total("activations")  # noqa: E731
    assert acts(full) < acts(sel) < acts(none)
    # per layer the fp32 softmax output (b, a, s, s) is what selective recomputation drops
    assert acts(none) - acts(sel) == 2 * (2 * 4 * 128 * 128 * 4)
    sdpa_none, sdpa_sel = estimate(job(seq_len=128)), estimate(job(seq_len=128, gradient_checkpointing="selective"))
    assert acts(sdpa_none) == acts(sdpa_sel)

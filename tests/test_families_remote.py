"""InternLM2 and Baichuan 2 (repository code only, never run): parameter names and shapes
against the written-here stand-ins (vramplan.measure.standin_remote) built on the meta
device, totals against the structurally equal transformers LlamaForCausalLM (fused and
split q/k/v hold the same parameters), and an estimate of each against a real CPU step of
the stand-in under the exact meter."""
from __future__ import annotations

import pytest

from vramplan import catalog, sources
from vramplan.sources import model_from_hf_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = {"vocab_size": 1000, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 256}
CASES = {
    "internlm2-gqa-sdpa": {"model_type": "internlm2", **TINY, "num_key_value_heads": 2, "bias": False,
                           "attn_implementation": "sdpa"},
    "internlm2-mha-bias": {"model_type": "internlm2", **TINY},
    "baichuan-rope": {"model_type": "baichuan", **TINY, "position_embedding_type": "rope",
                      "max_position_embeddings": 512},
    "baichuan-alibi": {"model_type": "baichuan", **TINY, "position_embedding_type": "alibi", "model_max_length": 512},
}


def llama_count(config: dict) -> int:
    """The same shapes as LlamaForCausalLM on the meta device (biases as the family has them)."""
    desc = model_from_hf_config(config)
    cfg = transformers.LlamaConfig(vocab_size=desc.vocab_size, hidden_size=desc.hidden_size,
                                   intermediate_size=desc.intermediate_size, num_hidden_layers=desc.num_layers,
                                   num_attention_heads=desc.num_heads, num_key_value_heads=desc.num_kv_heads,
                                   attention_bias=desc.qkv_bias, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(CASES))
def test_params_match_the_standin_and_llama(name):
    from vramplan.measure.standin_remote import build_standin
    config = dict(CASES[name])
    desc = model_from_hf_config(config)
    with torch.device("meta"):
        model = build_standin(config.pop("model_type"), config, {}, torch.float32)
    real = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert {p.name: p.shape for p in desc.params} == real
    # LlamaAttention's o_proj has the same bias as q/k/v; InternLM2's wo follows `bias` too
    assert desc.num_params() == llama_count(CASES[name])


@pytest.mark.parametrize("name, total", [
    # model cards: InternLM2.5-7B 7.74B, InternLM2-20B 19.86B, InternLM2.5-1.8B 1.89B,
    # Baichuan2-7B 7.51B, Baichuan2-13B 13.9B
    ("internlm2_5-7b-chat", 7_737_708_544), ("internlm2-chat-20b", 19_861_149_696),
    ("internlm2_5-1_8b", 1_889_110_016), ("baichuan2-7b-chat", 7_505_973_248),
    ("baichuan2-13b-chat", 13_896_668_160)])
def test_catalog_totals_equal_llama_with_the_same_shapes(name, total):
    desc = sources.model_desc(name)
    assert desc.num_params() == total == llama_count(dict(catalog.find_model(name).config))


def test_internlm2_attention_is_the_configs():
    """INTERNLM2_ATTENTION_CLASSES[config.attn_implementation], "eager" when unset."""
    assert sources.model_desc("internlm2_5-7b-chat").attn_implementation == "eager"
    assert model_from_hf_config(CASES["internlm2-mha-bias"]).attn_implementation == "eager"
    assert model_from_hf_config(CASES["internlm2-gqa-sdpa"]).attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="attn_implementation"):
        model_from_hf_config({**CASES["internlm2-mha-bias"], "attn_implementation": "xformers"})


def test_baichuan_position_embedding_follows_the_size():
    assert not sources.model_desc("baichuan2-7b-chat").alibi
    assert sources.model_desc("baichuan2-13b-chat").alibi


@pytest.mark.parametrize("name, precision, lora", [
    ("internlm2-gqa-sdpa", "bf16", None), ("internlm2-mha-bias", "fp32", None), ("baichuan-rope", "bf16", None),
    ("baichuan-alibi", "fp32", None),
    # LoRA: the frozen `output` is all-linear's exclusion; Baichuan's frozen NormHead still
    # keeps its normalized weight copy for the input gradient
    ("internlm2-gqa-sdpa", "fp32", ["wqkv", "wo", "w1", "w2", "w3"]), ("baichuan-alibi", "fp32", "all-linear")])
def test_estimate_matches_the_measured_standin_step(name, precision, lora):
    import vramplan
    from conftest import measure_fresh
    job = {"backend": "cpu", "precision": precision, "micro_batch_size": 2, "seq_len": 64,
           "optimizer_impl": "foreach", "model": CASES[name]}
    if lora:
        job.update(method="lora", lora={"r": 8, "target_modules": lora})
    measured = measure_fresh(job, device="cpu")
    est = vramplan.estimate(vramplan.load_spec(job))
    assert est.peak_allocated_bytes == pytest.approx(measured["peak_allocated_bytes"], rel=0.02)
    for phase in ("forward", "backward", "optimizer"):
        assert est.phases[phase] == pytest.approx(measured["phases"][phase], rel=0.05), phase

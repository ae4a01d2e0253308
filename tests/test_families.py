"""Families under src/vramplan/families against the real transformers models.

Parameter names and shapes: `named_parameters()` of the model transformers builds from
the same config on the meta device (no download, no weights, no remote code). Published
totals: the parameter counts on the model cards, for the catalog entries.
"""
from __future__ import annotations

import math

import pytest

from vramplan import sources
from vramplan.sources import model_from_hf_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def real_shapes(config: dict, num_labels: int | None = None) -> dict[str, tuple[int, ...]]:
    cfg = dict(config)
    if num_labels is not None:
        cfg["num_labels"] = num_labels
    hf_config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    auto = (transformers.AutoModelForSequenceClassification if num_labels
            else transformers.AutoModelForCausalLM)
    with torch.device("meta"):
        model = auto.from_config(hf_config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def assert_matches(config: dict, num_labels: int | None = None) -> None:
    desc = model_from_hf_config(config, num_labels=num_labels)
    real = real_shapes(config, num_labels)
    mine = {p.name: p.shape for p in desc.params}
    assert len(mine) == len(desc.params), "duplicate parameter names"
    missing, extra = sorted(set(real) - set(mine)), sorted(set(mine) - set(real))
    assert not missing and not extra, f"missing {missing[:5]}, extra {extra[:5]}"
    wrong = {n: (mine[n], real[n]) for n in real if mine[n] != real[n]}
    assert not wrong, f"shape (mine, real): {dict(list(wrong.items())[:5])}"
    assert desc.num_params() == sum(math.prod(s) for s in real.values())


TINY = {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
CASES = {
    "phi-default": {"model_type": "phi", **TINY, "intermediate_size": 256},
    "phi-qk-layernorm-tied": {"model_type": "phi", **TINY, "intermediate_size": 128,
                              "qk_layernorm": True, "tie_word_embeddings": True},
    "gpt_bigcode-mqa": {"model_type": "gpt_bigcode", "vocab_size": 1000, "n_embd": 64, "n_layer": 2,
                        "n_head": 4},
    "gpt_bigcode-mha-untied-generic-names": {"model_type": "gpt_bigcode", **TINY, "multi_query": False,
                                             "n_inner": 96, "tie_word_embeddings": False},
    "deepseek_v3-q-lora-dense-first": {"model_type": "deepseek_v3", **TINY, "intermediate_size": 96,
                                       "moe_intermediate_size": 32, "n_routed_experts": 8, "n_group": 2,
                                       "topk_group": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                                       "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                                       "qk_rope_head_dim": 8, "v_head_dim": 12, "num_key_value_heads": 4},
    "deepseek_v2-lite-shape": {"model_type": "deepseek_v2", **TINY, "intermediate_size": 96,
                               "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 2,
                               "num_experts_per_tok": 2, "first_k_dense_replace": 1, "q_lora_rank": None,
                               "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                               "v_head_dim": 16, "attention_bias": True, "mlp_bias": True},
    "glm4-default-bias": {"model_type": "glm4", **TINY, "pad_token_id": 0, "intermediate_size": 96, "num_key_value_heads": 2,
                          "head_dim": 32},
    "glm4-no-bias-tied": {"model_type": "glm4", **TINY, "pad_token_id": 0, "intermediate_size": 96, "num_key_value_heads": 4,
                          "head_dim": 16, "attention_bias": False, "tie_word_embeddings": True},
    "internlm3-default": {"model_type": "internlm3", **TINY, "intermediate_size": 96, "num_key_value_heads": 2,
                          "head_dim": 32},
    "internlm3-bias-aliases": {"model_type": "internlm3", **TINY, "intermediate_size": 96, "num_key_value_heads": 2,
                               "head_dim": 16, "qkv_bias": True, "bias": True},
    "llama4-scout-shape": {"model_type": "llama4_text", **TINY, "num_hidden_layers": 4, "intermediate_size": 32,
                           "intermediate_size_mlp": 96, "num_key_value_heads": 2, "head_dim": 32,
                           "num_local_experts": 4},
    "llama4-maverick-shape-bias-tied": {"model_type": "llama4_text", **TINY, "num_hidden_layers": 4,
                                        "intermediate_size": 32, "intermediate_size_mlp": 96,
                                        "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
                                        "interleave_moe_layer_step": 2, "use_qk_norm": False,
                                        "attention_bias": True, "tie_word_embeddings": True},
    "llama4-explicit-moe-layers": {"model_type": "llama4_text", **TINY, "num_hidden_layers": 3,
                                   "intermediate_size": 32, "intermediate_size_mlp": 48, "num_local_experts": 2, "num_key_value_heads": 2,
                                   "moe_layers": [0, 2], "no_rope_layers": [1, 0, 1]},
    "mamba2-groups-untied": {"model_type": "mamba2", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
                             "num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 2},
    "mamba2-bias-no-conv-bias-tied": {"model_type": "mamba2", "vocab_size": 1000, "hidden_size": 64,
                                      "num_hidden_layers": 2, "num_heads": 4, "head_dim": 32, "state_size": 8,
                                      "n_groups": 1, "use_bias": True, "use_conv_bias": False,
                                      "tie_word_embeddings": True},
    # layer 0 Mamba + dense MLP, layer 1 attention + MoE, layer 2 Mamba + dense
    "jamba-hybrid-moe": {"model_type": "jamba", **TINY, "num_hidden_layers": 3, "intermediate_size": 96,
                         "num_key_value_heads": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
                         "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 4},
    "jamba-dense-biases-tied": {"model_type": "jamba", **TINY, "num_hidden_layers": 4, "intermediate_size": 96,
                                "num_key_value_heads": 4,
                                "attn_layer_period": 4, "attn_layer_offset": 3, "num_experts": 1,
                                "mamba_proj_bias": True, "mamba_conv_bias": False, "mamba_dt_rank": 8,
                                "mamba_d_state": 8, "tie_word_embeddings": True},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_params_match_transformers(name):
    assert_matches(CASES[name])


def test_phi_sequence_classification_head():
    assert_matches({**CASES["phi-default"], "pad_token_id": 0}, num_labels=3)


def test_phi_rotary_dims():
    phi2 = sources.model_desc("phi-2")
    assert phi2.head_dim == 80 and phi2.rotary_dim == 32  # partial_rotary_factor 0.4
    assert model_from_hf_config(CASES["phi-default"]).rotary_dim == 8  # PhiConfig default 0.5


@pytest.mark.parametrize("name, total", [
    ("phi-2", 2_779_683_840),  # microsoft/phi-2 model card: 2.7B; PhiForCausalLM count
    # model cards: 15.7B total / 2.4B active; 671B total / 37B active (plus the 14B MTP
    # module that transformers does not build)
    ("deepseek-v2-lite", 15_706_484_224),
    ("deepseek-v3", 671_026_404_352),
    ("deepseek-r1", 671_026_404_352),
    ("yi-1.5-6b", 6_061_035_520),
    ("yi-1.5-9b", 8_829_407_232),
    ("yi-1.5-34b", 34_388_917_248),
    ("mistral-nemo-12b", 12_247_782_400),  # "12B"
    ("mistral-small-24b", 23_572_403_200),  # "24B"
    ("qwen2.5-coder-1.5b", 1_543_714_304),  # model card: 1.54B
    ("qwen2.5-coder-7b", 7_615_616_512),  # 7.61B
    ("qwen2.5-coder-32b", 32_763_876_352),  # 32.5B
    ("starcoder", 15_517_456_384),  # 15.5B
    ("starcoderbase-1b", 1_137_207_296),
    ("glm-4-9b-0414", 9_400_279_040),  # 9.4B
    ("glm-4-32b-0414", 32_566_487_552),  # 32.6B
    ("mamba-codestral-7b", 7_285_403_648),  # model card: 7,285,403,648
    ("mamba2-2.7b", 2_702_599_680),  # 2.7B
    ("jamba-v0.1", 51_570_323_328),  # 52B total
    ("jamba-1.5-mini", 51_570_323_328),
])
def test_published_parameter_totals(name, total):
    assert sources.model_desc(name).num_params() == total


def test_llama4_layer_lists_follow_the_config_class():
    """Llama4TextConfig.__post_init__ fills no_rope_layers, moe_layers and layer_types."""
    for name in ("llama4-scout-shape", "llama4-maverick-shape-bias-tied", "llama4-explicit-moe-layers"):
        config = CASES[name]
        real = transformers.AutoConfig.for_model(**config)
        desc = model_from_hf_config(config)
        assert desc.moe_layers == tuple(real.moe_layers)
        assert desc.rope_layers == tuple(i for i, r in enumerate(real.no_rope_layers) if r)
        assert desc.chunked_layers == tuple(i for i, t in enumerate(real.layer_types) if t == "chunked_attention")


def test_internlm3_refuses_unequal_biases_like_its_config_class():
    config = {**CASES["internlm3-default"], "qkv_bias": True}
    with pytest.raises(ValueError, match="qkv_bias"):
        model_from_hf_config(config)
    with pytest.raises(Exception, match="qkv_bias"):  # huggingface_hub's strict-validation error
        transformers.AutoConfig.for_model(**config)


def test_llama4_multimodal_config_reads_its_text_config():
    text = {k: v for k, v in CASES["llama4-scout-shape"].items() if k != "model_type"}
    desc = model_from_hf_config({"model_type": "llama4", "text_config": text})
    assert desc.num_params() == model_from_hf_config(CASES["llama4-scout-shape"]).num_params()


def test_llama4_router_is_refused_as_a_lora_target():
    """PEFT's lora.Linear fails on Llama4Router's tuple output (seen on CPU), so all-linear
    on Llama-4 is one SpecError naming the field rather than a number."""
    import vramplan
    from vramplan.spec import SpecError

    job = {"model": CASES["llama4-scout-shape"], "method": "lora", "lora": {"r": 4, "target_modules": "all-linear"}}
    with pytest.raises(SpecError, match="router") as err:
        vramplan.estimate(vramplan.load_spec(job))
    assert err.value.field == "lora.target_modules"
    job["lora"]["target_modules"] = ["q_proj", "v_proj"]
    assert vramplan.estimate(vramplan.load_spec(job)).peak_allocated_bytes > 0


def test_jamba_layer_kinds_follow_the_config_class():
    """JambaConfig.layers_block_type and layers_num_experts decide each layer's mixer and
    feed-forward."""
    for name in ("jamba-hybrid-moe", "jamba-dense-biases-tied"):
        real = transformers.AutoConfig.for_model(**CASES[name])
        desc = model_from_hf_config(CASES[name])
        assert [desc.layer_kind(i) for i in range(desc.num_layers)] == real.layers_block_type
        assert desc.moe_layers == tuple(i for i, e in enumerate(real.layers_num_experts) if e > 1)


def test_mamba2_refuses_inconsistent_heads_like_its_config_class():
    config = {**CASES["mamba2-groups-untied"], "num_heads": 6}
    with pytest.raises(ValueError, match="num_heads"):
        model_from_hf_config(config)
    with pytest.raises(Exception):
        transformers.AutoConfig.for_model(**config)


def test_mamba2_out_proj_lora_is_refused_as_peft_refuses_it():
    """PEFT refuses LoRA on a Mamba-2 out_proj (tuners_utils._check_lora_target_modules_mamba);
    the estimate says so in one line naming the field instead of giving a number."""
    import vramplan
    from vramplan.spec import SpecError

    peft = pytest.importorskip("peft")
    config = CASES["mamba2-groups-untied"]
    cfg = dict(config)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    with pytest.raises(ValueError, match="out_proj"):
        peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["in_proj", "out_proj"]))
    job = {"model": config, "attention": "eager", "method": "lora",
           "lora": {"r": 4, "target_modules": ["in_proj", "out_proj"]}}
    with pytest.raises(SpecError, match="out_proj") as err:
        vramplan.estimate(vramplan.load_spec(job))
    assert err.value.field == "lora.target_modules"
    job["lora"]["target_modules"] = ["in_proj"]
    assert vramplan.estimate(vramplan.load_spec(job)).peak_allocated_bytes > 0

"""The adapter's GPT-NeoX, BLOOM, OPT and Qwen-1 configs against the real models.

Ground truth is `named_parameters()` of the model transformers builds from the same config
on the meta device (no download, no weights). Qwen-1 has no transformers class (remote
code only), so it is checked against the published parameter count of Qwen-7B.
"""
from __future__ import annotations

import pytest

from vramplan.sources import model_from_hf_config
from vramplan.catalog.hf_extended import ExtendedDesc

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _real_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    cfg = dict(config)
    hf_config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


TINY = {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
CASES = {
    "gpt_neox-default": {"model_type": "gpt_neox", **TINY, "intermediate_size": 256},
    "gpt_neox-sequential-nobias-tied": {"model_type": "gpt_neox", **TINY, "intermediate_size": 192,
                                        "use_parallel_residual": False, "attention_bias": False,
                                        "tie_word_embeddings": True},
    "bloom-tied": {"model_type": "bloom", "vocab_size": 1000, "hidden_size": 64, "n_layer": 2, "n_head": 4},
    "bloom-untied-generic-names": {"model_type": "bloom", **TINY, "tie_word_embeddings": False},
    "opt-default": {"model_type": "opt", **TINY, "ffn_dim": 256},
    "opt-350m-shape": {"model_type": "opt", **TINY, "ffn_dim": 256, "word_embed_proj_dim": 32,
                       "do_layer_norm_before": False, "max_position_embeddings": 128},
    "falcon-7b-shape-multi-query": {"model_type": "falcon", **TINY},
    "falcon-40b-shape-new-arch": {"model_type": "falcon", **TINY, "new_decoder_architecture": True,
                                  "num_kv_heads": 2, "bias": False},
    "falcon-sequential-bias-mha": {"model_type": "falcon", **TINY, "multi_query": False,
                                   "parallel_attn": False, "bias": True, "tie_word_embeddings": False},
    "falcon-new-arch-one-norm": {"model_type": "falcon", **TINY, "new_decoder_architecture": True,
                                 "num_kv_heads": 4, "num_ln_in_parallel_attn": 1, "ffn_hidden_size": 96},
    "opt-untied-nobias": {"model_type": "opt", **TINY, "ffn_dim": 128, "enable_bias": False,
                          "tie_word_embeddings": False},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_params_match_transformers(name):
    config = CASES[name]
    desc = model_from_hf_config(config)
    real = _real_shapes(config)
    mine = {p.name: p.shape for p in desc.params}
    assert len(mine) == len(desc.params), "duplicate parameter names"
    missing, extra = sorted(set(real) - set(mine)), sorted(set(mine) - set(real))
    assert not missing and not extra, f"missing {missing[:5]}, extra {extra[:5]}"
    wrong = {n: (mine[n], real[n]) for n in real if mine[n] != real[n]}
    assert not wrong, f"shape (mine, real): {dict(list(wrong.items())[:5])}"
    assert desc.num_params() == sum(_numel(s) for s in real.values())


def test_gpt_neox_partial_rotary_and_parallel_residual():
    # Pythia-160m's config.json fields.
    desc = model_from_hf_config({"model_type": "gpt_neox", "hidden_size": 768, "num_attention_heads": 12,
                                 "num_hidden_layers": 12, "intermediate_size": 3072, "vocab_size": 50304,
                                 "rotary_pct": 0.25, "use_parallel_residual": True})
    assert isinstance(desc, ExtendedDesc)
    assert desc.rotary_dim == 16 and desc.parallel_residual and desc.fused_qkv
    assert desc.num_params() == 162_322_944  # Pythia-160m: GPTNeoXForCausalLM parameter count


def test_opt_125m_param_count():
    desc = model_from_hf_config({"model_type": "opt", "hidden_size": 768, "num_attention_heads": 12,
                                 "num_hidden_layers": 12, "ffn_dim": 3072, "vocab_size": 50272,
                                 "max_position_embeddings": 2048})
    assert desc.num_params() == 125_239_296  # facebook/opt-125m


QWEN_7B = {"model_type": "qwen", "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
           "kv_channels": 128, "intermediate_size": 22016, "vocab_size": 151936, "no_bias": True,
           "max_position_embeddings": 32768, "rotary_pct": 1.0}


def test_qwen1_7b_matches_published_count():
    """Qwen/Qwen-7B (modeling_qwen.py): 7,721,324,544 parameters, as its README reports."""
    desc = model_from_hf_config(QWEN_7B)
    assert desc.num_params() == 7_721_324_544
    names = {p.name: p.shape for p in desc.params}
    assert names["transformer.h.0.attn.c_attn.weight"] == (3 * 4096, 4096)
    assert names["transformer.h.0.attn.c_attn.bias"] == (3 * 4096,)
    assert "transformer.h.0.attn.c_proj.bias" not in names
    assert names["transformer.h.0.mlp.w2.weight"] == (11008, 4096)
    assert names["lm_head.weight"] == (151936, 4096)


def test_qwen1_legacy_ffn_hidden_size_key():
    legacy = {k: v for k, v in QWEN_7B.items() if k != "intermediate_size"} | {"ffn_hidden_size": 22016}
    assert model_from_hf_config(legacy).num_params() == 7_721_324_544


def test_qwen1_missing_width_is_one_line_error():
    cfg = {k: v for k, v in QWEN_7B.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match="ffn_hidden_size"):
        model_from_hf_config(cfg)


def test_falcon_7b_param_count():
    desc = model_from_hf_config({"model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71,
                                 "num_hidden_layers": 32, "vocab_size": 65024, "multi_query": True,
                                 "parallel_attn": True, "bias": False})
    assert desc.num_kv_heads == 1 and desc.num_params() == 6_921_720_704  # tiiuae/falcon-7b

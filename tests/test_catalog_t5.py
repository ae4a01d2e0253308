"""The adapter's T5 and mT5 configs against the real models.

Ground truth is `named_parameters()` of AutoModelForSeq2SeqLM (T5ForConditionalGeneration,
MT5ForConditionalGeneration) built from the same config on the meta device (no download,
no weights), and the catalog entries' parameter counts built the same way.
"""
from __future__ import annotations

import pytest

from vramplan.catalog import find_model
from vramplan.sources import model_from_hf_config
from vramplan.catalog.hf_extended import ExtendedDesc

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _real_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    cfg = dict(config)
    hf_config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForSeq2SeqLM.from_config(hf_config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


TINY = {"vocab_size": 1000, "d_model": 64, "d_kv": 16, "d_ff": 256, "num_layers": 2, "num_heads": 4,
        "decoder_start_token_id": 0}
CASES = {
    "t5-v1.0-relu": {"model_type": "t5", **TINY},
    "t5-v1.1-gated-gelu-untied-flag": {"model_type": "t5", **TINY, "feed_forward_proj": "gated-gelu",
                                       "tie_word_embeddings": False},
    "t5-asymmetric-heads-not-h-over-a": {"model_type": "t5", **TINY, "num_decoder_layers": 3, "d_kv": 8,
                                         "relative_attention_num_buckets": 16},
    "mt5-default-gated": {"model_type": "mt5", **TINY},
    "mt5-gated-silu": {"model_type": "mt5", **TINY, "feed_forward_proj": "gated-silu"},
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


def test_layer_indices_span_both_stacks():
    desc = model_from_hf_config(CASES["t5-asymmetric-heads-not-h-over-a"])
    assert isinstance(desc, ExtendedDesc)
    assert desc.num_encoder_layers == 2 and desc.num_layers == 5
    layers = {p.name.split(".layer.")[0]: p.layer for p in desc.params if p.layer is not None}
    assert layers == {"encoder.block.0": 0, "encoder.block.1": 1, "decoder.block.0": 2,
                      "decoder.block.1": 3, "decoder.block.2": 4}


def test_feed_forward_and_rescale_flags():
    v10 = model_from_hf_config(CASES["t5-v1.0-relu"])
    v11 = model_from_hf_config(CASES["t5-v1.1-gated-gelu-untied-flag"])
    mt5 = model_from_hf_config(CASES["mt5-default-gated"])
    assert (v10.mlp.value, v10.hidden_act, v10.scale_decoder_outputs) == ("plain", "relu", True)
    assert (v11.mlp.value, v11.hidden_act, v11.scale_decoder_outputs) == ("gated", "gelu_new", False)
    # MT5ForConditionalGeneration has no rescale before lm_head
    assert (mt5.mlp.value, mt5.hidden_act, mt5.scale_decoder_outputs) == ("gated", "gelu_new", False)


@pytest.mark.parametrize("name", ["t5-base", "flan-t5-large", "t0-3b", "mt0-xxl"])
def test_catalog_entries_count_as_transformers_builds_them(name):
    entry = find_model(name)
    desc = model_from_hf_config(entry.config)
    real = _real_shapes({k: v for k, v in entry.config.items() if k != "architectures"})
    assert desc.num_params() == sum(_numel(s) for s in real.values())


def test_t5_base_published_count():
    # google-t5/t5-base: 222,903,552 parameters (shared embedding tied to lm_head)
    assert model_from_hf_config(find_model("t5-base").config).num_params() == 222_903_552


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n

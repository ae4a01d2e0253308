"""Catalog and Hugging Face adapter against the real transformers models.

Ground truth is `named_parameters()` of the model transformers builds from the same
config on the meta device (no download, no weights, no remote code).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramplan import catalog, sources
from vramplan.sources import model_from_hf_config
from vramplan.model import MlpKind, NormKind, PositionKind

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

DEV_TRUTH = Path("/work/shared/validation/cpu-dev-truth.jsonl")


def _real_shapes(config: dict, num_labels: int | None = None) -> dict[str, tuple[int, ...]]:
    cfg = dict(config)
    if cfg["model_type"] == "gemma3":  # the language model of a multimodal Gemma 3 repo
        cfg = {"model_type": "gemma3_text", **cfg["text_config"]}
    model_type = cfg.pop("model_type")
    seq_cls = num_labels is not None or model_type == "bert"
    if num_labels is not None:
        cfg["num_labels"] = num_labels
    hf_config = transformers.AutoConfig.for_model(model_type, **cfg)
    auto = (transformers.AutoModelForSequenceClassification if seq_cls
            else transformers.AutoModelForSeq2SeqLM if getattr(hf_config, "is_encoder_decoder", False)
            else transformers.AutoModelForCausalLM)
    with torch.device("meta"):
        model = auto.from_config(hf_config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _assert_matches(config: dict, num_labels: int | None = None) -> None:
    desc = model_from_hf_config(config, num_labels=num_labels)
    real = _real_shapes(config, num_labels)
    mine = {p.name: p.shape for p in desc.params}
    assert len(mine) == len(desc.params), "duplicate parameter names"
    missing, extra = sorted(set(real) - set(mine)), sorted(set(mine) - set(real))
    assert not missing and not extra, f"missing {missing[:5]}, extra {extra[:5]}"
    wrong = {n: (mine[n], real[n]) for n in real if mine[n] != real[n]}
    assert not wrong, f"shape (mine, real): {dict(list(wrong.items())[:5])}"
    assert desc.num_params() == sum(_numel(s) for s in real.values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


# families that exist only as repository code have no transformers class to build: their
# entries are checked against the stand-ins and LlamaForCausalLM in test_families_remote.py
REPOSITORY_CODE = {"internlm2", "baichuan"}


@pytest.mark.parametrize("entry", [e for e in catalog.list_models() if e.config["model_type"] not in REPOSITORY_CODE],
                         ids=lambda e: e.name)
def test_catalog_model_params_match_transformers(entry):
    _assert_matches(entry.config)


def _dev_truth_models() -> list[dict]:
    if not DEV_TRUTH.exists():
        return []
    return [json.loads(line)["job"]["model"] for line in DEV_TRUTH.read_text().splitlines() if line]


@pytest.mark.skipif(not DEV_TRUTH.exists(), reason="shared validation file not present")
@pytest.mark.parametrize("config", _dev_truth_models())
def test_dev_truth_configs_match_transformers(config):
    _assert_matches(config)


_SMALL = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, vocab_size=1000)
_VARIANTS = {
    "llama-bias-tied": dict(model_type="llama", attention_bias=True, mlp_bias=True,
                            tie_word_embeddings=True, **_SMALL),
    "qwen2": dict(model_type="qwen2", **_SMALL),
    "qwen3-head-dim": dict(model_type="qwen3", head_dim=32, attention_bias=True, **_SMALL),
    "gemma": dict(model_type="gemma", **_SMALL),
    "gemma2": dict(model_type="gemma2", **_SMALL),
    "phi-qk-layernorm": dict(model_type="phi", qk_layernorm=True, **_SMALL),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, **_SMALL),
    "qwen2-moe-sparse-step": dict(model_type="qwen2_moe", num_experts=4, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=48, decoder_sparse_step=2,
                                  mlp_only_layers=[0], **_SMALL),
    "qwen3-moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **_SMALL),
    "gpt2-n-inner-untied": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=1000,
                                n_inner=100, tie_word_embeddings=False),
}


@pytest.mark.parametrize("name", sorted(_VARIANTS))
def test_config_variants_match_transformers(name):
    _assert_matches(_VARIANTS[name])


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "gemma3_text", "phi3", "phi"])
def test_sequence_classification_head(model_type):
    config = dict(model_type=model_type, pad_token_id=0, **_SMALL)  # Phi-3's default pad id is 32000
    if model_type == "qwen3_moe":
        config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    _assert_matches(config, num_labels=3)
    desc = model_from_hf_config(config, num_labels=3)
    assert desc.params[-1].name == "score.weight" and desc.num_labels == 3


def test_bert_and_gpt2_classification():
    bert = catalog.find_model("bert-base-uncased").config
    _assert_matches(bert, num_labels=5)
    desc = model_from_hf_config(bert, num_labels=5)
    assert desc.is_encoder and desc.num_labels == 5
    assert [p.name for p in desc.params[-2:]] == ["classifier.weight", "classifier.bias"]
    # bert-base-uncased with a 2-way head: 109,482,240 encoder+pooler + 1,538 classifier
    assert sources.model_desc("bert-base-uncased").num_params() == 109_483_778
    _assert_matches(catalog.find_model("gpt2").config, num_labels=2)


# ---------------------------------------------------------------- known totals
@pytest.mark.parametrize("name, total", [
    ("gpt2", 124_439_808),
    ("llama-2-7b", 6_738_415_616),
    ("llama-3.1-8b", 8_030_261_248),
    ("mistral-7b-v0.1", 7_241_732_096),
    ("qwen2.5-7b", 7_615_616_512),
    ("gemma-2-9b", 9_241_705_984),
    ("phi-3-mini", 3_821_079_552),
    ("mixtral-8x7b", 46_702_792_704),
])
def test_published_parameter_totals(name, total):
    assert sources.model_desc(name).num_params() == total


def test_architecture_flags():
    gemma2 = sources.model_desc("gemma-2-2b")
    assert gemma2.embed_scale and gemma2.sandwich_norm and gemma2.final_logit_softcapping == 30.0
    assert gemma2.sliding_window == 4096 and gemma2.sliding_window_layers[:2] == (0, 2)
    gemma3 = sources.model_desc("gemma-3-27b")
    assert gemma3.model_type == "gemma3_text" and gemma3.qk_norm and gemma3.head_dim == 128
    assert gemma3.vocab_size == 262208 and len(gemma3.sliding_window_layers) == 62 - 10
    qwen3 = sources.model_desc("qwen3-0.6b")
    assert qwen3.qk_norm and qwen3.head_dim == 128 and qwen3.tie_word_embeddings
    assert not qwen3.qkv_bias and sources.model_desc("qwen2.5-7b").qkv_bias
    moe = sources.model_desc("qwen3-30b-a3b")
    assert moe.moe.num_experts == 128 and moe.moe.top_k == 8 and len(moe.moe_layers) == 48
    phi3 = sources.model_desc("phi-3-mini")
    assert phi3.fused_qkv and phi3.fused_gate_up and phi3.mlp is MlpKind.GATED
    gpt2 = sources.model_desc("gpt2")
    assert gpt2.position is PositionKind.LEARNED and gpt2.norm is NormKind.LAYERNORM
    assert gpt2.mlp is MlpKind.PLAIN and gpt2.hidden_dropout == 0.1 and gpt2.fused_qkv
    assert sources.model_desc("mistral-7b-v0.1").sliding_window == 4096
    assert sources.model_desc("qwen2.5-7b").sliding_window is None  # use_sliding_window false


# ---------------------------------------------------------------- adapter errors
def test_unknown_model_type_lists_supported():
    with pytest.raises(ValueError, match=r"model_type 'made_up_arch'.*llama.*gpt2"):
        model_from_hf_config({"model_type": "made_up_arch", "hidden_size": 8})


def test_missing_field_is_named():
    config = dict(catalog.find_model("llama-2-7b").config)
    del config["num_hidden_layers"]
    with pytest.raises(ValueError, match="num_hidden_layers"):
        model_from_hf_config(config)
    with pytest.raises(ValueError, match="model_type"):
        model_from_hf_config({"hidden_size": 8})


def test_other_multimodal_configs_are_refused():
    with pytest.raises(ValueError, match="text_config"):
        model_from_hf_config({"model_type": "llava", "text_config": {"model_type": "llama"}})


# ---------------------------------------------------------------- lookups
def test_catalog_size_and_lookup():
    assert len(catalog.list_models()) >= 30
    by_name = catalog.find_model("llama-3.1-8b")
    assert catalog.find_model("meta-llama/Llama-3.1-8B") is by_name
    assert catalog.find_model("META-LLAMA/llama-3.1-8b") is by_name
    assert catalog.find_model("llama3.1-8b") is by_name  # alias
    assert sources.model_desc("Llama-3.1-8B").hub_id == "meta-llama/Llama-3.1-8B"


def test_unknown_names_suggest_the_nearest():
    with pytest.raises(catalog.UnknownNameError, match="did you mean 'llama-3.1-8b'") as exc:
        catalog.find_model("lama-3.1-8b")
    assert isinstance(exc.value, KeyError) and not str(exc.value).startswith("'")
    with pytest.raises(catalog.UnknownNameError, match="did you mean 'rtx-4090'"):
        catalog.find_gpu("rtx-4009")


def test_entries_are_well_formed():
    names = [m.name for m in catalog.list_models()]
    assert len(names) == len(set(names))
    for entry in catalog.list_models():
        assert entry.name == entry.name.lower() and " " not in entry.name
        assert "/" in entry.hub_id and entry.description and "model_type" in entry.config


def test_a_name_is_found_from_its_file_as_from_the_whole_catalog():
    """find_model reads models/<name>.json alone before the whole catalog is read: that is
    the entry the index gives only if every file is named after its entry and no two entries
    share a name, hub id or alias (the index keeps the first of a clash)."""
    import os
    from collections import Counter
    folder = os.path.join(os.path.dirname(catalog.__file__), "models")
    files = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    entries = catalog.list_models()
    assert [e.name + ".json" for e in entries] == files
    keys = Counter(k.strip().lower() for e in entries for k in {e.name, e.hub_id, *e.aliases})
    assert [k for k, n in keys.items() if n > 1] == []
    for entry in entries:
        assert catalog._model_file(entry.name) is entry
        assert catalog.find_model(entry.name.upper()) is entry
    assert catalog._model_file("meta-llama/llama-3.1-8b") is None and catalog._model_file("../gpus") is None


def test_gpu_catalog():
    gpus = catalog.list_gpus()
    assert len(gpus) >= 17
    for gpu in gpus:
        assert gpu.memory_bytes > 0 and gpu.memory_unit_note and gpu.memory_marketed
        assert gpu.fp16_tflops > 0 and gpu.fp32_tflops > 0 and gpu.memory_bandwidth_gbps > 0
        assert gpu.bf16_tflops is None or gpu.bf16_tflops > 0
        assert gpu.vendor in ("nvidia", "amd", "huawei") and gpu.name == gpu.name.lower()
        assert gpu.interconnect in ("nvlink", "pcie", "infinity-fabric", "hccs")
        assert gpu.interconnect_gbps > 0 and gpu.sources
    assert catalog.find_gpu("a100-80gb").memory_bytes == 81920 * 2**20
    assert catalog.find_gpu("H100").name == "h100-80gb"
    assert catalog.find_gpu("rtx-4090").memory_bytes == 24564 * 2**20


def test_gpu_units_are_exact():
    h200 = catalog.find_gpu("h200")
    assert h200.memory_bytes == 143771 * 2**20 and "141 GB" == h200.memory_marketed
    assert catalog.find_gpu("mi300x").memory_bytes == 205_822_885_888
    assert catalog.find_gpu("v100-16gb").bf16_tflops is None  # Volta has no BF16
    sixty_four = [g for g in catalog.list_gpus() if 60 * 2**30 < g.memory_bytes <= 64 * 2**30]
    assert sixty_four, "a 64 GB-class device"


def test_import_reads_nothing():
    """Importing the catalog reads no data file (checked in a fresh interpreter)."""
    import subprocess
    import sys
    code = ("import vramplan.catalog as c; "
            "assert c._models.cache_info().currsize == 0 and c._gpus.cache_info().currsize == 0")
    subprocess.run([sys.executable, "-c", code], check=True)

"""A LoRA job that names no target modules gets the stack's default, checked against PEFT
itself: the catalog table is PEFT's, and the adapters vramplan counts are the ones
`get_peft_model(model, LoraConfig(r=...))` creates on the real transformers model."""
from __future__ import annotations

import pytest

import vramplan
from vramplan.catalog.runtime import peft_lora_targets
from vramplan.components.trainable import param_set
from vramplan.sources import resolve_model
from vramplan.spec import SpecError

# Tiny configs of model types PEFT has a default for; the fields are the config class's own.
_TINY = {
    "gpt2": {"model_type": "gpt2", "vocab_size": 1000, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128},
    "gpt_bigcode": {"model_type": "gpt_bigcode", "vocab_size": 1000, "n_embd": 64, "n_layer": 2, "n_head": 4,
                    "n_positions": 128, "multi_query": True},
    "phi": {"model_type": "phi", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128},
    "qwen2": {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
    "gpt_neox": {"model_type": "gpt_neox", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128},
}
_BERT = {"model_type": "bert", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128}


def _peft_trainable(config: dict, num_labels: int | None = None) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = dict(config)
    auto = transformers.AutoModelForCausalLM
    if num_labels:
        cfg["num_labels"] = num_labels
        auto = transformers.AutoModelForSequenceClassification
    hf_config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = auto.from_config(hf_config)
    task = "SEQ_CLS" if num_labels else "CAUSAL_LM"
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, task_type=task))
    return sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "lora_" in n)


def _mine(job: dict) -> int:
    spec = vramplan.load_spec(job)
    vramplan.estimate(spec)  # the job runs (validity accepts the targets)
    return sum(p.numel for p in param_set(resolve_model(spec), spec).params if p.kind == "lora")


def test_table_is_peft_s_own():
    peft = pytest.importorskip("peft")
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as real
    mine = peft_lora_targets()
    assert mine == {k: v for k, v in real.items() if isinstance(v, list)}


@pytest.mark.parametrize("model_type", sorted(_TINY))
def test_default_targets_make_peft_s_adapters(model_type):
    config = _TINY[model_type]
    job = {"model": config, "method": "lora", "lora": {"r": 4}, "seq_len": 64}
    assert _mine(job) == _peft_trainable(config)


def test_default_targets_of_a_classifier():
    job = {"model": _BERT, "task": "sequence-classification", "num_labels": 2, "method": "lora",
           "lora": {"r": 4}, "seq_len": 64}
    assert _mine(job) == _peft_trainable(_BERT, num_labels=2)


def test_a_classifier_trains_a_copy_of_its_head_as_peft_s_seq_cls_model_does():
    # PeftModelForSequenceClassification adds "classifier"/"score" to modules_to_save: every
    # trainable parameter PEFT makes (adapters and the head's copy) is counted
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    for config in (_BERT, _TINY["qwen2"]):
        job = {"model": config, "task": "sequence-classification", "num_labels": 2, "method": "lora",
               "lora": {"r": 4}, "seq_len": 64}
        spec = vramplan.load_spec(job)
        est = vramplan.estimate(spec)
        assert not any("matches no module" in str(n) for n in est.notes)
        mine = sum(p.numel for p in param_set(resolve_model(spec), spec).params if p.trainable)
        cfg = dict(config, num_labels=2)
        hf = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        with torch.device("meta"):
            model = transformers.AutoModelForSequenceClassification.from_config(hf)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, task_type="SEQ_CLS"))
        assert mine == sum(p.numel() for p in model.parameters() if p.requires_grad), config["model_type"]


def test_frameworks_with_all_linear_default():
    config = _TINY["qwen2"]
    plain = _mine({"model": config, "method": "lora", "lora": {"r": 4}, "seq_len": 64})
    for stack in ("llama-factory", "ms-swift"):
        swift = _mine({"model": config, "method": "lora", "lora": {"r": 4}, "seq_len": 64, "stack": stack})
        named = _mine({"model": config, "method": "lora", "lora": {"r": 4, "target_modules": "all-linear"},
                       "seq_len": 64})
        assert swift == named > plain


def test_model_type_without_a_peft_default_is_assumed_with_a_note():
    est = vramplan.estimate(vramplan.load_spec({"model": "qwen3-30b-a3b", "method": "lora", "seq_len": 512}))
    assert any("target_modules" in str(n) for n in est.notes)
    named = vramplan.estimate(vramplan.load_spec({"model": "qwen3-30b-a3b", "method": "lora", "seq_len": 512,
                                                  "lora": {"target_modules": ["q_proj", "v_proj"]}}))
    assert named.peak_allocated_bytes == est.peak_allocated_bytes
    assert not any("target_modules" in str(n) for n in named.notes)


def test_no_default_and_no_llama_names_is_refused():
    with pytest.raises(SpecError) as err:
        vramplan.estimate(vramplan.load_spec({"model": "phi-3-mini", "method": "lora", "seq_len": 512}))
    assert err.value.field == "lora.target_modules" and "phi3" in str(err.value)


def test_compare_runs_on_a_model_outside_llama_naming():
    from vramplan.plan import compare
    rows = compare(vramplan.load_spec({"model": "gpt2-medium", "gpu": "a100-80gb", "seq_len": 512}))
    lora = [r for r in rows if r.spec is not None and r.spec.method.value == "lora"]
    assert lora and all(r.estimate is not None for r in lora)

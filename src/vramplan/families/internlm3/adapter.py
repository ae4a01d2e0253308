"""InternLM3 config -> ModelDesc. transformers 5.24 builds `internlm3` as LlamaForCausalLM
(models/auto/modeling_auto.py: ("internlm3", "LlamaForCausalLM")) from InternLM3Config
(models/internlm3/configuration_internlm3.py), a LlamaConfig with its own defaults and two
aliases (attribute_map: qkv_bias -> attention_bias, bias -> mlp_bias); its
validate_architecture refuses qkv_bias != bias. So the description is Llama's, read
with those defaults, and the forward is Llama's (model_type "llama").
"""
from __future__ import annotations

from vramplan.catalog.hf import decoder_desc
from vramplan.catalog.hf_config import HFCfg
from vramplan.model import ModelDesc

# InternLM3Config fields and defaults (the internlm3-8b-instruct model).
DEFAULTS = {"vocab_size": 128512, "hidden_size": 4096, "intermediate_size": 10240, "num_hidden_layers": 48,
            "num_attention_heads": 32, "num_key_value_heads": 2, "hidden_act": "silu",
            "max_position_embeddings": 32768, "tie_word_embeddings": False, "attention_bias": False,
            "attention_dropout": 0.0, "mlp_bias": False, "head_dim": 128}
ALIASES = {"qkv_bias": "attention_bias", "bias": "mlp_bias"}


def build(config: dict, name: str, num_labels: int | None) -> ModelDesc:
    if num_labels:  # transformers' MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES has no internlm3
        raise ValueError("internlm3 has no sequence-classification model in transformers 5.24 "
                         "(no InternLM3ForSequenceClassification): no classifier or reward model of it; "
                         "use task sft")
    cfg = {**DEFAULTS, **{ALIASES.get(k, k): v for k, v in config.items()}}
    if bool(cfg["attention_bias"]) != bool(cfg["mlp_bias"]):
        raise ValueError("internlm3 config: qkv_bias (attention_bias) and bias (mlp_bias) must be equal; "
                         "InternLM3Config refuses them different (the Llama implementation uses one setting)")
    cfg["model_type"] = "llama"
    return decoder_desc(HFCfg(cfg, "llama"), name, num_labels)

"""Reading a Hugging Face `config.json`: each key explicit in the config, else the default
its transformers config class declares (`CLASS_DEFAULTS`, copied from
`transformers/models/<family>/configuration_<family>.py`, transformers 5.23), else a
one-line ValueError naming the field; and the checkpoint's dtype. The adapters
(vramplan.catalog.hf, hf_extended, the family folders) read configs through it."""
from __future__ import annotations

_COMMON = {"num_key_value_heads": None, "head_dim": None, "attention_dropout": 0.0,
           "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
           "sliding_window": None}
# Defaults of the transformers config classes for the keys read below (transformers 5.23).
# A key absent from a family's table (and from _COMMON) is required in the config.
CLASS_DEFAULTS: dict[str, dict[str, object]] = {
    "llama": {"max_position_embeddings": 2048, "tie_word_embeddings": False},
    "mistral": {"max_position_embeddings": 131072, "tie_word_embeddings": False,
                "num_key_value_heads": 8, "sliding_window": 4096},
    "mixtral": {"max_position_embeddings": 131072, "tie_word_embeddings": False,
                "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2": {"max_position_embeddings": 32768, "tie_word_embeddings": False,
              "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "qwen2_moe": {"max_position_embeddings": 32768, "tie_word_embeddings": False,
                  "qkv_bias": True, "num_experts": 60, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen3": {"max_position_embeddings": 32768, "tie_word_embeddings": False, "head_dim": 128,
              "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28},
    "qwen3_moe": {"max_position_embeddings": 32768, "tie_word_embeddings": False,
                  "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "gemma": {"max_position_embeddings": 8192, "tie_word_embeddings": True, "head_dim": 256,
              "hidden_act": "gelu_pytorch_tanh"},
    "gemma2": {"max_position_embeddings": 8192, "tie_word_embeddings": True, "head_dim": 256,
               "num_key_value_heads": 4, "hidden_activation": "gelu_pytorch_tanh",
               "sliding_window": 4096, "final_logit_softcapping": 30.0,
               "attn_logit_softcapping": 50.0},
    # Google's Gemma 3 text_config files are sparse and rely on these class defaults.
    "gemma3_text": {"max_position_embeddings": 131072, "tie_word_embeddings": True,
                    "head_dim": 256, "vocab_size": 262208, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "hidden_activation": "gelu_pytorch_tanh",
                    "sliding_window": 4096, "sliding_window_pattern": 6,
                    "final_logit_softcapping": None, "attn_logit_softcapping": None},
    "phi3": {"max_position_embeddings": 4096, "tie_word_embeddings": False,
             "resid_pdrop": 0.0, "sliding_window": None},
    "phi": {"max_position_embeddings": 2048, "tie_word_embeddings": False,
            "hidden_act": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "qk_layernorm": False},
    "gpt2": {"n_positions": 1024, "n_inner": None, "activation_function": "gelu_new",
             "attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1,
             "tie_word_embeddings": True},
    "bert": {"max_position_embeddings": 512, "type_vocab_size": 2, "hidden_act": "gelu",
             "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
             "num_labels": 2},
}
# GPT2Config.attribute_map: generic names a config may use instead of GPT-2's own.
_GPT2_ALIASES = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer",
                 "num_attention_heads": "n_head", "max_position_embeddings": "n_positions"}


class HFCfg:
    """Config lookup: explicit key, else the class default, else a one-line ValueError."""

    def __init__(self, config: dict, model_type: str):
        self.raw = config
        self.model_type = model_type
        self.defaults = {**_COMMON, **CLASS_DEFAULTS[model_type]}

    def __getitem__(self, key: str) -> object:
        if key in self.raw:
            return self.raw[key]
        if key in self.defaults:
            return self.defaults[key]
        raise ValueError(f"{self.model_type} config is missing required field {key!r}")

    def int(self, key: str) -> int:
        value = self[key]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{self.model_type} config field {key!r} must be a positive "
                             f"integer, got {value!r}")
        return value


_CONFIG_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_TORCH_DTYPES = frozenset((
    "bfloat16 bit bits16 bits1x8 bits2x4 bits4x2 bits8 bool cdouble cfloat chalf complex128 complex32 complex64 "
    "double float float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2 "
    "float8_e5m2fnuz float8_e8m0fnu half int int1 int16 int2 int3 int32 int4 int5 int6 int64 int7 int8 long "
    "qint32 qint8 quint2x4 quint4x2 quint8 short uint1 uint16 uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 "
    "uint8").split())
"""The torch.dtype names of torch 2.13 (`dir(torch)`): PretrainedConfig.__init__ turns a
string `dtype` into `getattr(torch, dtype)`, so any other word fails its load (AttributeError)."""


def checkpoint_dtype(config: dict) -> str | None:
    """The checkpoint's dtype: `dtype` (transformers 5) or `torch_dtype` (4.x), also inside a
    multimodal `text_config`; None when unstated or not a float dtype we model."""
    for cfg in (config, config.get("text_config") if isinstance(config.get("text_config"), dict) else {}):
        for key in ("dtype", "torch_dtype"):
            value = str(cfg.get(key) or "").replace("torch.", "")
            if isinstance(cfg.get(key), str) and value not in _TORCH_DTYPES and value != "auto":
                raise ValueError(f"config field {key!r} must be a torch dtype name (bfloat16, float16, "
                                 f"float32, ...), got {cfg[key]!r}")
            if value in _CONFIG_DTYPES:
                return _CONFIG_DTYPES[value]
    return None


def gpt2_names(config: dict) -> dict:
    """A GPT-2 config with the generic key names (GPT2Config.attribute_map) read as its own."""
    out = dict(config)
    for generic, own in _GPT2_ALIASES.items():
        if generic in out and own not in out:
            out[own] = out.pop(generic)
    return out

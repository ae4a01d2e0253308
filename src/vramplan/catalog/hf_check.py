"""Validation of Hugging Face config values before and after the adapter reads them.

A config.json written by `save_pretrained` holds real JSON numbers and booleans; a
hand-edited or pasted one may hold `"false"` (true to Python) or `"abc"`. Each check
raises a ValueError naming the field and what it must be; `vramplan.sources` turns it
into a SpecError on the `model` field. The shape checks are the ones the real modules
enforce when they are built or run (cited at each).
"""
from __future__ import annotations

import math

from vramplan.model import MAX_LAYERS

_COUNTS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "max_position_embeddings", "n_embd", "n_layer", "n_head",
    "n_positions", "n_inner", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "decoder_sparse_step", "sliding_window", "sliding_window_pattern",
    "type_vocab_size", "num_labels", "d_model", "d_ff", "d_kv", "num_layers", "num_heads",
    "num_decoder_layers", "ffn_dim", "num_kv_heads", "kv_channels", "ffn_hidden_size",
    "word_embed_proj_dim", "relative_attention_num_buckets",
    # DeepSeek-V2/V3 (q_lora_rank null: no query compression), Llama 4, Jamba, Mamba 2
    "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts",
    "attention_chunk_size", "intermediate_size_mlp", "no_rope_layer_interval", "interleave_moe_layer_step",
    "attn_layer_period", "expert_layer_period", "mamba_d_state", "mamba_d_conv", "state_size", "n_groups",
    "conv_kernel", "chunk_size",
)
"""Positive integers (or null where the config class allows it)."""
_COUNTS_OR_ZERO = ("num_experts", "max_window_layers", "pretraining_tp", "n_shared_experts",
                   "first_k_dense_replace", "attn_layer_offset", "expert_layer_offset")
_NOT_NULL = ("num_experts", "sliding_window_pattern", "mamba_expand", "expand", "mamba_dt_rank",
             "attn_layer_period", "attn_layer_offset", "expert_layer_period", "expert_layer_offset")
"""Keys the modules use as numbers when present: null fails in the real module
(range(None) in Qwen2MoeSparseMoeBlock, `(i + 1) % None` in Gemma3TextConfig's layer_types,
`int(None * hidden_size)` in JambaMambaMixer / Mamba2Mixer, `i % None` in JambaConfig's layer
pattern, nn.Linear(None, ...) as Jamba's dt_proj)."""
_AT_MOST = {key: MAX_LAYERS for key in ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers")}
_AT_MOST.update({key: 65536 for key in ("num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts")})
"""Upper bounds far past any published model (model.MAX_LAYERS; the most experts, Switch-C's
(arXiv 2101.03961), are 2,048): the estimate lists every layer's and expert's tensors, so a
typo like 1e9 layers would otherwise run for hours."""
_POSITIVE_NUMBERS = ("mamba_expand", "expand")
"""Finite numbers > 0 (JambaConfig.mamba_expand, Mamba2Config.expand: inner width = expand * hidden)."""
_NON_NEGATIVE_NUMBERS = ("z_loss_weight",)
_SWITCHES = (
    "tie_word_embeddings", "attention_bias", "mlp_bias", "qkv_bias", "norm_topk_prob",
    "use_sliding_window", "qk_layernorm", "use_parallel_residual", "parallel_attn",
    "new_decoder_architecture", "multi_query", "alibi", "bias", "do_layer_norm_before",
    "enable_bias", "layer_norm_elementwise_affine", "apply_residual_connection_post_layernorm",
    "slow_but_exact", "is_encoder_decoder", "no_bias",
)
"""Booleans: the string "false" is true to Python, so a string is refused."""
_PROBABILITIES = (
    "attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob",
    "attention_probs_dropout_prob", "dropout_rate", "dropout", "hidden_dropout", "layerdrop",
    "attn_dropout_prob", "emb_dropout_prob", "rotary_pct", "partial_rotary_factor",
)
_NAMES = ("hidden_act", "activation_function", "hidden_activation", "activation", "feed_forward_proj")
_ACTIVATIONS = ("gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python", "gelu_python_tanh",
                "gelu_pytorch_tanh", "hardswish", "laplace", "leaky_relu", "linear", "mish", "prelu", "quick_gelu",
                "relu", "relu2", "relu6", "sigmoid", "silu", "sqrtsoftplus", "swish", "tanh", "xielu")
"""transformers/activations.py ACT2CLS (transformers 5.24): the modules look their activation
up there (ACT2FN[config.hidden_act]) and raise KeyError for any other name."""


def _field(config: dict, key: str, what: str, value: object) -> ValueError:
    kind = config.get("model_type", "model")
    hint = (" (a string; write it without quotes)" if isinstance(value, str) and what != "a name"
            and "activation" not in what else "")
    return ValueError(f"{kind} config field {key!r} must be {what}, got {value!r}{hint}")


def check_config(config: dict) -> None:
    """Types and ranges of the fields the adapters read; nested text/vision configs too."""
    for key in _COUNTS + _COUNTS_OR_ZERO:
        value = config.get(key)
        low = 0 if key in _COUNTS_OR_ZERO else 1
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise _field(config, key, f"an integer >= {low}", value)
    for key in _SWITCHES:
        value = config.get(key)
        if value is not None and not isinstance(value, bool):
            raise _field(config, key, "true or false", value)
    for key in _NOT_NULL + _PROBABILITIES:
        # nn.Dropout(p=None) and sdpa's dropout_p=None raise TypeError: a null
        # probability is refused like a null count where the module needs a number
        if key in config and config[key] is None:
            raise _field(config, key, "a number (not null)", None)
    for key, limit in _AT_MOST.items():
        value = config.get(key)
        if isinstance(value, int) and value > limit:
            raise _field(config, key, f"at most {limit:,} (no published model has more)", value)
    for key in _POSITIVE_NUMBERS + _NON_NEGATIVE_NUMBERS:
        value = config.get(key)
        if key in config and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value < 0 or (value == 0 and key in _POSITIVE_NUMBERS)):
            raise _field(config, key, "a number > 0" if key in _POSITIVE_NUMBERS else "a number >= 0", value)
    rank = config.get("mamba_dt_rank")
    if "mamba_dt_rank" in config and rank != "auto" and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise _field(config, "mamba_dt_rank", "\"auto\" or an integer >= 1", rank)
    for key in _PROBABILITIES:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or not 0 <= value <= 1):
            raise _field(config, key, "a number in [0, 1]", value)
    for key in _NAMES:
        value = config.get(key)
        if value is not None and not isinstance(value, str):
            raise _field(config, key, "a name", value)
    for key in ("rope_scaling", "rope_parameters"):  # PreTrainedConfig reads them as dicts (.get)
        value = config.get(key)
        if value is not None and not isinstance(value, dict):
            raise _field(config, key, "null or a mapping like {'rope_type': 'linear', 'factor': 2.0}", value)
        factor = (value or {}).get("partial_rotary_factor")
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                   or not math.isfinite(factor) or not 0 <= factor <= 1):
            raise _field(config, f"{key}.partial_rotary_factor", "a number in [0, 1]", factor)
        scale = (value or {}).get("factor")  # the rotary frequencies are divided by it (linear, dynamic, yarn)
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale) or scale <= 0):
            raise _field(config, f"{key}.factor", "a number > 0, e.g. 2.0 (transformers divides the rotary "
                         "frequencies by it; 1 leaves them as they are)", scale)
    _check_activations(config)
    _check_lists(config)
    for key in ("text_config", "vision_config"):
        if isinstance(config.get(key), dict):  # named in its errors as the outer model's sub-config
            check_config({**config[key], "model_type": f"{config.get('model_type', 'model')} {key[:-7]}"})


def _check_activations(config: dict) -> None:
    for key in ("hidden_act", "activation_function", "hidden_activation"):
        value = config.get(key)
        if isinstance(value, str) and value not in _ACTIVATIONS:
            raise _field(config, key, "an activation of transformers' ACT2FN (" + ", ".join(_ACTIVATIONS) + ")", value)
    # T5Config.__init__: "gated-{ACT_FN}" or "{ACT_FN}", else ValueError; null fails on .split
    proj = config.get("feed_forward_proj", "relu")
    act = proj.removeprefix("gated-") if isinstance(proj, str) else None
    if "feed_forward_proj" in config and act not in _ACTIVATIONS:
        raise _field(config, "feed_forward_proj", "an activation of ACT2FN or gated-<activation>, e.g. relu or "
                     "gated-gelu", proj)


def _check_lists(config: dict) -> None:
    layers = config.get("mlp_only_layers")
    if layers is not None and not (isinstance(layers, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)):
        raise _field(config, "mlp_only_layers", "a list of layer indices", layers)
    types = config.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise _field(config, "layer_types", "a list of names like 'sliding_attention'", types)
    # PreTrainedConfig.validate_layer_type: one layer type per layer; Llama4TextDecoderLayer
    # reads config.no_rope_layers[layer_idx], so a shorter list fails there
    layers = config.get("num_hidden_layers")
    for key in ("layer_types", "no_rope_layers"):
        value = config.get(key)
        if isinstance(value, list) and value and isinstance(layers, int) and len(value) != layers:
            raise ValueError(f"{config.get('model_type', 'model')} config field {key!r} has {len(value)} entries; "
                             f"give one per layer ({layers}, num_hidden_layers)")


_TOWER_COUNTS = ("depth", "embed_dim", "spatial_merge_size", "temporal_patch_size", "out_hidden_size",
                 "window_size", "num_channels", "in_channels")
"""Vision-tower sizes (Qwen2-VL's VisionTransformer, SigLIP, CLIP, InternViT): positive integers."""
_TOWER_SIDES = ("image_size", "patch_size")
"""An integer, or [height, width] (InternViT's and SigLIP's configs allow both), at most
MAX_SIDE pixels (the largest published towers read 896)."""
MAX_SIDE = 65536
_TOWER_WIDTHS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_heads", "mlp_ratio")


def check_vlm_config(config: dict) -> object:
    """A vision-language config (gemma3, internvl, llava, llava_onevision, qwen2_vl,
    qwen2_5_vl) before the tower is read: model_type a name, text_config and vision_config
    mappings (the readers merge them over the class defaults), and the tower's sizes as the
    modules need them (nn.Conv2d / nn.Linear of those widths; SiglipAttention and
    InternVLVisionAttention refuse a width that the heads do not divide). Returns the model_type."""
    kind = config.get("model_type")
    if kind is not None and not isinstance(kind, str):
        raise ValueError(f"config field 'model_type' must be a string like 'qwen2_vl', got {kind!r}")
    for key in ("text_config", "vision_config"):
        if key in config and not isinstance(config[key], dict):
            raise _field(config, key, "a mapping of its model's config fields", config[key])
    check_config(config)  # the text fields (at the top for Qwen2-VL), text_config and vision_config
    vision = {"model_type": f"{kind} vision", **config.get("vision_config", {})}
    if not isinstance(vision["model_type"], str):
        raise _field(vision, "model_type", "a name like 'siglip_vision_model'", vision["model_type"])
    for key in _TOWER_WIDTHS + _TOWER_SIDES:  # the readers merge over the defaults: a null stays null
        if key in vision and vision[key] is None:
            raise _field(vision, key, "a number (not null)", None)
    for key in _TOWER_COUNTS + ("mm_tokens_per_image",):
        where = config if key == "mm_tokens_per_image" else vision
        value = where.get(key)
        if key in where and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise _field(where, key, "an integer >= 1", value)
    sides = {}
    for key in _TOWER_SIDES:
        value = vision.get(key)
        pair = value if isinstance(value, list) and len(value) == 2 else [value]
        if key in vision and not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_SIDE
                                     for v in pair):
            raise _field(vision, key, f"an integer in [1, {MAX_SIDE}] (or [height, width])", value)
        sides[key] = min(pair) if key in vision else None
    if sides["image_size"] and sides["patch_size"] and sides["patch_size"] > sides["image_size"]:
        raise _field(vision, "patch_size", f"at most the image_size {sides['image_size']} (a patch inside the image)",
                     vision["patch_size"])
    if isinstance(vision.get("depth"), int) and vision["depth"] > MAX_LAYERS:
        raise _field(vision, "depth", f"at most {MAX_LAYERS:,} (no published model has more)", vision["depth"])
    for key, low, high in (("mlp_ratio", 0, math.inf), ("downsample_ratio", 0, 1)):
        where = config if key in config else vision
        value = where.get(key)
        if key in where and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or not low < value <= high):
            raise _field(where, key, f"a number in ({low}, {high}]", value)
    for key in ("use_qk_norm", "vision_use_head", "use_mask_token", "use_absolute_position_embeddings", "use_mean_pooling"):
        if key in vision and not isinstance(vision[key], bool):
            raise _field(vision, key, "true or false", vision[key])
    if vision.get("norm_type", "layer_norm") not in ("layer_norm", "rms_norm"):  # InternViT's NORM2FN
        raise _field(vision, "norm_type", "layer_norm or rms_norm", vision["norm_type"])
    blocks = vision.get("fullatt_block_indexes")
    if "fullatt_block_indexes" in vision and not (isinstance(blocks, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in blocks)):
        raise _field(vision, "fullatt_block_indexes", "a list of block indices", blocks)
    width = vision.get("embed_dim", vision.get("hidden_size"))
    heads = vision.get("num_heads", vision.get("num_attention_heads"))
    if isinstance(width, int) and isinstance(heads, int) and width % heads:
        raise ValueError(f"{vision['model_type']} config: the width {width} is not a multiple of the {heads} attention "
                         "heads; each head needs a whole share of it")
    return kind


def check_desc(desc):
    """Shapes the real modules refuse, on the adapter's result."""
    kind, a, k = desc.model_type, desc.num_heads, desc.num_kv_heads
    if a % k:
        # transformers modeling_llama.repeat_kv / num_key_value_groups = a // k: every KV
        # head serves the same number of query heads.
        raise ValueError(f"{kind} config: num_attention_heads {a} is not a multiple of "
                         f"num_key_value_heads {k}; each KV head must serve a whole group of query heads")
    if a > desc.hidden_size and getattr(desc, "head_dim", 1) < 1:
        # head_dim = hidden_size // num_attention_heads (modeling_llama.LlamaAttention):
        # more heads than hidden units leaves each head no dimension (Linear(h, 0))
        raise ValueError(f"{kind} config: num_attention_heads {a} exceeds hidden_size {desc.hidden_size}, "
                         f"leaving each head 0 dimensions; give heads that divide the hidden size")
    if desc.model_type in ("gpt2", "bert") and desc.hidden_size % a:
        # GPT2Attention and BertSelfAttention raise ValueError when hidden_size % heads != 0.
        raise ValueError(f"{kind} config: hidden size {desc.hidden_size} is not a multiple of "
                         f"the {a} attention heads")
    moe = desc.moe
    if moe is not None and moe.num_experts and moe.top_k > moe.num_experts:
        # torch.topk(router_logits, top_k) fails when k exceeds the experts.
        raise ValueError(f"{kind} config: num_experts_per_tok {moe.top_k} exceeds the "
                         f"{moe.num_experts} experts; top-k picks among the experts")
    return desc

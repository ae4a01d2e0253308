"""Hugging Face adapter, continued: GPT-NeoX, BLOOM, OPT and Qwen-1 configs -> ModelDesc.

`vramplan.sources.model_from_hf_config` dispatches here (through catalog.hf builtin_desc);
the rules are the same as there (explicit config keys or the defaults of the transformers 5.23 config class, never
ratio guesses; `params` lists `AutoModelForCausalLM.from_config(cfg).named_parameters()`).
These families need a few architecture facts ModelDesc has no field for (partial rotary,
parallel residual, ALiBi, OPT's embedding projection), carried by `ExtendedDesc`.

Qwen-1 (`model_type` "qwen") exists only as remote code (Qwen/Qwen-7B `modeling_qwen.py`,
QWenLMHeadModel); its names and shapes are copied from that file and checked against the
published parameter count of Qwen-7B (tests/test_catalog_more.py).
Legend: h hidden, a heads, d head_dim, f MLP width, v vocab, p OPT word_embed_proj_dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramplan.catalog.hf import _head, _linear, _norm, _with_params
from vramplan.catalog.hf_config import HFCfg
from vramplan.model import MlpKind, ModelDesc, NormKind, ParamEntry, PositionKind


@dataclass(frozen=True, kw_only=True, slots=True)
class ExtendedDesc(ModelDesc):
    """ModelDesc plus the facts of the families in this module."""

    rotary_dim: int = 0
    """Leading channels of each head that get rotary (GPT-NeoX `rotary_pct` * d); 0: none."""
    parallel_residual: bool = False
    """x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX `use_parallel_residual`)."""
    alibi: bool = False
    """ALiBi biases on the attention scores (BLOOM); there is no position table. ModelDesc's
    `position` is then LEARNED only because PositionKind has no ALiBi member."""
    num_layer_norms: int = 2
    """Falcon: norms per layer (1 when attention and MLP share `input_layernorm`)."""
    grouped_qkv: bool = False
    """Falcon `new_decoder_architecture`: qkv laid out per kv group (q heads, k, v)."""
    pre_norm: bool = True
    """OPT `do_layer_norm_before`; False (OPT-350m) normalizes after each residual add."""
    embed_proj_dim: int = 0
    """OPT `word_embed_proj_dim` when it differs from h (project_in / project_out); else 0."""
    num_encoder_layers: int = 0
    """Encoder-decoder (T5, mT5): blocks of the encoder. `num_layers` then counts the blocks
    of both stacks, and ParamEntry.layer is encoder block i -> i, decoder block j -> Le + j;
    0 for decoder-only models."""
    relative_attention_num_buckets: int = 0
    """T5 relative position bias: buckets of the (buckets, a) table in each stack's first block."""
    scale_decoder_outputs: bool = False
    """T5: the decoder output is multiplied by h**-0.5 before lm_head (T5Config.__post_init__:
    unless the config says tie_word_embeddings=False; MT5ForConditionalGeneration never)."""


MORE_MODEL_TYPES = ("gpt_neox", "bloom", "opt", "qwen", "falcon", "t5", "mt5")

# Defaults of the transformers 5.23 config classes (configuration_<family>.py) for the keys
# read below; Qwen-1's from Qwen/Qwen-7B configuration_qwen.py (QWenConfig).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt_neox": {"hidden_act": "gelu", "attention_dropout": 0.0, "hidden_dropout": 0.0,
                 "max_position_embeddings": 2048, "tie_word_embeddings": False,
                 "use_parallel_residual": True, "attention_bias": True, "rotary_pct": 0.25,
                 "rope_parameters": None, "rope_scaling": None},
    "bloom": {"hidden_dropout": 0.0, "attention_dropout": 0.0, "tie_word_embeddings": True,
              "apply_residual_connection_post_layernorm": False, "pretraining_tp": 1,
              "slow_but_exact": False},
    "opt": {"max_position_embeddings": 2048, "do_layer_norm_before": True,
            "_remove_final_layer_norm": False, "word_embed_proj_dim": None, "dropout": 0.1,
            "attention_dropout": 0.0, "activation_function": "relu", "enable_bias": True,
            "layer_norm_elementwise_affine": True, "tie_word_embeddings": True, "layerdrop": 0.0},
    "falcon": {"num_ln_in_parallel_attn": None, "hidden_dropout": 0.0, "attention_dropout": 0.0,
               "num_kv_heads": None, "alibi": False, "new_decoder_architecture": False,
               "multi_query": True, "parallel_attn": True, "bias": False,
               "max_position_embeddings": 2048, "ffn_hidden_size": None, "activation": "gelu",
               "tie_word_embeddings": True},
    # T5Config / MT5Config fields (configuration_t5.py, configuration_mt5.py).
    "t5": {"vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6,
           "num_decoder_layers": None, "num_heads": 8, "relative_attention_num_buckets": 32,
           "dropout_rate": 0.1, "feed_forward_proj": "relu", "tie_word_embeddings": True},
    "mt5": {"vocab_size": 250112, "d_model": 512, "d_kv": 64, "d_ff": 1024, "num_layers": 8,
            "num_decoder_layers": None, "num_heads": 6, "relative_attention_num_buckets": 32,
            "dropout_rate": 0.1, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": True},
    "qwen": {"max_position_embeddings": 8192, "kv_channels": 128, "no_bias": True,
             "tie_word_embeddings": False, "attn_dropout_prob": 0.0, "emb_dropout_prob": 0.0,
             "rotary_pct": 1.0},
}
# BloomConfig's own names (its attribute_map, and the legacy `n_embed` that its __init__
# accepts) -> the generic names read below.
_BLOOM_ALIASES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_embed": "hidden_size"}


class _MoreCfg(HFCfg):
    def __init__(self, config: dict, model_type: str):
        self.raw, self.model_type = config, model_type
        self.defaults = _DEFAULTS[model_type]


def model_from_more(config: dict, name: str, num_labels: int | None) -> ModelDesc:
    mt = config["model_type"]
    if num_labels:
        raise ValueError(f"{mt}: sequence classification is not modelled yet; "
                         "estimate the causal LM (leave num_labels unset)")
    if mt == "bloom":
        config = {(_BLOOM_ALIASES.get(k, k)): v for k, v in config.items()}
    if mt == "falcon":
        config = {({"n_embed": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads"}
                   .get(k, k)): v for k, v in config.items()}  # FalconConfig.attribute_map / n_embed
    build = {"gpt_neox": _gpt_neox, "bloom": _bloom, "opt": _opt, "qwen": _qwen, "falcon": _falcon,
             "t5": _t5, "mt5": _t5}[mt]
    return build(_MoreCfg(config, mt), name)


def _common(c: HFCfg, name: str, h: int, L: int, a: int, f: int) -> dict:
    return dict(name=name, model_type=c.model_type, num_layers=L, hidden_size=h, num_heads=a,
                num_kv_heads=a, head_dim=h // a, intermediate_size=f, vocab_size=c.int("vocab_size"),
                tie_word_embeddings=bool(c["tie_word_embeddings"]), hub_id=c.raw.get("_name_or_path"))


# ---------------------------------------------------------------- GPT-NeoX (Pythia)
def _gpt_neox(c: HFCfg, name: str) -> ModelDesc:
    """GPTNeoXForCausalLM (models/gpt_neox/modeling_gpt_neox.py)."""
    h, L, a = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    f, bias = c.int("intermediate_size"), bool(c["attention_bias"])
    # GPTNeoXConfig.convert_rope_params_to_dict: rope_parameters (or legacy rope_scaling)
    # win; `rotary_pct` fills partial_rotary_factor; GPTNeoXAttention: int(d * factor).
    rope = c["rope_parameters"] or c["rope_scaling"] or {}
    factor = rope.get("partial_rotary_factor", c["rotary_pct"])
    desc = ExtendedDesc(
        **_common(c, name, h, L, a, f), mlp=MlpKind.PLAIN, hidden_act=c["hidden_act"],
        norm=NormKind.LAYERNORM, position=PositionKind.ROPE,
        max_position_embeddings=c.int("max_position_embeddings"), qkv_bias=bias, o_bias=bias,
        mlp_bias=True, fused_qkv=True, attention_dropout=float(c["attention_dropout"]),
        hidden_dropout=float(c["hidden_dropout"]), embedding_dropout=float(c["hidden_dropout"]),
        rotary_dim=int((h // a) * factor), parallel_residual=bool(c["use_parallel_residual"]))
    out = [ParamEntry("gpt_neox.embed_in.weight", (desc.vocab_size, h))]
    for i in range(L):
        p = f"gpt_neox.layers.{i}."
        out += _norm(p + "input_layernorm", h, True, i) + _norm(p + "post_attention_layernorm", h, True, i)
        out += _linear(p + "attention.query_key_value", 3 * h, h, bias, i)
        out += _linear(p + "attention.dense", h, h, bias, i)
        out += _linear(p + "mlp.dense_h_to_4h", f, h, True, i) + _linear(p + "mlp.dense_4h_to_h", h, f, True, i)
    out += _norm("gpt_neox.final_layer_norm", h, True, None) + _head(desc, "lm_head", bias=False)
    return _with_params(desc, out)


# ---------------------------------------------------------------- BLOOM
def _bloom(c: HFCfg, name: str) -> ModelDesc:
    """BloomForCausalLM (models/bloom/modeling_bloom.py): the MLP is always 4h wide."""
    h, L, a = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    if c["pretraining_tp"] > 1 and c["slow_but_exact"]:
        raise ValueError("bloom: slow_but_exact with pretraining_tp > 1 is not modelled")
    desc = ExtendedDesc(
        **_common(c, name, h, L, a, 4 * h), mlp=MlpKind.PLAIN, hidden_act="bloom_gelu",
        norm=NormKind.LAYERNORM, position=PositionKind.LEARNED, max_position_embeddings=0,
        qkv_bias=True, o_bias=True, mlp_bias=True, fused_qkv=True,
        attention_dropout=float(c["attention_dropout"]), hidden_dropout=float(c["hidden_dropout"]),
        alibi=True, pre_norm=not c["apply_residual_connection_post_layernorm"])
    out = [ParamEntry("transformer.word_embeddings.weight", (desc.vocab_size, h))]
    out += _norm("transformer.word_embeddings_layernorm", h, True, None)
    for i in range(L):
        p = f"transformer.h.{i}."
        out += _norm(p + "input_layernorm", h, True, i) + _norm(p + "post_attention_layernorm", h, True, i)
        out += _linear(p + "self_attention.query_key_value", 3 * h, h, True, i)
        out += _linear(p + "self_attention.dense", h, h, True, i)
        out += _linear(p + "mlp.dense_h_to_4h", 4 * h, h, True, i) + _linear(p + "mlp.dense_4h_to_h", h, 4 * h, True, i)
    out += _norm("transformer.ln_f", h, True, None) + _head(desc, "lm_head", bias=False)
    return _with_params(desc, out)


# ---------------------------------------------------------------- OPT
def _opt(c: HFCfg, name: str) -> ModelDesc:
    """OPTForCausalLM (models/opt/modeling_opt.py)."""
    h, L, a = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    f, bias, pos = c.int("ffn_dim"), bool(c["enable_bias"]), c.int("max_position_embeddings")
    if not c["layer_norm_elementwise_affine"]:
        raise ValueError("opt: layer_norm_elementwise_affine=False is not modelled")
    if c["layerdrop"]:
        raise ValueError("opt: layerdrop > 0 skips random layers; not modelled")
    p_dim = c["word_embed_proj_dim"] or h  # OPTConfig.__post_init__: None -> hidden_size
    pre_norm = bool(c["do_layer_norm_before"])
    desc = ExtendedDesc(
        **_common(c, name, h, L, a, f), mlp=MlpKind.PLAIN, hidden_act=c["activation_function"],
        norm=NormKind.LAYERNORM, position=PositionKind.LEARNED, max_position_embeddings=pos,
        qkv_bias=bias, o_bias=bias, mlp_bias=bias, attention_dropout=float(c["attention_dropout"]),
        hidden_dropout=float(c["dropout"]), pre_norm=pre_norm,
        embed_proj_dim=p_dim if p_dim != h else 0)
    d = "model.decoder."
    # OPTLearnedPositionalEmbedding: offset of 2 rows.
    out = [ParamEntry(d + "embed_tokens.weight", (desc.vocab_size, p_dim)),
           ParamEntry(d + "embed_positions.weight", (pos + 2, h))]
    if p_dim != h:
        out += _linear(d + "project_out", p_dim, h, False, None) + _linear(d + "project_in", h, p_dim, False, None)
    if pre_norm and not c["_remove_final_layer_norm"]:
        out += _norm(d + "final_layer_norm", h, True, None)
    for i in range(L):
        p = f"{d}layers.{i}."
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            out += _linear(f"{p}self_attn.{proj}", h, h, bias, i)
        out += _norm(p + "self_attn_layer_norm", h, True, i) + _norm(p + "final_layer_norm", h, True, i)
        out += _linear(p + "fc1", f, h, bias, i) + _linear(p + "fc2", h, f, bias, i)
    if not desc.tie_word_embeddings:
        out += _linear("lm_head", desc.vocab_size, p_dim, False, None)
    return _with_params(desc, out)


# ---------------------------------------------------------------- Qwen-1 (remote code)
def _qwen(c: HFCfg, name: str) -> ModelDesc:
    """QWenLMHeadModel (Qwen/Qwen-7B modeling_qwen.py): QWenAttention's `c_attn` is one
    Linear(h, 3 * a * kv_channels, bias=True), `c_proj` has bias = not no_bias; QWenMLP is
    SwiGLU with w1 (up), w2 (gate, through silu) of width intermediate_size // 2 and
    c_proj back to h; RMSNorm ln_1, ln_2, ln_f; untied lm_head. The first Qwen-7B release
    named the width `ffn_hidden_size` (same meaning); either key is read."""
    h, L, a = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    width_key = "intermediate_size" if "intermediate_size" in c.raw else "ffn_hidden_size"
    d, f = c.int("kv_channels"), c.int(width_key) // 2
    bias = not c["no_bias"]
    desc = ExtendedDesc(
        **(_common(c, name, h, L, a, f) | {"head_dim": d}), mlp=MlpKind.GATED, hidden_act="silu",
        norm=NormKind.RMSNORM, position=PositionKind.ROPE,
        max_position_embeddings=c.int("max_position_embeddings"), qkv_bias=True, o_bias=bias,
        mlp_bias=bias, fused_qkv=True, attention_dropout=float(c["attn_dropout_prob"]),
        embedding_dropout=float(c["emb_dropout_prob"]), rotary_dim=int(d * c["rotary_pct"]))
    out = [ParamEntry("transformer.wte.weight", (desc.vocab_size, h))]
    for i in range(L):
        p = f"transformer.h.{i}."
        out += _norm(p + "ln_1", h, False, i) + _linear(p + "attn.c_attn", 3 * a * d, h, True, i)
        out += _linear(p + "attn.c_proj", h, a * d, bias, i) + _norm(p + "ln_2", h, False, i)
        out += _linear(p + "mlp.w1", f, h, bias, i) + _linear(p + "mlp.w2", f, h, bias, i)
        out += _linear(p + "mlp.c_proj", h, f, bias, i)
    out += _norm("transformer.ln_f", h, False, None) + _head(desc, "lm_head", bias=False)
    return _with_params(desc, out)


# ---------------------------------------------------------------- Falcon
def _falcon(c: HFCfg, name: str) -> ModelDesc:
    """FalconForCausalLM (models/falcon/modeling_falcon.py) with rotary (alibi=False):
    Falcon-7B (multi_query, parallel_attn, one norm) and the new decoder architecture of
    Falcon-40B/180B (num_kv_heads groups, ln_attn and ln_mlp)."""
    h, L, a = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    if c["alibi"]:
        raise ValueError("falcon: alibi=True (Falcon-RW) is not modelled yet")
    new, parallel, bias = bool(c["new_decoder_architecture"]), bool(c["parallel_attn"]), bool(c["bias"])
    d, f = h // a, c["ffn_hidden_size"] or 4 * h  # FalconConfig.__post_init__: 4h when unset
    # FalconAttention: kv heads of the fused projection.
    k = (c["num_kv_heads"] or a) if new else (1 if c["multi_query"] else a)
    # FalconDecoderLayer.__init__: two norms unless parallel with num_ln_in_parallel_attn != 2.
    n_ln = c["num_ln_in_parallel_attn"] or (2 if new else None)
    norms = 2 if not parallel or n_ln == 2 else 1
    desc = ExtendedDesc(
        **(_common(c, name, h, L, a, f) | {"num_kv_heads": k}), mlp=MlpKind.PLAIN,
        hidden_act=c["activation"], norm=NormKind.LAYERNORM, position=PositionKind.ROPE,
        max_position_embeddings=c.int("max_position_embeddings"), qkv_bias=bias, o_bias=bias,
        mlp_bias=bias, fused_qkv=True, attention_dropout=float(c["attention_dropout"]),
        hidden_dropout=float(c["hidden_dropout"]), rotary_dim=d, parallel_residual=parallel,
        num_layer_norms=norms, grouped_qkv=new)
    out = [ParamEntry("transformer.word_embeddings.weight", (desc.vocab_size, h))]
    for i in range(L):
        p = f"transformer.h.{i}."
        out += _linear(p + "self_attention.query_key_value", (a + 2 * k) * d, h, bias, i)
        out += _linear(p + "self_attention.dense", h, h, bias, i)
        out += _linear(p + "mlp.dense_h_to_4h", f, h, bias, i) + _linear(p + "mlp.dense_4h_to_h", h, f, bias, i)
        names = (("input_layernorm", "post_attention_layernorm") if not parallel
                 else ("ln_attn", "ln_mlp") if norms == 2 else ("input_layernorm",))
        for n in names:
            out += _norm(p + n, h, True, i)
    out += _norm("transformer.ln_f", h, True, None) + _head(desc, "lm_head", bias=False)
    return _with_params(desc, out)


# ---------------------------------------------------------------- T5, mT5 (encoder-decoder)
def _t5(c: HFCfg, name: str) -> ModelDesc:
    """T5ForConditionalGeneration / MT5ForConditionalGeneration (models/t5/modeling_t5.py,
    models/mt5/modeling_mt5.py): `shared` embedding, encoder and decoder T5Stacks of T5Blocks
    (self-attention, the decoder's cross-attention `EncDecAttention`, T5LayerFF), each layer
    with its T5LayerNorm (RMS, weight only); no biases anywhere. `relative_attention_bias`
    lives in block 0 of each stack. transformers 5.23 ties lm_head to `shared` always
    (T5Config/MT5Config.__post_init__ force tie_word_embeddings=True), so lm_head is not a
    parameter of its own even for v1.1 checkpoints that say tie_word_embeddings=false; that
    flag only turns off T5's h**-0.5 rescale of the decoder output.
    feed_forward_proj "relu" (T5 v1.0): DenseReluDense wi, wo; "gated-<act>" (v1.1, mT5, T0,
    Flan-T5): wi_0 (through the activation; "gated-gelu" means gelu_new), wi_1, wo."""
    h, a, d, f = c.int("d_model"), c.int("num_heads"), c.int("d_kv"), c.int("d_ff")
    Le = c.int("num_layers")
    Ld = c["num_decoder_layers"] or Le  # T5Config.__post_init__: symmetric by default
    proj = c["feed_forward_proj"]
    gated, act = proj.startswith("gated-"), proj.split("-")[-1]
    act = "gelu_new" if proj == "gated-gelu" else act
    buckets, drop = c.int("relative_attention_num_buckets"), float(c["dropout_rate"])
    desc = ExtendedDesc(
        name=name, model_type=c.model_type, is_encoder=False, num_layers=Le + Ld, hidden_size=h,
        num_heads=a, num_kv_heads=a, head_dim=d, intermediate_size=f, vocab_size=c.int("vocab_size"),
        mlp=MlpKind.GATED if gated else MlpKind.PLAIN, hidden_act=act, norm=NormKind.RMSNORM,
        # relative position buckets, no position table (PositionKind has no member for it)
        position=PositionKind.LEARNED, max_position_embeddings=0, tie_word_embeddings=True,
        attention_dropout=drop, hidden_dropout=drop, embedding_dropout=drop,
        hub_id=c.raw.get("_name_or_path"), num_encoder_layers=Le,
        relative_attention_num_buckets=buckets,
        scale_decoder_outputs=c.model_type == "t5" and c.raw.get("tie_word_embeddings") is not False)
    out = [ParamEntry("shared.weight", (desc.vocab_size, h))]
    for stack, n, first in (("encoder", Le, 0), ("decoder", Ld, Le)):
        for j in range(n):
            out += _t5_block(f"{stack}.block.{j}.layer.", first + j, h, (a, d), f, gated,
                             buckets if j == 0 else 0, cross=stack == "decoder")
        out += _norm(f"{stack}.final_layer_norm", h, False, None)
    return _with_params(desc, out)


def _t5_block(p: str, i: int, h: int, heads: tuple[int, int], f: int, gated: bool, buckets: int,
              cross: bool) -> list[ParamEntry]:
    """T5Block: layer.0 T5LayerSelfAttention, (decoder) layer.1 T5LayerCrossAttention, then
    T5LayerFF; each attention has q, k, v (a*d, h) and o (h, a*d) without bias, and the
    first block's self-attention the (buckets, a) relative_attention_bias embedding."""
    a, d = heads
    inner, out = a * d, []
    for k, attn in enumerate(("SelfAttention", "EncDecAttention") if cross else ("SelfAttention",)):
        for proj in ("q", "k", "v"):
            out += _linear(f"{p}{k}.{attn}.{proj}", inner, h, False, i)
        out += _linear(f"{p}{k}.{attn}.o", h, inner, False, i)
        if k == 0 and buckets:
            out.append(ParamEntry(f"{p}0.SelfAttention.relative_attention_bias.weight", (buckets, a), i))
        out += _norm(f"{p}{k}.layer_norm", h, False, i)
    ff = f"{p}{2 if cross else 1}."
    wi = [("wi_0", f), ("wi_1", f)] if gated else [("wi", f)]
    for leaf, width in wi:
        out += _linear(f"{ff}DenseReluDense.{leaf}", width, h, False, i)
    out += _linear(f"{ff}DenseReluDense.wo", h, f, False, i)
    return out + _norm(f"{ff}layer_norm", h, False, i)

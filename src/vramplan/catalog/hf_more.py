"""Hugging Face adapter, continued: GPT-NeoX, BLOOM, OPT and Qwen-1 configs -> ModelDesc.

`vramplan.catalog.hf.model_from_hf_config` dispatches here; the rules are the same as
there (explicit config keys or the defaults of the transformers 5.23 config class, never
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

from vramplan.catalog.hf import _Cfg, _head, _linear, _norm, _with_params
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


MORE_MODEL_TYPES = ("gpt_neox", "bloom", "opt", "qwen", "falcon")

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
    "qwen": {"max_position_embeddings": 8192, "kv_channels": 128, "no_bias": True,
             "tie_word_embeddings": False, "attn_dropout_prob": 0.0, "emb_dropout_prob": 0.0,
             "rotary_pct": 1.0},
}
# BloomConfig's own names (its attribute_map, and the legacy `n_embed` that its __init__
# accepts) -> the generic names read below.
_BLOOM_ALIASES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_embed": "hidden_size"}


class _MoreCfg(_Cfg):
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
    build = {"gpt_neox": _gpt_neox, "bloom": _bloom, "opt": _opt, "qwen": _qwen, "falcon": _falcon}[mt]
    return build(_MoreCfg(config, mt), name)


def _common(c: _Cfg, name: str, h: int, L: int, a: int, f: int) -> dict:
    return dict(name=name, model_type=c.model_type, num_layers=L, hidden_size=h, num_heads=a,
                num_kv_heads=a, head_dim=h // a, intermediate_size=f, vocab_size=c.int("vocab_size"),
                tie_word_embeddings=bool(c["tie_word_embeddings"]), hub_id=c.raw.get("_name_or_path"))


# ---------------------------------------------------------------- GPT-NeoX (Pythia)
def _gpt_neox(c: _Cfg, name: str) -> ModelDesc:
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
def _bloom(c: _Cfg, name: str) -> ModelDesc:
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
def _opt(c: _Cfg, name: str) -> ModelDesc:
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
def _qwen(c: _Cfg, name: str) -> ModelDesc:
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
def _falcon(c: _Cfg, name: str) -> ModelDesc:
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

"""Llama-4 text config -> ModelDesc (Llama4ForCausalLM, transformers 5.24
models/llama4/modeling_llama4.py, configuration_llama4.py Llama4TextConfig).

Llama4TextDecoderLayer: input_layernorm, Llama4TextAttention (q/k/v/o with
`attention_bias`, explicit head_dim; no parameters in its L2 qk-norm), post_attention_layernorm,
and `feed_forward`: on the layers in `moe_layers` a Llama4TextMoe -- `router` (E, h),
`experts.gate_up_proj` (E, h, 2m) and `experts.down_proj` (E, m, h) (stored as bmm
operands, not nn.Linear), and a `shared_expert` SwiGLU of width m -- else a dense SwiGLU of
width `intermediate_size_mlp`. Llama4TextConfig.__post_init__ fills the per-layer lists:
`no_rope_layers[i]` (1: rotary, 0: NoPE; default every `no_rope_layer_interval`-th layer
is NoPE), `moe_layers` (default every `interleave_moe_layer_step`-th layer) and
`layer_types` (rotary layers use chunked attention of `attention_chunk_size` tokens, NoPE
layers full attention). The multimodal `llama4` config is read through its `text_config`.
Legend: h hidden, a heads, k KV heads, d head_dim, m expert width, f dense MLP width,
E experts, v vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

from vramplan.families.common import Cfg, FamilyDesc, linear, norm, with_params
from vramplan.model import MlpKind, ModelDesc, MoEDesc, NormKind, ParamEntry, PositionKind

# Llama4TextConfig fields and defaults (the Llama-4-Scout-17B-16E text model).
DEFAULTS = {"vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
            "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
            "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
            "max_position_embeddings": 4096 * 32, "tie_word_embeddings": False, "attention_dropout": 0.0,
            "num_experts_per_tok": 1, "num_local_experts": 16, "moe_layers": None,
            "interleave_moe_layer_step": 1, "use_qk_norm": True, "no_rope_layers": None,
            "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "layer_types": None,
            "attn_temperature_tuning": True, "attention_bias": False}


@dataclass(frozen=True, kw_only=True, slots=True)
class Llama4Desc(FamilyDesc):
    """What ModelDesc has no field for."""

    rope_layers: tuple[int, ...] = ()
    """Layers with rotary (no_rope_layers[i] == 1); the others are NoPE."""
    chunked_layers: tuple[int, ...] = ()
    """Layers of layer_type `chunked_attention`."""
    attention_chunk_size: int = 0
    use_qk_norm: bool = False
    """Llama4TextL2Norm (no weight) on q and k of the rotary layers."""
    attn_temperature_tuning: bool = False
    """NoPE layers scale q by log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1."""

    softmax_in_input_dtype: bool = True
    """models/llama4 eager_attention_forward "doesn't cast attn weights to fp32"."""

    lora_refused_modules: tuple[str, ...] = ("router",)
    """Llama4Router (an nn.Linear returning a tuple) breaks PEFT's LoRA Linear (validity)."""

    def local_window_of(self, i: int) -> int | None:
        """Chunked attention: SDPA gets a mask once the sequence reaches the chunk (the
        window arch.sdpa_gets_mask reads)."""
        return self.attention_chunk_size if i in self.chunked_layers else None

    def layer_kind(self, i: int) -> str:
        return "rope" if i in self.rope_layers else "nope"


def build(config: dict, name: str, num_labels: int | None) -> ModelDesc:
    if config.get("model_type") == "llama4":  # multimodal: the language model only
        config = {**config.get("text_config", {}), "model_type": "llama4_text"}
    if num_labels:
        raise ValueError("llama4_text has no sequence-classification model in transformers 5.24 "
                         "(no Llama4ForSequenceClassification); drop num_labels")
    c = Cfg(config, "llama4_text", DEFAULTS)
    h, L, a = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    k, d = c["num_key_value_heads"] or a, c["head_dim"] or h // a
    interval, step = c.int("no_rope_layer_interval"), c.int("interleave_moe_layer_step")
    # Llama4TextConfig.__post_init__: an empty or missing list takes the default pattern
    use_rope = c["no_rope_layers"] or [int((i + 1) % interval != 0) for i in range(L)]
    moe_layers = c["moe_layers"] if c["moe_layers"] is not None else list(range(step - 1, L, step))
    chunk = c["attention_chunk_size"]
    types = c["layer_types"] or ["chunked_attention" if r and chunk is not None else "full_attention"
                                 for r in use_rope]
    m, E = c.int("intermediate_size"), c.int("num_local_experts")
    bias = bool(c["attention_bias"])
    desc = Llama4Desc(
        name=name, model_type="llama4_text", num_layers=L, hidden_size=h, num_heads=a, num_kv_heads=k,
        head_dim=d, intermediate_size=c.int("intermediate_size_mlp"), vocab_size=c.int("vocab_size"),
        mlp=MlpKind.GATED, hidden_act=c["hidden_act"], norm=NormKind.RMSNORM, position=PositionKind.ROPE,
        max_position_embeddings=c.int("max_position_embeddings"),
        tie_word_embeddings=bool(c["tie_word_embeddings"]), qkv_bias=bias, o_bias=bias,
        attention_dropout=float(c["attention_dropout"]), hub_id=c.raw.get("_name_or_path"),
        moe=MoEDesc(num_experts=E, top_k=c.int("num_experts_per_tok"), expert_intermediate_size=m,
                    num_shared_experts=1, shared_intermediate_size=m),
        moe_layers=tuple(moe_layers), rope_layers=tuple(i for i in range(L) if use_rope[i]),
        chunked_layers=tuple(i for i in range(L) if types[i] == "chunked_attention"),
        attention_chunk_size=chunk or 0, use_qk_norm=bool(c["use_qk_norm"]),
        attn_temperature_tuning=bool(c["attn_temperature_tuning"]))
    out = [ParamEntry("model.embed_tokens.weight", (desc.vocab_size, h))]
    for i in range(L):
        p = f"model.layers.{i}."
        for proj, width in (("q_proj", a * d), ("k_proj", k * d), ("v_proj", k * d)):
            out += linear(p + "self_attn." + proj, width, h, bias, i)
        out += linear(p + "self_attn.o_proj", h, a * d, bias, i)
        out += _moe(p + "feed_forward.", h, E, m, i) if i in desc.moe_layers else \
            _mlp(p + "feed_forward.", h, desc.intermediate_size, i)
        out += norm(p + "input_layernorm", h, False, i) + norm(p + "post_attention_layernorm", h, False, i)
    out += norm("model.norm", h, False, None)
    if not desc.tie_word_embeddings:
        out += linear("lm_head", desc.vocab_size, h, False, None)
    return with_params(desc, out)


def _mlp(p: str, h: int, f: int, i: int) -> list[ParamEntry]:
    return linear(p + "gate_proj", f, h, False, i) + linear(p + "up_proj", f, h, False, i) + \
        linear(p + "down_proj", h, f, False, i)


def _moe(p: str, h: int, E: int, m: int, i: int) -> list[ParamEntry]:
    return [ParamEntry(p + "experts.gate_up_proj", (E, h, 2 * m), i),
            ParamEntry(p + "experts.down_proj", (E, m, h), i), ParamEntry(p + "router.weight", (E, h), i),
            *_mlp(p + "shared_expert.", h, m, i)]

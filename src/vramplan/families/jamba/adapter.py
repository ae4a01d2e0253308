"""Jamba config -> ModelDesc (JambaForCausalLM, transformers 5.24).

JambaConfig.layers_block_type: layer i is attention when i % attn_layer_period ==
attn_layer_offset, else Mamba; layers_num_experts: layer i has the MoE feed-forward when
i % expert_layer_period == expert_layer_offset, else a dense SwiGLU (JambaMLP).
Attention (JambaAttention): q/k/v/o without bias and without rotary (Jamba has no
position encoding). Mamba (JambaMambaMixer): in_proj (h -> 2I), depthwise conv1d (I, 1, K)
with bias when `mamba_conv_bias`, x_proj (I -> R + 2N, no bias), dt_proj (R -> I, bias),
A_log (I, N), D (I), out_proj (I -> h), `mamba_proj_bias` on in/out_proj, and RMSNorms on
dt (R), B and C (N). MoE: router.weight (E, h), experts gate_up_proj (E, 2f, h) and
down_proj (E, h, f). Norms: input_layernorm and pre_ff_layernorm per layer, final_layernorm.
Legend: h hidden, a heads, k KV heads, d head_dim, f MLP / expert width, I = expand*h,
N mamba_d_state, R mamba_dt_rank (ceil(h / 16) for "auto"), K mamba_d_conv, E experts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from vramplan.families.common import Cfg, FamilyDesc, head, linear, norm, with_params
from vramplan.model import MlpKind, ModelDesc, MoEDesc, NormKind, ParamEntry, PositionKind

# JambaConfig fields and defaults (models/jamba/configuration_jamba.py).
DEFAULTS = {"vocab_size": 65536, "tie_word_embeddings": False, "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
            "max_position_embeddings": 262144, "attention_dropout": 0.0, "num_experts_per_tok": 2,
            "num_experts": 16, "expert_layer_period": 2, "expert_layer_offset": 1, "attn_layer_period": 8,
            "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
            "mamba_dt_rank": "auto", "mamba_conv_bias": True, "mamba_proj_bias": False}


@dataclass(frozen=True, kw_only=True, slots=True)
class JambaDesc(FamilyDesc):
    """What ModelDesc has no field for: which layers are Mamba and the Mamba widths."""

    attention_layers: tuple[int, ...] = ()
    mamba_inner: int = 0
    """I = mamba_expand * h."""
    state_size: int = 16
    dt_rank: int = 0
    conv_kernel: int = 4

    def layer_kind(self, i: int) -> str:
        return "attention" if i in self.attention_layers else "mamba"


def build(config: dict, name: str, num_labels: int | None) -> ModelDesc:
    c = Cfg(config, "jamba", DEFAULTS, {"num_local_experts": "num_experts"})
    h, L, a = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    k = c["num_key_value_heads"] or a
    f, E = c.int("intermediate_size"), c.int("num_experts")
    for period, offset in (("attn_layer_period", "attn_layer_offset"), ("expert_layer_period", "expert_layer_offset")):
        if c[offset] >= c.int(period):  # JambaConfig.validate_architecture
            raise ValueError(f"jamba config: {offset} ({c[offset]}) must be smaller than {period} ({c[period]})")
    attn = tuple(i for i in range(L) if i % c["attn_layer_period"] == c["attn_layer_offset"])
    moe_layers = tuple(i for i in range(L) if E > 1 and i % c["expert_layer_period"] == c["expert_layer_offset"])
    rank = c["mamba_dt_rank"]
    desc = JambaDesc(
        name=name, model_type="jamba", num_layers=L, hidden_size=h, num_heads=a, num_kv_heads=k, head_dim=h // a,
        intermediate_size=f, vocab_size=c.int("vocab_size"), mlp=MlpKind.GATED, hidden_act=c["hidden_act"],
        norm=NormKind.RMSNORM, position=PositionKind.ROPE, max_position_embeddings=c.int("max_position_embeddings"),
        tie_word_embeddings=bool(c["tie_word_embeddings"]), attention_dropout=float(c["attention_dropout"]),
        num_labels=num_labels or 0, hub_id=c.raw.get("_name_or_path"),
        moe=MoEDesc(num_experts=E, top_k=c.int("num_experts_per_tok"), expert_intermediate_size=f) if moe_layers else None,
        moe_layers=moe_layers, attention_layers=attn, mamba_inner=int(c["mamba_expand"] * h),
        state_size=c.int("mamba_d_state"), dt_rank=math.ceil(h / 16) if rank == "auto" else int(rank),
        conv_kernel=c.int("mamba_d_conv"))
    out = [ParamEntry("model.embed_tokens.weight", (desc.vocab_size, h))]
    for i in range(L):
        p = f"model.layers.{i}."
        out += _attention(desc, p + "self_attn.", i) if i in attn else _mamba(desc, p + "mamba.", i, c)
        out += _moe(desc, p + "feed_forward.", i) if i in moe_layers else _mlp(p + "feed_forward.", h, f, i)
        out += norm(p + "input_layernorm", h, False, i) + norm(p + "pre_ff_layernorm", h, False, i)
    out += norm("model.final_layernorm", h, False, None) + head(desc)
    return with_params(desc, out)


def _attention(d: JambaDesc, p: str, i: int) -> list[ParamEntry]:
    h, a, k, hd = d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim
    return (linear(p + "q_proj", a * hd, h, False, i) + linear(p + "k_proj", k * hd, h, False, i)
            + linear(p + "v_proj", k * hd, h, False, i) + linear(p + "o_proj", h, a * hd, False, i))


def _mamba(d: JambaDesc, p: str, i: int, c: Cfg) -> list[ParamEntry]:
    h, inner, N, R = d.hidden_size, d.mamba_inner, d.state_size, d.dt_rank
    bias = bool(c["mamba_proj_bias"])
    out = [ParamEntry(p + "conv1d.weight", (inner, 1, d.conv_kernel), i)]
    out += [ParamEntry(p + "conv1d.bias", (inner,), i)] if c["mamba_conv_bias"] else []
    out += linear(p + "in_proj", 2 * inner, h, bias, i) + linear(p + "x_proj", R + 2 * N, inner, False, i)
    out += linear(p + "dt_proj", inner, R, True, i)
    out += [ParamEntry(p + "A_log", (inner, N), i), ParamEntry(p + "D", (inner,), i)]
    out += linear(p + "out_proj", h, inner, bias, i)
    return out + norm(p + "dt_layernorm", R, False, i) + norm(p + "b_layernorm", N, False, i) + norm(p + "c_layernorm", N, False, i)


def _mlp(p: str, h: int, f: int, i: int) -> list[ParamEntry]:
    return linear(p + "gate_proj", f, h, False, i) + linear(p + "up_proj", f, h, False, i) + linear(p + "down_proj", h, f, False, i)


def _moe(d: JambaDesc, p: str, i: int) -> list[ParamEntry]:
    E, f, h = d.moe.num_experts, d.moe.expert_intermediate_size, d.hidden_size
    return [ParamEntry(p + "router.weight", (E, h), i), ParamEntry(p + "experts.gate_up_proj", (E, 2 * f, h), i),
            ParamEntry(p + "experts.down_proj", (E, h, f), i)]

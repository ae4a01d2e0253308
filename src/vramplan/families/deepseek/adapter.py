"""DeepSeek-V2 / V3 config -> ModelDesc (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM,
transformers 5.24).

Multi-head latent attention (DeepseekV3Attention.__init__): q is `q_proj` (h -> a*qk) or,
with `q_lora_rank`, q_a_proj (h -> qr), q_a_layernorm (RMS), q_b_proj (qr -> a*qk);
k and v come from one compressed latent, kv_a_proj_with_mqa (h -> kvr + r), kv_a_layernorm
(RMS over kvr), kv_b_proj (kvr -> a*(nope + dv)); o_proj (a*dv -> h). q_a, kv_a and o take
`attention_bias`. Layers i >= first_k_dense_replace have the MoE block: router `gate.weight`
(E, h), experts stored as 3-D gate_up_proj (E, 2m, h) and down_proj (E, h, m), and one
shared SwiGLU of width m * n_shared_experts (`shared_experts`). V3's router also holds the
`e_score_correction_bias` buffer (E fp32 values), not a parameter. V3's multi-token
prediction layer (num_nextn_predict_layers) is not built by transformers (its weights are
ignored on load: `_keys_to_ignore_on_load_unexpected`).
Legend: h hidden, a heads, qk = nope + r per-head q/k width, r rotary width, dv v width,
qr q_lora_rank, kvr kv_lora_rank, f dense MLP width, m expert width, E routed experts.
"""
from __future__ import annotations

from dataclasses import dataclass

from vramplan.families.common import Cfg, FamilyDesc, head, linear, norm, with_params
from vramplan.model import MlpKind, ModelDesc, MoEDesc, NormKind, ParamEntry, PositionKind

_COMMON = {"num_key_value_heads": None, "hidden_act": "silu", "tie_word_embeddings": False,
           "attention_bias": False, "attention_dropout": 0.0, "kv_lora_rank": 512,
           "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "norm_topk_prob": False, "n_group": None, "topk_group": None}
# Config class defaults (configuration_deepseek_v2.py / configuration_deepseek_v3.py).
DEFAULTS = {
    "deepseek_v2": {**_COMMON, "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
                    "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
                    "mlp_bias": False, "first_k_dense_replace": 0, "n_routed_experts": 64,
                    "n_shared_experts": 2, "routed_scaling_factor": 1.0, "topk_method": "greedy",
                    "num_experts_per_tok": None, "moe_intermediate_size": 1407},
    "deepseek_v3": {**_COMMON, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
                    "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
                    "max_position_embeddings": 4096, "rope_interleave": True, "mlp_bias": False},
}
ALIASES = {"deepseek_v2": {"num_experts": "n_routed_experts"},
           "deepseek_v3": {"num_local_experts": "n_routed_experts"}}


@dataclass(frozen=True, kw_only=True, slots=True)
class MLADesc(FamilyDesc):
    """The latent-attention widths ModelDesc has no field for. `head_dim` holds qk."""

    q_lora_rank: int = 0
    """0: a plain q_proj."""
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    """V3: rotary on interleaved pairs (apply_rotary_pos_emb_interleave)."""
    sigmoid_router: bool = False
    """V3: sigmoid scores with the group-limited choice; V2: softmax."""


def build(config: dict, name: str, num_labels: int | None) -> ModelDesc:
    mt = config["model_type"]
    c = Cfg(config, mt, DEFAULTS[mt], ALIASES[mt])
    h, L, a = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    nope, r, dv = c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim"), c.int("v_head_dim")
    qr, kvr = c["q_lora_rank"] or 0, c.int("kv_lora_rank")
    m, E = c.int("moe_intermediate_size"), c.int("n_routed_experts")
    shared = c.get("n_shared_experts", 0)
    first_dense = c.get("first_k_dense_replace", 0)
    moe = MoEDesc(num_experts=E, top_k=c.int("num_experts_per_tok"), expert_intermediate_size=m,
                  num_shared_experts=1 if shared else 0, shared_intermediate_size=m * shared,
                  norm_topk_prob=bool(c["norm_topk_prob"]))
    mlp_bias = bool(c["mlp_bias"]) if mt == "deepseek_v2" else False
    desc = MLADesc(
        name=name, model_type=mt, num_layers=L, hidden_size=h, num_heads=a,
        num_kv_heads=c["num_key_value_heads"] or a, head_dim=nope + r,
        intermediate_size=c.int("intermediate_size"), vocab_size=c.int("vocab_size"),
        mlp=MlpKind.GATED, hidden_act=c["hidden_act"], norm=NormKind.RMSNORM, position=PositionKind.ROPE,
        max_position_embeddings=c.int("max_position_embeddings"),
        tie_word_embeddings=bool(c["tie_word_embeddings"]), qkv_bias=bool(c["attention_bias"]),
        o_bias=bool(c["attention_bias"]), mlp_bias=mlp_bias,
        attention_dropout=float(c["attention_dropout"]), num_labels=num_labels or 0,
        moe=moe, moe_layers=tuple(range(first_dense, L)), hub_id=c.raw.get("_name_or_path"),
        rotary_dim=r, q_lora_rank=qr, kv_lora_rank=kvr, qk_nope_head_dim=nope, v_head_dim=dv,
        rope_interleave=mt == "deepseek_v3" and bool(c["rope_interleave"]),
        sigmoid_router=mt == "deepseek_v3")
    out = [ParamEntry("model.embed_tokens.weight", (desc.vocab_size, h))]
    for i in range(L):
        p = f"model.layers.{i}."
        out += _attention(desc, p + "self_attn.", i)
        out += _moe(desc, p + "mlp.", i) if i in desc.moe_layers else _mlp(p + "mlp.", h, desc.intermediate_size, mlp_bias, i)
        out += norm(p + "input_layernorm", h, False, i) + norm(p + "post_attention_layernorm", h, False, i)
    out += norm("model.norm", h, False, None) + head(desc)
    return with_params(desc, out)


def _attention(d: MLADesc, p: str, i: int) -> list[ParamEntry]:
    h, a, qk, bias = d.hidden_size, d.num_heads, d.head_dim, d.qkv_bias
    if d.q_lora_rank:
        out = (linear(p + "q_a_proj", d.q_lora_rank, h, bias, i) + norm(p + "q_a_layernorm", d.q_lora_rank, False, i)
               + linear(p + "q_b_proj", a * qk, d.q_lora_rank, False, i))
    else:
        out = linear(p + "q_proj", a * qk, h, False, i)
    out += linear(p + "kv_a_proj_with_mqa", d.kv_lora_rank + d.rotary_dim, h, bias, i)
    out += norm(p + "kv_a_layernorm", d.kv_lora_rank, False, i)
    out += linear(p + "kv_b_proj", a * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank, False, i)
    return out + linear(p + "o_proj", h, a * d.v_head_dim, d.o_bias, i)


def _mlp(p: str, h: int, f: int, bias: bool, i: int) -> list[ParamEntry]:
    return (linear(p + "gate_proj", f, h, bias, i) + linear(p + "up_proj", f, h, bias, i)
            + linear(p + "down_proj", h, f, bias, i))


def _moe(d: MLADesc, p: str, i: int) -> list[ParamEntry]:
    moe, h = d.moe, d.hidden_size
    E, m = moe.num_experts, moe.expert_intermediate_size
    out = [ParamEntry(p + "experts.gate_up_proj", (E, 2 * m, h), i),
           ParamEntry(p + "experts.down_proj", (E, h, m), i), ParamEntry(p + "gate.weight", (E, h), i)]
    if moe.num_shared_experts:
        out += _mlp(p + "shared_experts.", h, moe.shared_intermediate_size, d.mlp_bias, i)
    return out

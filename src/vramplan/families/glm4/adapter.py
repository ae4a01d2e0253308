"""GLM-4 config -> ModelDesc (Glm4ForCausalLM, transformers 5.24).

Glm4DecoderLayer: four RMSNorms (input_layernorm, post_self_attn_layernorm,
post_attention_layernorm, post_mlp_layernorm); Glm4Attention q/k/v with
`attention_bias` (True by default), o_proj without bias, head_dim explicit (128);
Glm4MLP one gate_up_proj (h -> 2f) and down_proj, no bias. Rotary on the first
int(d * partial_rotary_factor) channels, the factor defaulting to 0.5
(Glm4Config.__post_init__).
Legend: h hidden, a heads, k KV heads, d head_dim, f MLP width, v vocab.
"""
from __future__ import annotations

from vramplan.families import rotary_factor
from vramplan.families.common import Cfg, FamilyDesc, head, linear, norm, with_params
from vramplan.model import MlpKind, ModelDesc, NormKind, ParamEntry, PositionKind

# Glm4Config fields and defaults (models/glm4/configuration_glm4.py).
DEFAULTS = {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40,
            "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "hidden_act": "silu",
            "attention_dropout": 0.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
            "attention_bias": True}


def build(config: dict, name: str, num_labels: int | None) -> ModelDesc:
    c = Cfg(config, "glm4", DEFAULTS)
    h, L, a = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    k, d, f = c.int("num_key_value_heads"), c["head_dim"] or h // a, c.int("intermediate_size")
    bias = bool(c["attention_bias"])
    desc = FamilyDesc(
        name=name, model_type="glm4", num_layers=L, hidden_size=h, num_heads=a, num_kv_heads=k, head_dim=d,
        intermediate_size=f, vocab_size=c.int("vocab_size"), mlp=MlpKind.GATED, hidden_act=c["hidden_act"],
        norm=NormKind.RMSNORM, position=PositionKind.ROPE, max_position_embeddings=c.int("max_position_embeddings"),
        tie_word_embeddings=bool(c["tie_word_embeddings"]), qkv_bias=bias, fused_gate_up=True,
        sandwich_norm=True, attention_dropout=float(c["attention_dropout"]), num_labels=num_labels or 0,
        hub_id=c.raw.get("_name_or_path"), rotary_dim=int(d * rotary_factor(config, 0.5)))
    out = [ParamEntry("model.embed_tokens.weight", (desc.vocab_size, h))]
    for i in range(L):
        p = f"model.layers.{i}."
        for proj, width in (("q_proj", a * d), ("k_proj", k * d), ("v_proj", k * d)):
            out += linear(p + "self_attn." + proj, width, h, bias, i)
        out += linear(p + "self_attn.o_proj", h, a * d, False, i)
        out += linear(p + "mlp.gate_up_proj", 2 * f, h, False, i) + linear(p + "mlp.down_proj", h, f, False, i)
        for n in ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"):
            out += norm(p + n, h, False, i)
    out += norm("model.norm", h, False, None) + head(desc)
    return with_params(desc, out)

"""GPTBigCode config -> ModelDesc (GPTBigCodeForCausalLM, transformers 5.24).

GPT-2's layout with nn.Linear (not Conv1D) and multi-query attention: `c_attn` is one
Linear(h, h + 2 * kv_heads * d) with kv_heads 1 under `multi_query` (the default);
learned positions `wpe`; LayerNorm ln_1, ln_2, ln_f; MLP c_fc (h -> n_inner or 4h),
c_proj; lm_head tied to wte by default.
Legend: h hidden, a heads, d head_dim, f MLP width, v vocab.
"""
from __future__ import annotations

from vramplan.families.common import Cfg, FamilyDesc, head, linear, norm, with_params
from vramplan.model import MlpKind, ModelDesc, NormKind, ParamEntry, PositionKind

# GPTBigCodeConfig fields and defaults (models/gpt_bigcode/configuration_gpt_bigcode.py).
DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
            "n_inner": None, "activation_function": "gelu_pytorch_tanh", "resid_pdrop": 0.1,
            "embd_pdrop": 0.1, "attn_pdrop": 0.1, "multi_query": True,
            "add_cross_attention": False, "tie_word_embeddings": True}
# GPTBigCodeConfig.attribute_map: the generic names a config may use.
ALIASES = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions",
           "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}


def build(config: dict, name: str, num_labels: int | None) -> ModelDesc:
    c = Cfg(config, "gpt_bigcode", DEFAULTS, ALIASES)
    if c["add_cross_attention"]:
        raise ValueError("gpt_bigcode: add_cross_attention=True is not modelled")
    h, L, a = c.int("n_embd"), c.int("n_layer"), c.int("n_head")
    d, k = h // a, 1 if c["multi_query"] else a
    f = c["n_inner"] or 4 * h  # GPTBigCodeBlock.inner_dim
    pos = c.int("n_positions")
    desc = FamilyDesc(
        name=name, model_type="gpt_bigcode", num_layers=L, hidden_size=h, num_heads=a,
        num_kv_heads=k, head_dim=d, intermediate_size=f, vocab_size=c.int("vocab_size"),
        mlp=MlpKind.PLAIN, hidden_act=c["activation_function"], norm=NormKind.LAYERNORM,
        position=PositionKind.LEARNED, max_position_embeddings=pos,
        tie_word_embeddings=bool(c["tie_word_embeddings"]), qkv_bias=True, o_bias=True,
        mlp_bias=True, fused_qkv=True, attention_dropout=float(c["attn_pdrop"]),
        hidden_dropout=float(c["resid_pdrop"]), embedding_dropout=float(c["embd_pdrop"]),
        num_labels=num_labels or 0, hub_id=c.raw.get("_name_or_path"),
        # GPTBigCodeModel.__init__: register_buffer("bias", tril(ones(n_positions, n_positions,
        # dtype=bool)), persistent=False)
        buffer_bytes=pos * pos)
    out = [ParamEntry("transformer.wte.weight", (desc.vocab_size, h)),
           ParamEntry("transformer.wpe.weight", (desc.max_position_embeddings, h))]
    for i in range(L):
        p = f"transformer.h.{i}."
        out += norm(p + "ln_1", h, True, i) + linear(p + "attn.c_attn", h + 2 * k * d, h, True, i)
        out += linear(p + "attn.c_proj", h, h, True, i) + norm(p + "ln_2", h, True, i)
        out += linear(p + "mlp.c_fc", f, h, True, i) + linear(p + "mlp.c_proj", h, f, True, i)
    out += norm("transformer.ln_f", h, True, None) + head(desc)
    return with_params(desc, out)

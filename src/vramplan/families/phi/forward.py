"""Phi on the symbolic recorder: transformers 5.24 models/phi/modeling_phi.py.

PhiDecoderLayer: one LayerNorm feeds both the attention and the MLP (parallel residual);
`resid_dropout` is applied to each branch's output, then attn + mlp + residual.
PhiAttention: q/k/v projections (with bias) viewed (b, a, s, d) and transposed, optional
q/k LayerNorm, rotary on the first `rotary_ndims` channels then `torch.cat` back to a
contiguous (b, a, s, d), the attention interface, and `dense`.
Legend: b micro-batch, s sequence, h hidden, a heads, k KV heads, d head_dim.
"""
from __future__ import annotations

from vramplan.components.arch import Ctx, activation, lin
from vramplan.components.arch_extended import rotary_cat_attention
from vramplan.components.graph import Recorder, Sym

LAYER_PREFIX = "model.layers"



def layer(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    pre = f"{LAYER_PREFIX}.{i}"
    h = rec.layer_norm(x, ctx.p(f"{pre}.input_layernorm.weight"), "attn_norm")
    drop = ctx.module_p(ctx.desc.hidden_dropout)
    attn = rec.dropout(attention(rec, ctx, h, i, b, s), drop, "attn/resid_dropout")
    # PhiMLP: fc1 -> activation (gelu_new for every published Phi) -> fc2; PhiDecoderLayer.forward
    # holds the norm's output and `attn_outputs` through it, and `residual`, the layer's input
    # (which a checkpoint keeps and LayerNorm saves: counted there)
    # and, under eager attention, the attention weights it binds to `_`
    weights = ctx.shared_keys.pop("attn_weights", None)
    held = [h, attn] + ([weights] if weights is not None else [])
    rec.frame += held
    m = lin(rec, ctx, h, f"{pre}.mlp.fc1", "mlp/fc")
    m = lin(rec, ctx, activation(rec, m, ctx.desc.hidden_act, "mlp/act"), f"{pre}.mlp.fc2", "mlp/proj")
    del rec.frame[-len(held):]
    m = rec.dropout(m, drop, "mlp/dropout")
    branches = rec.add(attn, m, name="branches")
    y = rec.add(branches, x, name="mlp_residual")
    rec.forward_moment(h, attn, m, branches, y)  # `attn_outputs + feed_forward_hidden_states + residual`
    return y


def attention(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    """The cat after partial rotary makes q and k contiguous (b, a, s, d), so the SDPA
    output follows that layout and `reshape(...).contiguous()` copies it before `dense`
    (the same as GPT-NeoX, components/arch_extended.py gpt_neox_attention)."""
    desc, pre = ctx.desc, f"{LAYER_PREFIX}.{i}.self_attn"
    a, k, d = desc.num_heads, desc.num_kv_heads, desc.head_dim
    q = rec.view(lin(rec, ctx, x, f"{pre}.q_proj", "attn/q"), (b, a, s, d))
    kk = rec.view(lin(rec, ctx, x, f"{pre}.k_proj", "attn/k"), (b, k, s, d))
    v = rec.view(lin(rec, ctx, x, f"{pre}.v_proj", "attn/v"), (b, k, s, d))
    if desc.qk_norm:  # nn.LayerNorm(h // a) on each head
        q = rec.layer_norm(q, ctx.p(f"{pre}.q_layernorm.weight"), "attn/q_norm")
        kk = rec.layer_norm(kk, ctx.p(f"{pre}.k_layernorm.weight"), "attn/k_norm")
    return rotary_cat_attention(rec, ctx, q, kk, v, b, s, f"{pre}.dense")


def embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    """PhiModel.forward: embed_tokens, then embed_dropout (embd_pdrop)."""
    x = rec.embedding(ids, ctx.p("model.embed_tokens.weight"), "embed/tokens")
    return rec.dropout(x, ctx.module_p(ctx.desc.embedding_dropout), "embed/dropout")


def head(rec: Recorder, ctx: Ctx, x: Sym) -> Sym:
    """final_layernorm, then lm_head (Linear with bias), or `score` (no bias) for
    PhiForSequenceClassification."""
    h = rec.layer_norm(x, ctx.p("model.final_layernorm.weight"), "final_norm")
    for module in ("score", "lm_head"):
        if f"{module}.weight" in ctx.params:
            return lin(rec, ctx, h, module, "logits")
    # tied: the embedding's weight with lm_head's own bias
    return rec.linear(h, ctx.p("model.embed_tokens.weight"), ctx.opt("lm_head.bias"), name="logits")

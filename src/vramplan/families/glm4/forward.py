"""GLM-4 on the symbolic recorder (transformers 5.24 models/glm4/modeling_glm4.py).

Glm4DecoderLayer: x + post_self_attn_layernorm(attn(input_layernorm(x))), then
+ post_mlp_layernorm(mlp(post_attention_layernorm(.))). Glm4Attention: q/k/v views,
rotary on the first r channels (interleaved rotate_half, products with the constant
cos/sin: nothing of the layer saved) and `torch.cat` back to contiguous (b, a, s, d)
q and k, so the attention output follows that layout and `reshape().contiguous()`
copies it before o_proj (as for Phi and GPT-NeoX). Glm4MLP: gate_up_proj chunked into
two views, up * act(gate), down_proj.
Legend: b micro-batch, s sequence, h hidden, a heads, k KV heads, d head_dim.
"""
from __future__ import annotations

from vramplan.components.arch import Ctx, lin, mlp_shared, rms_norm
from vramplan.components.arch_extended import rotary_cat_attention
from vramplan.components.graph import Recorder, Sym

LAYER_PREFIX = "model.layers"


def layer(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    pre = f"{LAYER_PREFIX}.{i}"
    h = rms_norm(rec, ctx, x, f"{pre}.input_layernorm", "attn_norm")
    h = rms_norm(rec, ctx, attention(rec, ctx, h, i, b, s), f"{pre}.post_self_attn_layernorm", "attn_post_norm")
    x = rec.add(x, h, name="attn_residual")
    h = rms_norm(rec, ctx, x, f"{pre}.post_attention_layernorm", "mlp_norm")
    h = mlp_shared(rec, ctx, h, f"{pre}.mlp")  # fused gate_up (desc.fused_gate_up)
    h = rms_norm(rec, ctx, h, f"{pre}.post_mlp_layernorm", "mlp_post_norm")
    return rec.add(x, h, name="mlp_residual")


def attention(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    desc, pre = ctx.desc, f"{LAYER_PREFIX}.{i}.self_attn"
    a, k, d = desc.num_heads, desc.num_kv_heads, desc.head_dim
    q = rec.view(lin(rec, ctx, x, f"{pre}.q_proj", "attn/q"), (b, a, s, d))
    kk = rec.view(lin(rec, ctx, x, f"{pre}.k_proj", "attn/k"), (b, k, s, d))
    v = rec.view(lin(rec, ctx, x, f"{pre}.v_proj", "attn/v"), (b, k, s, d))
    return rotary_cat_attention(rec, ctx, q, kk, v, b, s, f"{pre}.o_proj")


def embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    return rec.embedding(ids, ctx.p("model.embed_tokens.weight"), "embed/tokens")


def head(rec: Recorder, ctx: Ctx, x: Sym) -> Sym:
    h = rms_norm(rec, ctx, x, "model.norm", "final_norm")
    w = ctx.params.get("lm_head.weight") or ctx.params.get("score.weight") or ctx.p("model.embed_tokens.weight")
    return rec.linear(h, w, name="logits")

"""GPTBigCode on the symbolic recorder: transformers 5.24 models/gpt_bigcode/modeling_gpt_bigcode.py.

GPTBigCodeBlock: ln_1, attention (c_attn -> q, k, v as views of its output; the
attention interface; c_proj; resid_dropout), residual add, ln_2, MLP (c_fc, activation,
c_proj, dropout), residual add. Under multi_query, k and v are one head wide: SDPA gets
`enable_gqa` (transformers integrations/sdpa_attention.py use_gqa_in_sdpa) and eager
repeats them (repeat_kv copies). The attention output is laid out like q, a transposed
view of c_attn's (b, s, .) output, so `reshape(...).contiguous()` copies nothing.
Legend: b micro-batch, s sequence, h hidden, a heads, k KV heads, d head_dim.
"""
from __future__ import annotations

from vramplan.components.arch import Ctx, activation, attention_core, lin
from vramplan.components.graph import Recorder, Sym

LAYER_PREFIX = "transformer.h"



def layer(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    desc, pre = ctx.desc, f"{LAYER_PREFIX}.{i}"
    drop = ctx.module_p(desc.hidden_dropout)
    h = rec.layer_norm(x, ctx.p(f"{pre}.ln_1.weight"), "attn_norm")
    a, k, d = desc.num_heads, desc.num_kv_heads, desc.head_dim
    qkv = lin(rec, ctx, h, f"{pre}.attn.c_attn", "attn/qkv")
    q = rec.view(qkv, (b, a, s, d), "attn/q")
    kk, v = (rec.view(qkv, (b, k, s, d), f"attn/{n}") for n in "kv")
    out = attention_core(rec, ctx, q, kk, v, "attn/core")
    out = lin(rec, ctx, rec.view(out, (b, s, a * d)), f"{pre}.attn.c_proj", "attn/o")
    out = rec.dropout(out, drop, "attn/resid_dropout")
    x = rec.add(out, x, name="attn_residual")
    normed = rec.layer_norm(x, ctx.p(f"{pre}.ln_2.weight"), "mlp_norm")
    rec.frame += [out, x, normed]  # GPTBigCodeBlock.forward's locals through the MLP
    h = lin(rec, ctx, normed, f"{pre}.mlp.c_fc", "mlp/fc")
    h = lin(rec, ctx, activation(rec, h, desc.hidden_act, "mlp/act"), f"{pre}.mlp.c_proj", "mlp/proj")
    del rec.frame[-3:]
    h = rec.dropout(h, drop, "mlp/dropout")
    y = rec.add(x, h, name="mlp_residual")
    # GPTBigCodeBlock.forward's locals live to its return, as GPT-2's (arch_gpt2_bert.gpt2_block)
    rec.forward_moment(out, x, normed, h, y)
    return y


def embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    """GPTBigCodeModel.forward: wte(ids) + wpe(position_ids), then `drop` (embd_pdrop)."""
    tok = rec.embedding(ids, ctx.p("transformer.wte.weight"), "embed/tokens")
    pos = rec.new("position_ids", (1, ids.shape[1]), "int64", False)
    xp = rec.embedding(pos, ctx.p("transformer.wpe.weight"), "embed/positions")
    # `inputs_embeds` and `position_embeds` stay locals of GPTBigCodeModel.forward while the blocks run
    ctx.shared_keys["model_locals"] = [(t.name, t.storage.nbytes) for t in (tok, xp)]
    x = rec.add(tok, xp, name="embed/sum")
    return rec.dropout(x, ctx.module_p(ctx.desc.embedding_dropout), "embed/dropout")


def head(rec: Recorder, ctx: Ctx, x: Sym) -> Sym:
    h = rec.layer_norm(x, ctx.p("transformer.ln_f.weight"), "final_norm")
    for module in ("score", "lm_head"):
        if f"{module}.weight" in ctx.params:
            return lin(rec, ctx, h, module, "logits")
    return rec.linear(h, ctx.p("transformer.wte.weight"), name="logits")  # tied

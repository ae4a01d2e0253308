"""InternLM2 on the symbolic recorder, from InternLM2DecoderLayer, InternLM2Attention /
InternLM2SdpaAttention and InternLM2ForCausalLM.forward in the internlm2_5-* repositories'
modeling_internlm2.py (repository code; read, never run).

Where it saves what Llama does not:
- `wqkv` is one linear; q is cut from its (b, s, k, a/k + 2, d) view and merged back with
  `rearrange(q, "b q h gs d -> b q (h gs) d")`, a reshape of a non-contiguous slice, so a
  (b, s, a, d) copy; k and v stay views of the fused output. Both attention classes call
  `repeat_kv` on k and v (no enable_gqa), which copies them to a heads when a > k; with
  a == k it returns v itself, and the attention then keeps the whole fused output alive.
- every layer's own rotary module (`self.rotary_emb(value_states, position_ids)`) makes its
  cos and sin, (1, s, d) in v's dtype, which the rotary products save: per layer, not once.
- the loss: `logits = logits.float()`, then `shift_logits = logits[..., :-1, :].contiguous()`
  and CrossEntropyLoss (components/shifted_loss.py, kind "float").
Legend: b micro-batch, s sequence, h hidden, a heads, k KV heads, d head_dim.
"""
from __future__ import annotations

from dataclasses import replace

from vramplan.components.arch import Ctx, activation, attention_core, lin, rms_norm, rope
from vramplan.components.graph import Recorder, Sym

LAYER_PREFIX = "model.layers"
LOSS_KIND = "float"


def layer(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    pre = f"{LAYER_PREFIX}.{i}"
    h = rms_norm(rec, ctx, x, f"{pre}.attention_norm", "attn_norm")
    x = rec.add(x, attention(rec, ctx, h, i, b, s), name="attn_residual")
    h = rms_norm(rec, ctx, x, f"{pre}.ffn_norm", "mlp_norm")
    # InternLM2MLP: w2(act(w1(x)) * w3(x))
    gate = lin(rec, ctx, h, f"{pre}.feed_forward.w1", "mlp/gate")
    up = lin(rec, ctx, h, f"{pre}.feed_forward.w3", "mlp/up")
    prod = rec.mul(activation(rec, gate, ctx.desc.hidden_act, "mlp/act"), up, name="mlp/act_times_up")
    return rec.add(x, lin(rec, ctx, prod, f"{pre}.feed_forward.w2", "mlp/down"), name="mlp_residual")


def attention(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    desc, pre = ctx.desc, f"{LAYER_PREFIX}.{i}.attention"
    a, k, d = desc.num_heads, desc.num_kv_heads, desc.head_dim
    qkv = lin(rec, ctx, x, f"{pre}.wqkv", "attn/qkv")
    q = rec.new("attn/q_merged", (b, a, s, d), qkv.dtype, qkv.requires_grad)  # rearrange copies
    kk, v = rec.view(qkv, (b, k, s, d), "attn/k"), rec.view(qkv, (b, k, s, d), "attn/v")
    # InternLM2RotaryEmbedding.forward: position_ids (1, s) -> cos, sin (1, s, d) in v's dtype
    cos = rec.new("attn/rotary_cos", (1, s, d), v.dtype, False)
    sin = rec.new("attn/rotary_sin", (1, s, d), v.dtype, False)
    q, kk = rope(rec, q, cos, sin, "attn/q_rope"), rope(rec, kk, cos, sin, "attn/k_rope")
    # eager and SDPA call repeat_kv (the repository code predates enable_gqa); the class is the
    # config's (adapter.ATTENTION), whatever the job's `attention` says
    attn = desc.attn_implementation or ctx.attention
    own = replace(ctx, gqa_native=attn == "flash", attention=attn)  # InternLM2FlashAttention2: no repeat_kv
    out = attention_core(rec, own, q, kk, v, "attn/core")
    return lin(rec, ctx, rec.view(out, (b, s, a * d)), f"{pre}.wo", "attn/o")


def embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    return rec.embedding(ids, ctx.p("model.tok_embeddings.weight"), "embed/tokens")


def head(rec: Recorder, ctx: Ctx, x: Sym) -> Sym:
    h = rms_norm(rec, ctx, x, "model.norm", "final_norm")
    w = ctx.params.get("output.weight") or ctx.p("model.tok_embeddings.weight")
    return rec.linear(h, w, name="logits")

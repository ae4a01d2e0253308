"""Baichuan 2 on the symbolic recorder, from the baichuan-inc/Baichuan2-7B-* and -13B-*
repositories' modeling_baichuan.py (repository code; read, never run), without xformers
(the files call xops.memory_efficient_attention in training only when it imports).

Where it saves what Llama does not:
- RMSNorm: `hidden_states * torch.rsqrt(variance)` multiplies the input itself (not its fp32
  copy) by the fp32 statistics, so a 16-bit model also keeps the 16-bit input.
- `W_pack` output viewed as q, k, v: whatever keeps a view (v in the 7B's SDPA, q, k and v in
  the 13B's matmuls) keeps the whole (b, s, 3h) output.
- 7B: apply_rotary_pos_emb gathers `cos[position_ids]`, `sin[position_ids]` (1, s, d) fp32 in
  every layer (saved by the products) and computes q, k in fp32 (`q.float()`), then back;
  BaichuanModel._prepare_decoder_attention_mask builds one (b, 1, s, s) float mask in the
  model dtype, which every F.scaled_dot_product_attention call keeps for backward.
- 13B: `attention_mask` is the ALiBi bias (a, s, s) in the model dtype (BaichuanModel
  caches it in `self.alibi_mask` across steps: families.step_buffers); each layer computes
  softmax(max(q k^T / sqrt(d) + bias, finfo.min)) v with torch ops, so torch.maximum keeps its
  (b, a, s, s) input and softmax its (b, a, s, s) output.
- lm_head is a NormHead: `F.linear(x, F.normalize(self.weight))` in training keeps the
  normalized (v, h) copy of the weight and the (v, 1) norms.
- the loss: shift_logits contiguous copy, cross-entropy on 16-bit logits, plus z-loss on
  `shift_logits.max(-1)` (components/shifted_loss.py, kind "zloss").
Legend: b micro-batch, s sequence, h hidden, a heads, d head_dim, v vocab.
"""
from __future__ import annotations

from vramplan.components.arch import Ctx, lin, mlp_shared, rope
from vramplan.components.graph import Recorder, Sym

LAYER_PREFIX = "model.layers"
LOSS_KIND = "zloss"


def rms_norm(rec: Recorder, ctx: Ctx, x: Sym, module: str, name: str) -> Sym:
    """Baichuan's RMSNorm.forward: x.to(fp32).pow(2).mean, x * rsqrt (fp32 result), .to(weight
    dtype) when that is 16-bit, weight * it."""
    w = ctx.p(module + ".weight")
    sq = rec.unary_saving_input(rec.to(x, "fp32", name=f"{name}.fp32"), f"{name}.pow")
    rstd = rec.unary_saving_output(rec.reduce(sq, x.shape[:-1] + (1,), f"{name}.var"), f"{name}.rstd")
    xhat = rec.mul(x, rstd, name=f"{name}.xhat")
    if w.dtype in ("bf16", "fp16"):
        xhat = rec.to(xhat, w.dtype, name=f"{name}.xhat_cast")
    return rec.mul(xhat, w, name=name)


def layer(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    pre = f"{LAYER_PREFIX}.{i}"
    h = rms_norm(rec, ctx, x, f"{pre}.input_layernorm", "attn_norm")
    x = rec.add(x, attention(rec, ctx, h, i, b, s), name="attn_residual")
    h = rms_norm(rec, ctx, x, f"{pre}.post_attention_layernorm", "mlp_norm")
    return rec.add(x, mlp_shared(rec, ctx, h, f"{pre}.mlp"), name="mlp_residual")


def attention(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    desc, pre = ctx.desc, f"{LAYER_PREFIX}.{i}.self_attn"
    a, d = desc.num_heads, desc.head_dim
    qkv = lin(rec, ctx, x, f"{pre}.W_pack", "attn/qkv")
    q, k, v = (rec.view(qkv, (b, a, s, d), f"attn/{n}") for n in "qkv")
    if desc.alibi:
        out = alibi_attention(rec, ctx, q, k, v, b, s)
        # attn_output.transpose(1, 2).reshape(b, s, h): a copy of matmul's (b, a, s, d) result
        out = rec.new("attn/out_reshaped", (b, s, a * d), out.dtype, out.requires_grad)
    else:  # the fused kernels lay their output out as (b, s, a, d): the reshape is a view
        out = rec.view(rope_attention(rec, ctx, q, k, v, b, s), (b, s, a * d))
    return lin(rec, ctx, out, f"{pre}.o_proj", "attn/o")


def rope_attention(rec: Recorder, ctx: Ctx, q: Sym, k: Sym, v: Sym, b: int, s: int) -> Sym:
    a, d = ctx.desc.num_heads, ctx.desc.head_dim
    cos = rec.new("attn/rotary_cos", (1, 1, s, d), "fp32", False)  # cos[position_ids]: a gather
    sin = rec.new("attn/rotary_sin", (1, 1, s, d), "fp32", False)
    q = rec.to(rope(rec, rec.to(q, "fp32"), cos, sin, "attn/q_rope"), q.dtype, "attn/q_embed")
    k = rec.to(rope(rec, rec.to(k, "fp32"), cos, sin, "attn/k_rope"), k.dtype, "attn/k_embed")
    # the mask every layer's SDPA keeps is one tensor, recorded once by embed()
    return rec.sdpa(q, k, v, (b, s, a, d), "attn/core")


def alibi_attention(rec: Recorder, ctx: Ctx, q: Sym, k: Sym, v: Sym, b: int, s: int) -> Sym:
    a, d = ctx.desc.num_heads, ctx.desc.head_dim
    dtype = rec.autocast or q.dtype
    q, k, v = (rec._autocast_input(t) for t in (q, k, v))
    if q.requires_grad:
        rec.save(q, k, v)  # matmul(q, k^T) keeps q and k, matmul(p, v) keeps v: views of W_pack's output
    scores = rec.scale(rec.new("attn/scores", (b, a, s, s), dtype, q.requires_grad), "attn/scaled")
    biased = rec.new("attn/biased", (b, a, s, s), dtype, scores.requires_grad)  # + alibi (a, s, s)
    if biased.requires_grad:
        rec.save(biased)  # torch.max(x, finfo.min): maximum's backward needs its input
    clamped = rec.new("attn/clamped", biased.shape, dtype, biased.requires_grad)
    probs = rec.unary_saving_output(clamped, "attn/softmax")
    return rec.new("attn/out", (b, a, s, d), dtype, probs.requires_grad)


def embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    """embed_tokens; the 7B's model forward then builds its (b, 1, s, s) causal mask in the
    embeddings' dtype (_prepare_decoder_attention_mask), which every layer's fused SDPA keeps
    for backward (derivatives.yaml _scaled_dot_product_flash_attention_for_cpu /
    _efficient_attention_forward save attn_mask): recorded here, once."""
    x = rec.embedding(ids, ctx.p("model.embed_tokens.weight"), "embed/tokens")
    if not ctx.desc.alibi:
        b, s = ids.shape
        rec.save(rec.new("attention_mask/causal_float", (b, 1, s, s), x.dtype, False))
    return x


def head(rec: Recorder, ctx: Ctx, x: Sym) -> Sym:
    """NormHead.forward in training: F.normalize(weight) = weight / norm.clamp_min(eps).expand,
    then F.linear, which keeps the normalized (v, h) copy whenever its input needs a gradient
    (trained or frozen head alike); the (v, 1) norm and its clamp are kept when the weight
    trains. Under autocast F.linear casts the normalized copy (no leaf: not cached) and keeps
    that cast, which rec.linear records as the weight's cast."""
    h = rms_norm(rec, ctx, x, "model.norm", "final_norm")
    w = ctx.p("lm_head.weight")
    if w.trainable:
        rec.save(rec.new("head/weight_norm", (w.shape[0], 1), w.dtype, False),
                 rec.new("head/weight_norm_clamped", (w.shape[0], 1), w.dtype, False))
    if h.requires_grad and rec.autocast is None:
        rec.save(rec.new("head/normalized_weight", w.shape, w.dtype, False))
    return rec.linear(h, w, name="logits")


def step_buffers(desc, spec) -> int:
    """13B: BaichuanModel.forward in training caches `self.alibi_mask` = (a, s, s) in the
    embeddings' dtype (get_alibi_mask / _buffered_future_mask) and keeps it across steps."""
    if not desc.alibi:
        return 0
    from vramplan.components.dtypes import dtypes_of
    from vramplan.units import nbytes
    return nbytes(desc.num_heads * spec.seq_len * spec.seq_len, dtypes_of(spec).weights)

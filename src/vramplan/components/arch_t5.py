"""T5 and mT5 blocks on the symbolic recorder.

Mirrors transformers 5.23 `models/t5/modeling_t5.py` (mT5's `modeling_mt5.py` is the same
code): T5LayerNorm, T5Attention with the relative position bias made by each stack's first
block and reused by the others, `integrations/sdpa_attention.py` (the bias becomes SDPA's
float mask), T5DenseActDense / T5DenseGatedActDense and the residual dropouts.
The facts ModelDesc has no field for come from `vramplan.catalog.hf_extended.ExtendedDesc`.
Legend: b micro-batch, s sequence (encoder and decoder alike), h d_model, a heads,
d d_kv, f d_ff.
"""
from __future__ import annotations

from vramplan.components.arch import Ctx, activation, lin
from vramplan.components.graph import Recorder, Sym


def _drop(ctx: Ctx) -> float:
    return ctx.module_p(ctx.desc.hidden_dropout)


def t5_norm(rec: Recorder, ctx: Ctx, x: Sym, module: str, name: str) -> Sym:
    """T5LayerNorm.forward: variance = x.to(fp32).pow(2).mean(-1) (pow saves the fp32 copy),
    x * rsqrt(variance) (saves x and the rsqrt; fp32 by promotion), .to(weight dtype) when the
    weight is 16-bit, weight * that (saves it)."""
    w = ctx.p(module + ".weight")
    x32 = rec.to(x, "fp32", name=f"{name}.fp32")
    var = rec.reduce(rec.unary_saving_input(x32, f"{name}.pow"), x.shape[:-1] + (1,), f"{name}.var")
    rstd = rec.unary_saving_output(var, f"{name}.rstd")
    xhat = rec.mul(x, rstd, name=f"{name}.xhat")
    if w.dtype in ("bf16", "fp16"):
        xhat = rec.to(xhat, w.dtype, name=f"{name}.xhat_cast")
    return rec.mul(xhat, w, name=name)


def position_bias(rec: Recorder, ctx: Ctx, stack: str, s: int) -> Sym:
    """T5Attention.compute_bias in the stack's first block: bucket ids (s, s) int64 (saved by
    the embedding when its table trains), relative_attention_bias lookup (s, s, a),
    permute + unsqueeze to a (1, a, s, s) view. Made once; later blocks get it passed in."""
    key = f"{stack}/position_bias"
    if key not in ctx.shared:
        w = ctx.p(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
        buckets = rec.new(f"{stack}/relative_position_bucket", (s, s), "int64", False)
        values = rec.embedding(buckets, w, f"{stack}/position_bias")
        ctx.shared[key] = rec.view(values, (1, ctx.desc.num_heads, s, s))
    return ctx.shared[key]


def _sdpa_mask(rec: Recorder, ctx: Ctx, bias: Sym | None, causal: bool, q: Sym) -> Sym:
    """sdpa_attention_forward's create_position_bias_mask: the decoder's causal mask
    (arange >= arange, a (1, 1, s, s) bool that `torch.where` saves when the bias needs a
    gradient) applied by torch.where, a new (1, a, s, s); the encoder's permuted bias made
    contiguous (a copy, nothing saved); cross-attention's zeros bias passed as is."""
    _, a, s, _ = q.shape
    if bias is None:  # cross-attention: torch.zeros((1, a, s, s)) made by block 0, reused
        if "decoder/cross_bias" not in ctx.shared:
            ctx.shared["decoder/cross_bias"] = rec.new("decoder/cross_bias_zeros", (1, a, s, s), q.dtype, False)
        return ctx.shared["decoder/cross_bias"]
    if causal:
        if bias.requires_grad:
            rec.save(rec.new("attn/causal_mask", (1, 1, s, s), "bool", False))
        return rec.new("attn/bias_mask", (1, a, s, s), bias.dtype, bias.requires_grad)
    return rec.new("attn/bias_contiguous", (1, a, s, s), bias.dtype, bias.requires_grad)


def t5_attention(rec: Recorder, ctx: Ctx, x: Sym, kv_in: Sym, pre: str, bias: Sym | None,
                 causal: bool, b: int, s: int) -> Sym:
    """T5Attention.forward: q from x, k and v from x (self) or the encoder output (cross),
    each viewed (b, a, s, d); scaling 1.0; attention with the bias as an additive mask
    (dropout = dropout_rate in training); reshape, o."""
    a, d = ctx.desc.num_heads, ctx.desc.head_dim
    q, k, v = (rec.view(lin(rec, ctx, src, f"{pre}.{n}", f"attn/{n}"), (b, a, s, d))
               for n, src in (("q", x), ("k", kv_in), ("v", kv_in)))
    drop = ctx.desc.attention_dropout if ctx.training_dropout else 0.0
    if ctx.attention == "eager":
        out = _eager(rec, ctx, q, k, v, bias, causal, drop)
    else:
        mask = _sdpa_mask(rec, ctx, bias, causal, q)
        out = _sdpa(rec, q, k, v, mask, drop)
    return lin(rec, ctx, rec.view(out, (b, s, a * d)), f"{pre}.o", "attn/o")


def _sdpa(rec: Recorder, q: Sym, k: Sym, v: Sym, mask: Sym, drop: float) -> Sym:
    """F.scaled_dot_product_attention with a float attn_mask. On CPU a mask that needs a
    gradient, or dropout, sends it to aten `_scaled_dot_product_attention_math` (recorder's
    _sdpa_math: q, k, v scaled copies, softmax, dropout noise and result); the CPU flash
    kernel otherwise. On CUDA the memory-efficient kernel (the only fused one taking a
    float mask) saves q, k, v, out, the log-sum-exp and the mask (CUDA: not measured here).
    The cross-attention's zeros mask is one tensor shared by the decoder blocks."""
    b, a, s, d = q.shape
    if rec.backend == "cpu" and (drop > 0 or mask.requires_grad):
        # the CPU math path runs bf16/fp16 in fp32 (q, k, v upcast, fp32 softmax and dropout)
        # and casts the (b, a, s, d) result back before transpose(1, 2).contiguous()
        dtype = rec.autocast or q.dtype
        rg = q.requires_grad or k.requires_grad or v.requires_grad or mask.requires_grad
        math = "fp32" if dtype in ("bf16", "fp16") else dtype
        if drop > 0:
            rec._sdpa_math(q, k, v, (b, s, a, d), "attn/core", drop, math, rg)
        elif rg:  # no dropout: scaled q, k^T, v and the softmax
            rec.save(*(rec.new(f"attn/core.{n}", q.shape, math, True) for n in ("q_scaled", "k_scaled_t", "v")))
            rec.save(rec.new("attn/core.softmax", (b, a, s, s), math, False))
        return rec.new("attn/core.out_t", (b, s, a, d), dtype, rg)
    rec.save(mask)  # the fused kernels keep their attn_mask for backward
    return rec.sdpa(q, k, v, (b, s, a, d), "attn/core", dropout=drop)


def _eager(rec: Recorder, ctx: Ctx, q: Sym, k: Sym, v: Sym, bias: Sym | None, causal: bool,
           drop: float) -> Sym:
    """modeling_t5.eager_attention_forward: matmul(q, k^T) (saves both), * 1.0, + bias,
    + the causal mask (decoder), softmax in the scores' dtype (saves its output), dropout,
    matmul with v (saves the dropped probabilities and v), transpose(1, 2).contiguous()."""
    b, a, s, d = q.shape
    q, k, v = (rec._autocast_input(t) for t in (q, k, v))
    dtype = q.dtype
    if k.requires_grad:
        rec.save(q)
    if q.requires_grad:
        rec.save(k)
    rg = q.requires_grad or k.requires_grad or bool(bias is not None and bias.requires_grad)
    scores = rec.new("attn/scores", (b, a, s, s), dtype, rg)
    scores = rec.scale(rec.add(rec.scale(scores, "attn/scaled"), scores, "attn/biased"), "attn/masked")
    probs = rec.unary_saving_output(scores, "attn/softmax")
    probs = rec.dropout(probs, drop, "attn/dropout")
    if v.requires_grad:
        rec.save(probs)
    if probs.requires_grad:
        rec.save(v)
    out = rec.new("attn/out", (b, a, s, d), dtype, probs.requires_grad or v.requires_grad)
    return rec.new("attn/out_t", (b, s, a, d), dtype, out.requires_grad)


def t5_ff(rec: Recorder, ctx: Ctx, x: Sym, pre: str) -> Sym:
    """T5DenseActDense: wo(dropout(act(wi(x)))); T5DenseGatedActDense:
    wo(dropout(act(wi_0(x)) * wi_1(x))). relu saves its output (threshold_backward);
    gelu_new is NewGELUActivation in Python ops."""
    p = f"{pre}.DenseReluDense"
    if ctx.desc.mlp.value == "gated":
        gate = activation(rec, lin(rec, ctx, x, f"{p}.wi_0", "mlp/gate"), ctx.desc.hidden_act, "mlp/act")
        h = rec.mul(gate, lin(rec, ctx, x, f"{p}.wi_1", "mlp/up"), name="mlp/act_times_up")
    elif ctx.desc.hidden_act == "relu":
        h = rec.unary_saving_output(lin(rec, ctx, x, f"{p}.wi", "mlp/fc"), "mlp/act")
    else:
        h = activation(rec, lin(rec, ctx, x, f"{p}.wi", "mlp/fc"), ctx.desc.hidden_act, "mlp/act")
    h = rec.dropout(h, _drop(ctx), "mlp/dropout")
    return lin(rec, ctx, h, f"{p}.wo", "mlp/down")


def t5_block(rec: Recorder, ctx: Ctx, x: Sym, stack: str, j: int, b: int, s: int,
             enc_out: Sym | None) -> Sym:
    """T5Block: T5LayerSelfAttention (norm, attention, x + dropout(out)), in the decoder
    T5LayerCrossAttention over the encoder output, then T5LayerFF (norm, FF, x + dropout)."""
    pre = f"{stack}.block.{j}.layer"
    decoder = stack == "decoder"
    h = t5_norm(rec, ctx, x, f"{pre}.0.layer_norm", "attn_norm")
    h = t5_attention(rec, ctx, h, h, f"{pre}.0.SelfAttention", position_bias(rec, ctx, stack, s), decoder, b, s)
    x = rec.add(x, rec.dropout(h, _drop(ctx), "attn/resid_dropout"), name="attn_residual")
    if decoder:
        h = t5_norm(rec, ctx, x, f"{pre}.1.layer_norm", "cross_norm")
        h = t5_attention(rec, ctx, h, enc_out, f"{pre}.1.EncDecAttention", None, False, b, s)
        x = rec.add(x, rec.dropout(h, _drop(ctx), "cross/resid_dropout"), name="cross_residual")
    ff = f"{pre}.{2 if decoder else 1}"
    h = t5_ff(rec, ctx, t5_norm(rec, ctx, x, f"{ff}.layer_norm", "mlp_norm"), ff)
    return rec.add(x, rec.dropout(h, _drop(ctx), "mlp/resid_dropout"), name="mlp_residual")

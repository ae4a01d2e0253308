"""Flux, SD3 and Wan denoiser blocks on the symbolic recorder.

Mirrors diffusers 0.42:
- `models/transformers/transformer_flux.py` FluxTransformerBlock (double stream: an
  AdaLayerNormZero per stream, separate q/k/v projections per stream with RMSNorm on q and
  k, one attention over cat(text, image) with rotary embeddings, `to_out.0` / `to_add_out`,
  a GELU-tanh FeedForward per stream) and FluxSingleTransformerBlock (one stream over
  cat(text, image): AdaLayerNormZeroSingle, `proj_mlp` + GELU beside the attention,
  `proj_out` over cat(attention, mlp));
- `models/attention.py` JointTransformerBlock of SD3/SD3.5 (the double-stream block without
  rotary; q/k RMSNorm only where `qk_norm` is set; the last block's text stream stops after
  its norm: `context_pre_only`; SD3.5-medium's `dual_attention_layers` add an image-only
  `attn2`);
- `models/transformers/transformer_wan.py` WanTransformerBlock (FP32LayerNorm + a learned
  `scale_shift_table` modulation, self-attention with RMSNorm over all heads and rotary,
  cross-attention to the text states, a GELU-tanh FeedForward of `ffn_dim`).
Legend: b batch, n image/video tokens, m text tokens, T = m + n, h hidden, a heads,
d head dim, f feed-forward width.
"""
from __future__ import annotations

from vramplan.components.arch_dit import DitCtx, _lin, gated
from vramplan.components.graph import Param, Recorder, Sym


def _w(ctx: DitCtx, name: str, shape, trainable: bool | None = None) -> Param:
    return Param(name, tuple(shape), ctx.dtype, ctx.trainable if trainable is None else trainable)


def lin(rec: Recorder, ctx: DitCtx, x: Sym, fan_out: int, name: str, lora: bool = False) -> Sym:
    """A block linear; LoRA on it through arch_dit's one adapter mechanism."""
    return _lin(rec, ctx, x, fan_out, name, lora)


def rms_norm(rec: Recorder, ctx: DitCtx, x: Sym, name: str, torch_rms: bool = False) -> Sym:
    """diffusers RMSNorm (SD3's qk norm): `x.to(fp32).pow(2).mean(-1)`, `x * rsqrt(var + eps)`
    (a 16-bit x times the fp32 rsqrt is fp32, so the product keeps x itself), cast back to
    the weight's dtype, `* weight`. `torch_rms`: torch.nn.RMSNorm (Flux's and Wan's q/k norm;
    aten rms_norm_symint in layer_norm.cpp) multiplies the fp32 upcast instead, so x is not
    kept, applies the weight in fp32 and casts back last."""
    x32 = rec.to(x, "fp32", name=f"{name}.fp32")
    var = rec.reduce(rec.unary_saving_input(x32, f"{name}.pow"), x.shape[:-1] + (1,), f"{name}.var")
    rstd = rec.unary_saving_output(var, f"{name}.rstd")
    w = _w(ctx, f"{name}.weight", (x.shape[-1],))
    if torch_rms:  # `upcast * rsqrt`, `* weight` in fp32, then `.type_as(x)`
        return rec.to(rec.mul(rec.mul(x32, rstd, name=f"{name}.xhat"), w, name=name), x.dtype, name=f"{name}.out")
    y = rec.to(rec.mul(x, rstd, name=f"{name}.xhat"), ctx.dtype, name=f"{name}.xhat_cast")
    return rec.mul(y, w, name=name)


def ada_emb(rec: Recorder, ctx: DitCtx, temb: Sym, chunks: int, name: str) -> Sym:
    """AdaLayerNormZero's `linear(silu(temb))`: (b, chunks * h); its chunks are views."""
    return lin(rec, ctx, rec.unary_saving_input(temb, f"{name}.silu"), chunks * ctx.hidden, f"{name}.linear")


def modulate(rec: Recorder, ctx: DitCtx, x: Sym, emb: Sym, name: str, fp32: bool = False) -> Sym:
    """`norm(x) * (1 + scale) + shift`, the norm without affine weights."""
    h = x.shape[-1]
    normed = rec.layer_norm(rec.to(x, "fp32") if fp32 else x, Param(f"{name}.norm", (h,), ctx.dtype, False), name)
    return scale_shift(rec, normed, emb, name, fp32)


def scale_shift(rec: Recorder, normed: Sym, emb: Sym, name: str, fp32: bool = False) -> Sym:
    """`normed * (1 + scale) + shift`: (1 + scale) is a new (b, 1, h) tensor the product
    saves, as it saves the normed tensor (once, however many modulations read it)."""
    b, h = normed.shape[0], normed.shape[-1]
    one_plus = rec.new(f"{name}.one_plus_scale", (b, 1, h), "fp32" if fp32 else emb.dtype, emb.requires_grad)
    return rec.add(rec.mul(normed, one_plus, name=f"{name}.scaled"), one_plus, name=f"{name}.modulated")


def gate(rec: Recorder, emb: Sym) -> Sym:
    return rec.view(emb, (emb.shape[0], 1, emb.shape[-1]))


def rope(rec: Recorder, x: Sym, name: str) -> Sym:
    """apply_rotary_emb (diffusers embeddings.py): `x.float() * cos + rotated.float() * sin`
    with frozen cos/sin: nothing of x's size saved; a new tensor in x's dtype."""
    return rec.new(name, x.shape, x.dtype, x.requires_grad)


def sliced(rec: Recorder, o: Sym, rows: int, name: str) -> Sym:
    """`o[:, a:b]` then `.contiguous()` (or the linear's reshape): a copy when b > 1."""
    b, _, h = o.shape
    if b == 1:
        return rec.view(o, (b, rows, h), name)
    return rec.new(name, (b, rows, h), o.dtype, o.requires_grad)


def joint_attention(rec: Recorder, ctx: DitCtx, hx: Sym, ht: Sym | None, prefix: str = "attn",
                    rotary: bool = True, qk_norm: bool = True, last: bool = False) -> tuple[Sym, Sym | None]:
    """Flux / SD3 joint attention: per-stream projections, q/k RMSNorm, cat, rotary, SDPA,
    split, output projections."""
    b, n, h = hx.shape
    m = ht.shape[1] if ht is not None else 0
    a, d = ctx.heads, h // ctx.heads
    q, k, v = (rec.view(lin(rec, ctx, hx, h, f"{prefix}.{p}", True), (b, a, n, d)) for p in ("to_q", "to_k", "to_v"))
    if qk_norm:
        q, k = (rms_norm(rec, ctx, t, f"{prefix}.norm_{p}", rotary) for t, p in ((q, "q"), (k, "k")))
    if ht is not None:
        tq, tk, _tv = (rec.view(lin(rec, ctx, ht, h, f"{prefix}.add_{p}_proj"), (b, a, m, d)) for p in "qkv")
        if qk_norm:  # on the (b, a, m, d) heads view, as norm_q / norm_k on the image stream's
            rms_norm(rec, ctx, tq, f"{prefix}.norm_added_q", rotary), rms_norm(rec, ctx, tk, f"{prefix}.norm_added_k", rotary)
        q, k, v = (rec.new(f"{prefix}.cat_{p}", (b, a, m + n, d), hx.dtype, True) for p in "qkv")
    if rotary:
        q, k = rope(rec, q, f"{prefix}.rope_q"), rope(rec, k, f"{prefix}.rope_k")
    o = rec.view(rec.sdpa(q, k, v, (b, m + n, a, d), f"{prefix}/core"), (b, m + n, h))
    if ht is None:
        return o, None
    img = sliced(rec, o, n, f"{prefix}.image_out")
    out = lin(rec, ctx, img, h, f"{prefix}.to_out.0", True)
    if last:
        return out, None
    return out, lin(rec, ctx, sliced(rec, o, m, f"{prefix}.text_out"), h, f"{prefix}.to_add_out")


def feed_forward(rec: Recorder, ctx: DitCtx, x: Sym, name: str) -> Sym:
    """diffusers FeedForward(activation_fn="gelu-approximate"): proj, GELU (saves its
    input), net.2 (saves the GELU output)."""
    f = ctx.ff_dim or ctx.ff_mult * ctx.hidden
    act = rec.unary_saving_input(lin(rec, ctx, x, f, f"{name}.net.0.proj"), f"{name}.gelu")
    return lin(rec, ctx, act, ctx.hidden, f"{name}.net.2")


def double_block(rec: Recorder, ctx: DitCtx, x: Sym, txt: Sym, temb: Sym, rotary: bool = True,
                 qk_norm: bool = True, last: bool = False, dual: bool = False) -> tuple[Sym, Sym | None]:
    """FluxTransformerBlock / JointTransformerBlock over b x n image and b x m text tokens.
    `dual`: SD3.5-medium's MMDiT-X block (attention.py JointTransformerBlock with
    use_dual_attention): SD35AdaLayerNormZeroX (normalization.py) makes 9 chunks and two
    modulations of one LayerNorm output; after the joint attention's residual, `attn2`
    (JointAttnProcessor2_0 without encoder states: the image stream's own q/k/v, q/k norms,
    SDPA, to_out) and `gate_msa2 * attn_output2` join the residual stream."""
    ex = ada_emb(rec, ctx, temb, 9 if dual else 6, "norm1")
    et = ada_emb(rec, ctx, temb, 2 if last else 6, "norm1_context")
    if dual:
        h = x.shape[-1]
        normed = rec.layer_norm(x, Param("norm1.norm", (h,), ctx.dtype, False), "norm1")
        hx, hx2 = scale_shift(rec, normed, ex, "norm1"), scale_shift(rec, normed, ex, "norm1.msa2")
    else:
        hx = modulate(rec, ctx, x, ex, "norm1")
    ht = modulate(rec, ctx, txt, et, "norm1_context")
    ao, at = joint_attention(rec, ctx, hx, ht, rotary=rotary, qk_norm=qk_norm, last=last)
    x = gated(rec, x, ao, gate(rec, ex), "attn")
    if dual:
        o2, _ = joint_attention(rec, ctx, hx2, None, "attn2", rotary=rotary, qk_norm=qk_norm)
        x = gated(rec, x, lin(rec, ctx, o2, x.shape[-1], "attn2.to_out.0", True), gate(rec, ex), "attn2")
    x = gated(rec, x, feed_forward(rec, ctx, modulate(rec, ctx, x, ex, "norm2"), "ff"), gate(rec, ex), "ff")
    if last:
        return x, None
    txt = gated(rec, txt, at, gate(rec, et), "attn_context")
    ff_t = feed_forward(rec, ctx, modulate(rec, ctx, txt, et, "norm2_context"), "ff_context")
    return x, gated(rec, txt, ff_t, gate(rec, et), "ff_context")


def single_block(rec: Recorder, ctx: DitCtx, x: Sym, txt: Sym, temb: Sym) -> Sym:
    """FluxSingleTransformerBlock: cat(text, image), one modulated norm, attention beside
    `proj_mlp` + GELU, `proj_out` over cat(attention, mlp) (saved), gated residual."""
    b, n, h = x.shape
    t = b, n + txt.shape[1], h
    joint = rec.new("single.cat_input", t, x.dtype, True)
    e = ada_emb(rec, ctx, temb, 3, "norm")
    hn = modulate(rec, ctx, joint, e, "norm")
    f = ctx.ff_dim or ctx.ff_mult * h
    rec.unary_saving_input(lin(rec, ctx, hn, f, "proj_mlp"), "act_mlp")
    o, _ = joint_attention(rec, ctx, hn, None)
    cat = rec.new("single.cat_attn_mlp", t[:2] + (h + f,), x.dtype, True)
    return gated(rec, joint, lin(rec, ctx, cat, h, "proj_out"), gate(rec, e), "single")


def wan_block(rec: Recorder, ctx: DitCtx, x: Sym, txt: Sym, temb: Sym) -> Sym:
    """WanTransformerBlock: `scale_shift_table + temb.float()` chunks modulate FP32LayerNorms;
    self-attention (RMSNorm over all heads on q and k, rotary), cross-attention (q from the
    video, k and v from the text states; RMSNorm on q and k), FeedForward of ffn_dim; the
    residuals are computed in fp32 and cast back (`.type_as`)."""
    b, n, h = x.shape
    a, d = ctx.heads, h // ctx.heads
    e = rec.new("scale_shift", (b, 6, h), "fp32", ctx.trainable)
    hx = rec.to(modulate(rec, ctx, x, e, "norm1", fp32=True), x.dtype)
    q, k = (rms_norm(rec, ctx, lin(rec, ctx, hx, h, f"attn1.to_{p}", True), f"attn1.norm_{p}", True) for p in "qk")
    v = lin(rec, ctx, hx, h, "attn1.to_v", True)
    q, k, v = (rec.view(t, (b, a, n, d)) for t in (rope(rec, q, "attn1.rope_q"), rope(rec, k, "attn1.rope_k"), v))
    o = rec.view(rec.sdpa(q, k, v, (b, n, a, d), "attn1/core"), (b, n, h))
    ao = lin(rec, ctx, o, h, "attn1.to_out.0", True)
    x = rec.to(gated(rec, rec.to(x, "fp32"), ao, gate(rec, e), "attn1"), x.dtype)
    # norm2: FP32LayerNorm with affine weights (cross_attn_norm)
    n2 = rec.to(rec.layer_norm(rec.to(x, "fp32"), Param("norm2", (h,), ctx.dtype, ctx.trainable), "norm2"), x.dtype)
    q = rms_norm(rec, ctx, lin(rec, ctx, n2, h, "attn2.to_q", True), "attn2.norm_q", True)
    k = rms_norm(rec, ctx, lin(rec, ctx, txt, h, "attn2.to_k", True), "attn2.norm_k", True)
    v = lin(rec, ctx, txt, h, "attn2.to_v", True)
    m = txt.shape[1]
    q, k, v = rec.view(q, (b, a, n, d)), rec.view(k, (b, a, m, d)), rec.view(v, (b, a, m, d))
    o = rec.view(rec.sdpa(q, k, v, (b, n, a, d), "attn2/core"), (b, n, h))
    x = rec.add(x, lin(rec, ctx, o, h, "attn2.to_out.0", True), name="attn2.residual")
    hf = rec.to(modulate(rec, ctx, x, e, "norm3", fp32=True), x.dtype)
    ff = rec.to(feed_forward(rec, ctx, hf, "ffn"), "fp32")
    return rec.to(gated(rec, rec.to(x, "fp32"), ff, gate(rec, e), "ffn"), x.dtype)


__all__ = ["double_block", "feed_forward", "joint_attention", "modulate", "rms_norm", "scale_shift", "single_block",
           "wan_block"]

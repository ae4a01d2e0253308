"""LTX-Video, HunyuanVideo and Mochi denoiser blocks on the symbolic recorder.

Mirrors diffusers 0.42:
- `models/transformers/transformer_ltx.py` LTXVideoTransformerBlock: a cross-attention
  video DiT (as Wan) whose norms are diffusers RMSNorm without weights, modulated by
  `scale_shift_table + temb`; self-attention with torch.nn.RMSNorm across all heads on q
  and k and LTX's rotary (`x.float() * cos + rotated.float() * sin`); cross-attention reads
  the block *input* (no norm) and the projected caption under a key mask; a GELU-tanh
  FeedForward.
- `models/transformers/transformer_hunyuan_video.py` HunyuanVideoTransformerBlock (dual
  stream, Flux-like, q/k diffusers RMSNorm with weights, rotary on the video tokens only,
  then cat with the text's q/k/v; a boolean mask over the joint sequence),
  HunyuanVideoSingleTransformerBlock (one stream; the processor cats the split norm output
  again, and the attention output is cat'd back before cat(attention, mlp)), and the
  token refiner over the text (HunyuanVideoIndividualTokenRefinerBlock).
- `models/transformers/transformer_mochi.py` MochiTransformerBlock: asymmetric joint
  attention (video h wide, text `pooled_projection_dim` wide, projected to h for the
  attention), MochiModulatedRMSNorm in fp32 around every residual, SwiGLU feed-forwards,
  and MochiAttnProcessor2_0's per-sample loop (cat of video and valid text q/k/v per
  sample, pad, cat, transpose + flatten: a copy).
Legend: b batch, n video tokens, m text tokens, T = n + m, h hidden, a heads, d head dim,
f feed-forward width, p Mochi's text width.
"""
from __future__ import annotations

from vramplan.components.arch_dit import DitCtx, gated
from vramplan.components.arch_mmdit import ada_emb, feed_forward, gate, lin, modulate, rms_norm, rope, sliced
from vramplan.components.graph import Param, Recorder, Sym


def plain_rms(rec: Recorder, x: Sym, name: str) -> Sym:
    """diffusers RMSNorm without weights (normalization.py): `x.to(fp32).pow(2).mean(-1)`,
    `x * rsqrt(var + eps)` (fp32 when x is 16-bit: the product keeps x), `.to(x.dtype)`."""
    x32 = rec.to(x, "fp32", name=f"{name}.fp32")
    var = rec.reduce(rec.unary_saving_input(x32, f"{name}.pow"), x.shape[:-1] + (1,), f"{name}.var")
    rstd = rec.unary_saving_output(var, f"{name}.rstd")
    return rec.to(rec.mul(x, rstd, name=f"{name}.xhat"), x.dtype, name=name)


def scaled(rec: Recorder, x: Sym, emb: Sym, name: str, fp32: bool = False) -> Sym:
    """`x * (1 + scale) + shift` with (b, 1, h) chunks: (1 + scale) is a new small tensor."""
    b, h = x.shape[0], x.shape[-1]
    one_plus = rec.new(f"{name}.one_plus_scale", (b, 1, h), "fp32" if fp32 else emb.dtype, emb.requires_grad)
    return rec.add(rec.mul(x, one_plus, name=f"{name}.scaled"), one_plus, name=f"{name}.modulated")


def _attention(rec: Recorder, ctx: DitCtx, q: Sym, k: Sym, v: Sym, name: str, mask: int = 0) -> Sym:
    """SDPA over (b, s, a, d)-laid q, k, v (dispatch_attention_fn transposes views); the
    CPU flash kernel's output follows q's layout, so flattening the heads is a view. An
    additive mask (`mask` elements, the compute dtype) is saved for backward."""
    b, s, h = q.shape[0], q.shape[1], q.shape[-1]
    a, d = ctx.heads, h // ctx.heads
    sk = k.shape[1]
    if mask and (q.requires_grad or k.requires_grad or v.requires_grad):
        rec.save(rec.new(f"{name}.mask", (mask,), ctx.dtype, False))
    qv, kv, vv = rec.view(q, (b, a, s, d)), rec.view(k, (b, a, sk, d)), rec.view(v, (b, a, sk, d))
    return rec.view(rec.sdpa(qv, kv, vv, (b, s, a, d), f"{name}/core"), (b, s, h))


# ----------------------------------------------------------------------------- LTX-Video
def ltx_block(rec: Recorder, ctx: DitCtx, x: Sym, txt: Sym, temb: Sym) -> Sym:
    """LTXVideoTransformerBlock.forward."""
    b, n, h = x.shape
    m = txt.shape[1]
    e = rec.new("ada_values", (b, 1, 6, h), ctx.dtype, ctx.trainable)  # scale_shift_table + temb
    hx = scaled(rec, plain_rms(rec, x, "norm1"), e, "norm1")
    q, k = (rms_norm(rec, ctx, lin(rec, ctx, hx, h, f"attn1.to_{p}", True), f"attn1.norm_{p}", True) for p in "qk")
    v = lin(rec, ctx, hx, h, "attn1.to_v", True)
    o = _attention(rec, ctx, rope(rec, q, "attn1.rope_q"), rope(rec, k, "attn1.rope_k"), v, "attn1")
    x = gated(rec, x, lin(rec, ctx, o, h, "attn1.to_out.0", True), gate(rec, e), "attn1")
    # attn2 reads the residual stream itself; the key mask is (b * a, 1, m) after
    # Attention.prepare_attention_mask's repeat over heads
    q = rms_norm(rec, ctx, lin(rec, ctx, x, h, "attn2.to_q", True), "attn2.norm_q", True)
    k = rms_norm(rec, ctx, lin(rec, ctx, txt, h, "attn2.to_k", True), "attn2.norm_k", True)
    v = lin(rec, ctx, txt, h, "attn2.to_v", True)
    o = _attention(rec, ctx, q, k, v, "attn2", mask=b * ctx.heads * m)
    x = rec.add(x, lin(rec, ctx, o, h, "attn2.to_out.0", True), name="attn2.residual")
    hf = scaled(rec, plain_rms(rec, x, "norm2"), e, "norm2")
    return gated(rec, x, feed_forward(rec, ctx, hf, "ff"), gate(rec, e), "ff")


# ----------------------------------------------------------------------------- HunyuanVideo
def _hunyuan_qk(rec: Recorder, ctx: DitCtx, x: Sym, prefix: str, rotary_rows: int) -> tuple[Sym, Sym, Sym]:
    """to_q/k/v (LoRA), per-head diffusers RMSNorm with weights on q and k, and rotary on
    the first `rotary_rows` tokens (a new tensor; the rest joined by a cat)."""
    b, s, h = x.shape
    q, k = (rms_norm(rec, ctx, lin(rec, ctx, x, h, f"{prefix}.to_{p}", True), f"{prefix}.norm_{p}")
            for p in "qk")
    v = lin(rec, ctx, x, h, f"{prefix}.to_v", True)
    if rotary_rows == s:
        return rope(rec, q, f"{prefix}.rope_q"), rope(rec, k, f"{prefix}.rope_k"), v
    # single stream: rotary on query[:, :-m], then cat with query[:, -m:] (a new tensor)
    return rec.new(f"{prefix}.cat_q", q.shape, q.dtype, True), rec.new(f"{prefix}.cat_k", k.shape, k.dtype, True), v


def hunyuan_double_block(rec: Recorder, ctx: DitCtx, x: Sym, txt: Sym, temb: Sym) -> tuple[Sym, Sym]:
    """HunyuanVideoTransformerBlock.forward (AdaLayerNormZero per stream, joint attention
    over cat(video, text) under the boolean key mask, a GELU-tanh FeedForward per stream)."""
    b, n, h = x.shape
    m = txt.shape[1]
    ex, et = ada_emb(rec, ctx, temb, 6, "norm1"), ada_emb(rec, ctx, temb, 6, "norm1_context")
    hx, ht = modulate(rec, ctx, x, ex, "norm1"), modulate(rec, ctx, txt, et, "norm1_context")
    _hunyuan_qk(rec, ctx, hx, "attn", n)  # the video rows' q (rotated), k (rotated), v
    for p in "qk":
        rms_norm(rec, ctx, lin(rec, ctx, ht, h, f"attn.add_{p}_proj"), f"attn.norm_added_{p}")
    lin(rec, ctx, ht, h, "attn.add_v_proj")
    # torch.cat([video, text]) of q, k and v: what SDPA saves
    q, k, v = (rec.new(f"attn.cat_{p}", (b, n + m, h), x.dtype, True) for p in "qkv")
    o = _attention(rec, ctx, q, k, v, "attn", mask=b * (n + m))
    ao = lin(rec, ctx, sliced(rec, o, n, "attn.image_out"), h, "attn.to_out.0", True)
    at = lin(rec, ctx, sliced(rec, o, m, "attn.text_out"), h, "attn.to_add_out")
    x = gated(rec, x, ao, gate(rec, ex), "attn")
    txt = gated(rec, txt, at, gate(rec, et), "attn_context")
    x = gated(rec, x, feed_forward(rec, ctx, modulate(rec, ctx, x, ex, "norm2"), "ff"), gate(rec, ex), "ff")
    ff_t = feed_forward(rec, ctx, modulate(rec, ctx, txt, et, "norm2_context"), "ff_context")
    return x, gated(rec, txt, ff_t, gate(rec, et), "ff_context")


def hunyuan_single_block(rec: Recorder, ctx: DitCtx, x: Sym, txt: Sym, temb: Sym) -> Sym:
    """HunyuanVideoSingleTransformerBlock.forward over cat(video, text)."""
    b, n, h = x.shape
    t = (b, n + txt.shape[1], h)
    joint = rec.new("single.cat_input", t, x.dtype, True)
    e = ada_emb(rec, ctx, temb, 3, "norm")
    hn = modulate(rec, ctx, joint, e, "norm")
    f = ctx.ff_dim or ctx.ff_mult * h
    rec.unary_saving_input(lin(rec, ctx, hn, f, "proj_mlp"), "act_mlp")
    # the processor cats the norm's video and text slices back into one (new) tensor
    hc = rec.new("attn.cat_input", t, x.dtype, hn.requires_grad)
    q, k, v = _hunyuan_qk(rec, ctx, hc, "attn", n)
    _attention(rec, ctx, q, k, v, "attn", mask=b * t[1])
    cat = rec.new("single.cat_attn_mlp", t[:2] + (h + f,), x.dtype, True)
    return gated(rec, joint, lin(rec, ctx, cat, h, "proj_out"), gate(rec, e), "single")


def refiner_block(rec: Recorder, ctx: DitCtx, x: Sym, temb: Sym) -> Sym:
    """HunyuanVideoIndividualTokenRefinerBlock over the text: LayerNorm (affine), self-
    attention (AttnProcessor2_0, to_q/k/v/to_out.0) under a (b, 1, m, m) mask, the gates of
    HunyuanVideoAdaNorm, LayerNorm, a `linear-silu` FeedForward."""
    b, m, h = x.shape
    w = Param("norm1", (h,), ctx.dtype, ctx.trainable)
    hn = rec.layer_norm(x, w, "refiner.norm1")
    q, k, v = (lin(rec, ctx, hn, h, f"refiner.attn.to_{p}", True) for p in "qkv")
    o = _attention(rec, ctx, q, k, v, "refiner.attn", mask=b * m * m)
    ao = lin(rec, ctx, o, h, "refiner.attn.to_out.0", True)
    g = lin(rec, ctx, rec.unary_saving_input(temb, "refiner.norm_out.silu"), 2 * h, "refiner.norm_out.linear")
    x = gated(rec, x, ao, gate(rec, g), "refiner.attn")
    hf = rec.layer_norm(x, Param("norm2", (h,), ctx.dtype, ctx.trainable), "refiner.norm2")
    f = ctx.ff_mult * h
    act = rec.unary_saving_input(lin(rec, ctx, hf, f, "refiner.ff.net.0.proj"), "refiner.ff.silu")
    return gated(rec, x, lin(rec, ctx, act, h, "refiner.ff.net.2"), gate(rec, g), "refiner.ff")


# ----------------------------------------------------------------------------- Mochi
def mochi_norm(rec: Recorder, x: Sym, scale: Sym, name: str) -> Sym:
    """MochiModulatedRMSNorm / the norm of MochiRMSNormZero: `x.to(fp32)`, RMSNorm without
    weights, `* scale` (an fp32 (b, 1, w) tensor), `.to(x.dtype)`."""
    x32 = rec.to(x, "fp32", name=f"{name}.fp32")
    return rec.to(rec.mul(plain_rms(rec, x32, name), scale, name=f"{name}.scaled"), x.dtype, name=f"{name}.out")


def _small(rec: Recorder, like: Sym, width: int, name: str, rg: bool) -> Sym:
    return rec.new(name, (like.shape[0], 1, width), "fp32", rg)


def mochi_rope(rec: Recorder, x: Sym, tables_grad: bool, name: str) -> Sym:
    """MochiAttnProcessor2_0's apply_rotary_emb: `x[..., 0::2].float()` and `x[..., 1::2]
    .float()` (views in fp32, fp32 copies of 16-bit x), each times cos and sin, stacked:
    when the tables require grad (`pos_frequencies` trained) the products keep the halves."""
    if tables_grad and x.requires_grad:
        if x.dtype == "fp32":
            rec.save(x)
        else:
            rec.save(rec.new(f"{name}.even", x.shape[:-1] + (x.shape[-1] // 2,), "fp32", True),
                     rec.new(f"{name}.odd", x.shape[:-1] + (x.shape[-1] // 2,), "fp32", True))
    return rec.new(name, x.shape, x.dtype, x.requires_grad)


def swiglu(rec: Recorder, ctx: DitCtx, x: Sym, inner: int, name: str) -> Sym:
    """FeedForward(activation_fn="swiglu", bias=False): `proj` to 2 x inner, chunk, `hidden
    * silu(gate)` (silu keeps the gate half, the product both factors), `net.2`."""
    up = lin(rec, ctx, x, 2 * inner, f"{name}.net.0.proj")
    half = rec.view(up, x.shape[:-1] + (inner,), f"{name}.chunk")
    act = rec.unary_saving_input(half, f"{name}.silu")
    return lin(rec, ctx, rec.mul(half, act, name=f"{name}.glu"), x.shape[-1], f"{name}.net.2")


def mochi_block(rec: Recorder, ctx: DitCtx, x: Sym, txt: Sym, temb: Sym, last: bool, rope_grad: bool) -> tuple[Sym, Sym]:
    """MochiTransformerBlock.forward; the last block's text stream stops after its norm."""
    b, n, h = x.shape
    m, p = txt.shape[1], txt.shape[-1]
    full = temb.requires_grad  # the modulation's chunks need a gradient (trained, or LoRA on the pooler)
    ada_emb(rec, ctx, temb, 4, "norm1")
    hx = mochi_norm(rec, x, _small(rec, x, h, "norm1.one_plus", full), "norm1")
    lin(rec, ctx, rec.unary_saving_input(temb, "norm1_context.silu"), (1 if last else 4) * p, "norm1_context.linear")
    ht = mochi_norm(rec, txt, _small(rec, txt, p, "norm1_context.one_plus", full), "norm1_context")
    q, k = (rms_norm(rec, ctx, lin(rec, ctx, hx, h, f"attn1.to_{c}", True), f"attn1.norm_{c}") for c in "qk")
    v = lin(rec, ctx, hx, h, "attn1.to_v", True)
    q, k = (mochi_rope(rec, t, rope_grad, f"attn1.rope_{c}") for t, c in ((q, "q"), (k, "k")))
    for c in "qk":
        rms_norm(rec, ctx, lin(rec, ctx, ht, h, f"attn1.add_{c}_proj"), f"attn1.norm_added_{c}")
    lin(rec, ctx, ht, h, "attn1.add_v_proj")
    # per sample: cat(video, valid text) q, k, v -> SDPA -> pad; cat over samples; the
    # transpose + flatten of the heads copies
    cq, ck, cv = (rec.new(f"attn1.cat_{c}", (b, n + m, h), ctx.dtype, True) for c in "qkv")
    o = _attention(rec, ctx, cq, ck, cv, "attn1")
    o = rec.new("attn1.heads_merged", o.shape, o.dtype, True)
    ao = lin(rec, ctx, sliced(rec, o, n, "attn1.image_out"), h, "attn1.to_out.0", True)
    g = rec.unary_saving_output(_small(rec, x, h, "norm2.gate", full), "norm2.tanh")
    x = rec.add(x, mochi_norm(rec, ao, g, "norm2"), name="attn1.residual")
    hf = mochi_norm(rec, x, _small(rec, x, h, "norm3.one_plus", full), "norm3")
    ff = swiglu(rec, ctx, hf, (4 * h * 2) // 3, "ff")
    g = rec.unary_saving_output(_small(rec, x, h, "norm4.gate", full), "norm4.tanh")
    x = rec.add(x, mochi_norm(rec, ff, g, "norm4"), name="ff.residual")
    if last:
        return x, txt
    at = lin(rec, ctx, sliced(rec, o, m, "attn1.text_out"), p, "attn1.to_add_out")
    g = rec.unary_saving_output(_small(rec, txt, p, "norm2_context.gate", full), "norm2_context.tanh")
    txt = rec.add(txt, mochi_norm(rec, at, g, "norm2_context"), name="attn1.context_residual")
    hf = mochi_norm(rec, txt, _small(rec, txt, p, "norm3_context.one_plus", full), "norm3_context")
    ff = swiglu(rec, ctx, hf, (4 * p * 2) // 3, "ff_context")
    g = rec.unary_saving_output(_small(rec, txt, p, "norm4_context.gate", full), "norm4_context.tanh")
    return x, rec.add(txt, mochi_norm(rec, ff, g, "norm4_context"), name="ff_context.residual")


__all__ = ["hunyuan_double_block", "hunyuan_single_block", "ltx_block", "mochi_block", "mochi_norm", "mochi_rope",
           "plain_rms", "refiner_block", "scaled", "swiglu"]

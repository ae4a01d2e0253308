"""Diffusion-transformer blocks on the symbolic recorder, and the UNet's per-level sum.

Transformer blocks mirror diffusers 0.3x `models/transformers/cogvideox_transformer_3d.py`
(CogVideoXBlock: CogVideoXLayerNormZero = LayerNorm then `x * (1 + scale) + shift` for the
video and the text stream, one attention over cat(text, video), `gate * out` residuals,
a GELU-tanh FeedForward on cat(text, video)) and `models/attention.py`
(JointTransformerBlock of SD3/Flux: the same per-stream adaLN-Zero modulation, separate
projections per stream joined for one attention). DiT (image, no text in the sequence)
is the same block with no text tokens.
Legend: b batch, n image/video tokens, m text tokens, T = n + m, h hidden (heads * d),
f = ff_mult * h.
"""
from __future__ import annotations

from dataclasses import dataclass

from vramplan.components.graph import Param, Recorder, Sym
from vramplan.units import nbytes


@dataclass(slots=True)
class DitCtx:
    hidden: int
    heads: int
    ff_mult: int
    dtype: str
    trainable: bool
    """Full fine-tuning: every block weight trains."""
    lora_rank: int = 0
    """LoRA on to_q, to_k, to_v, to_out.0 (diffusers' training scripts' default targets)."""
    qk_norm: bool = True
    ff_dim: int = 0
    """Feed-forward width where the config gives it (Wan's ffn_dim); 0: ff_mult x hidden."""
    lora_dtype: str = "fp32"
    """The adapters' dtype (jobs/diffusion_frozen.adapter_dtype)."""


def _w(ctx: DitCtx, name: str, shape) -> Param:
    return Param(name, tuple(shape), ctx.dtype, ctx.trainable)


def _lin(rec: Recorder, ctx: DitCtx, x: Sym, fan_out: int, name: str, lora: bool = False) -> Sym:
    out = rec.linear(x, _w(ctx, name, (fan_out, x.shape[-1])), name=name)
    if not (lora and ctx.lora_rank):
        return out
    r = ctx.lora_rank
    a = Param(f"{name}.lora_A", (r, x.shape[-1]), ctx.lora_dtype, True)
    b = Param(f"{name}.lora_B", (fan_out, r), ctx.lora_dtype, True)
    xa = rec.to(x, ctx.lora_dtype, name=f"{name}.lora_in")  # PEFT casts the input to the adapter dtype
    yb = rec.scale(rec.linear(rec.linear(xa, a, name=f"{name}.lora_A"), b, name=f"{name}.lora_B"), f"{name}.lora_scaled")
    return rec.to(rec.add(out, yb, name=f"{name}.lora_sum"), out.dtype, name=name)


def lora_forward_transient(ctx: DitCtx, rows: int, fan_in: int, fan_out: int, grad: bool) -> int:
    """Bytes one adapted Linear holds at its own peak in forward, above its input (peft 0.21
    tuners/lora/layer.py Linear.forward): `result = self.base_layer(x)` (c), then `x =
    self._cast_input_dtype(x, lora_A.weight.dtype)` (tuners_utils.py: a copy only when the
    dtypes differ, i.e. fp32 adapters on a 16-bit base), then `result + lora_B(lora_A(x)) *
    scaling`: lora_B's output and its scaled copy alive together, in the adapter dtype (the
    r-wide lora_A output is gone by then). With grad, lora_A saves the cast input (counted
    with the saved tensors, _lin), so it is not counted here; without LoRA, the output."""
    out = nbytes(rows * fan_out, ctx.dtype)
    if not ctx.lora_rank:
        return out
    cast = nbytes(rows * fan_in, ctx.lora_dtype) if not grad and ctx.lora_dtype != ctx.dtype else 0
    return out + cast + 2 * nbytes(rows * fan_out, ctx.lora_dtype)


def modulated_norm(rec: Recorder, ctx: DitCtx, x: Sym, emb: Sym, name: str) -> Sym:
    """LayerNorm, then `norm(x) * (1 + scale)[:, None] + shift` (scale, shift are
    (b, 1, h) chunks of the timestep embedding's linear, so they require grad when the
    block trains: the product saves the normed tensor and the small (1 + scale))."""
    normed = rec.layer_norm(x, _w(ctx, f"{name}.norm", (ctx.hidden,)), f"{name}.norm")
    scaled = rec.mul(normed, emb, name=f"{name}.scaled")
    return rec.add(scaled, emb, name=f"{name}.modulated")


def gated(rec: Recorder, x: Sym, out: Sym, gate: Sym, name: str) -> Sym:
    """x + gate[:, None] * out: the product saves `out` (gate requires grad) and the gate."""
    return rec.add(x, rec.mul(out, gate, name=f"{name}.gated"), name=f"{name}.residual")


def joint_block(rec: Recorder, ctx: DitCtx, x: Sym, txt: Sym | None, emb: Sym) -> tuple[Sym, Sym | None]:
    """One CogVideoX / MMDiT block over b x (m + n) tokens."""
    b, n, h = x.shape
    m = txt.shape[1] if txt is not None else 0
    a, d = ctx.heads, h // ctx.heads
    hx = modulated_norm(rec, ctx, x, emb, "norm1")
    streams = [hx]
    if txt is not None:
        streams.insert(0, modulated_norm(rec, ctx, txt, emb, "norm1_context"))
    joint = rec.new("attn/joint_input", (b, m + n, h), hx.dtype, hx.requires_grad) if txt is not None else hx
    q = rec.view(_lin(rec, ctx, joint, h, "attn.to_q", True), (b, a, m + n, d))
    k = rec.view(_lin(rec, ctx, joint, h, "attn.to_k", True), (b, a, m + n, d))
    v = rec.view(_lin(rec, ctx, joint, h, "attn.to_v", True), (b, a, m + n, d))
    if ctx.qk_norm:
        q = rec.layer_norm(q, _w(ctx, "attn.norm_q", (d,)), "attn.norm_q")
        k = rec.layer_norm(k, _w(ctx, "attn.norm_k", (d,)), "attn.norm_k")
    o = rec.sdpa(q, k, v, (b, m + n, a, d), "attn/core")
    if ctx.qk_norm and rec.backend == "cpu":
        # The processors' `hidden_states.transpose(1, 2).reshape(b, -1, heads * d)`
        # (diffusers models/attention_processor.py CogVideoXAttnProcessor2_0,
        # JointAttnProcessor2_0): the normed q is contiguous (b, a, s, d) and the CPU fused
        # kernel's output follows q's layout, so the reshape copies (to_out saves the copy).
        # Without qk_norm q stays a (b, s, a, d)-laid view and the reshape is a view; CUDA's
        # flash/efficient kernels lay their output out (b, s, a, d) either way.
        o = rec.new("attn/core.out_t", (b, m + n, a, d), o.dtype, o.requires_grad)
    o = _lin(rec, ctx, rec.view(o, (b, m + n, h)), h, "attn.to_out.0", True)
    # the joint output is split back into text and video (views of one tensor)
    x = gated(rec, x, rec.view(o, (b, n, h), "attn/video_out"), emb, "attn")
    if txt is not None:
        txt = gated(rec, txt, rec.view(o, (b, m, h), "attn/text_out"), emb, "attn_context")
    hx = modulated_norm(rec, ctx, x, emb, "norm2")
    joint = hx
    if txt is not None:
        ht = modulated_norm(rec, ctx, txt, emb, "norm2_context")
        joint = rec.new("ff/joint_input", (b, m + n, h), hx.dtype, hx.requires_grad or ht.requires_grad)
    f = ctx.ff_mult * h
    up = _lin(rec, ctx, joint, f, "ff.net.0.proj")
    act = rec.unary_saving_input(up, "ff/gelu_tanh")  # F.gelu(approximate="tanh") saves its input
    down = _lin(rec, ctx, act, h, "ff.net.2")
    x = gated(rec, x, rec.view(down, (b, n, h), "ff/video_out"), emb, "ff")
    if txt is not None:
        txt = gated(rec, txt, rec.view(down, (b, m, h), "ff/text_out"), emb, "ff_context")
    return x, txt


# ----------------------------------------------------------------------------- UNet
def unet_level_saved(c: int, hw: int, b: int, n_resnets: int, n_attn: int, ctx_tokens: int, ctx_dim: int,
                     heads: int, width: int) -> dict[str, int]:
    """Elements saved by one resolution level of a UNet2DConditionModel in training
    (diffusers models/unets/unet_2d_blocks.py CrossAttnDownBlock2D / CrossAttnUpBlock2D:
    `n_resnets` ResnetBlock2D each followed by a Transformer2DModel when it has attention).
    Per ResnetBlock2D (models/resnet.py ResnetBlock2D.forward): norm1's input (GroupNorm
    saves input; mean/rstd are per group), SiLU's input, conv1's input, norm2's input,
    SiLU's input, conv2's input: 6 x c x hw. Per Transformer2DModel with one
    BasicTransformerBlock (models/attention.py): norm + proj_in input (2), and per block
    norm1/attn1 (LayerNorm input, q/k/v input, q, k, v, out: 6), norm2/attn2 (LayerNorm
    input, q input, q, out: 4; k/v of the text context: 2 x ctx_tokens x c), norm3 + GEGLU
    FeedForward (LayerNorm input, proj input: 2, the 8c projection: 8, gelu's input: 4,
    the product: 4), proj_out input (1): 17 x c x hw + 8c... listed term by term below.
    `width` is the number of transformer blocks per attention (transformer_layers_per_block)."""
    bc = b * c * hw
    per_resnet = 6 * bc
    per_block = (6 + 4 + 2 + 8 + 4 + 4) * bc + 2 * b * ctx_tokens * c  # attn1, attn2, ff
    per_attn = 3 * bc + width * per_block  # GroupNorm input, proj_in input, proj_out input
    return {"resnets": n_resnets * per_resnet, "attentions": n_attn * per_attn}


def unet_lora_block_saved(c: int, hw: int, b: int, ctx_tokens: int, r: int, grad_in: bool) -> int:
    """Elements one BasicTransformerBlock of a UNet saves with LoRA on to_q, to_k, to_v,
    to_out.0 of attn1 and attn2, everything else frozen (diffusers models/attention.py;
    a frozen linear or conv saves nothing for its input's gradient, only its weight):
    attn1: norm1's LayerNorm input (when the block input requires grad), its output (the
    LoRA A input shared by q, k, v), q, k, v and the attention output (SDPA); attn2:
    norm2's input, its output (to_q's LoRA A input), q, the text's k and v (ctx_tokens),
    the output;
    norm3's input, GEGLU's projection (8c: `hidden, gate = proj(x).chunk(2)`, gelu saves
    the gate and the product the hidden half) and gelu's output (4c); each LoRA A output
    (r wide, 8 of them). The heads-merge before each to_out is a view of SDPA's output in
    diffusers' AttnProcessor2_0 (its CPU and flash kernels write (b, hw, heads, d)), so
    to_out's LoRA A input adds nothing (measured with the exact CPU meter)."""
    bc = b * c * hw
    if not r:  # no adapters (a frozen UNet a ControlNet feeds): saved only once the input requires
        # grad, and the norms' outputs feed frozen linears only: not saved
        return (4 * bc + 3 * bc + 2 * b * ctx_tokens * c + 13 * bc) if grad_in else 0
    attn1 = (1 if grad_in else 0) * bc + 5 * bc
    attn2 = 4 * bc + 2 * b * ctx_tokens * c
    ff = 13 * bc
    return attn1 + attn2 + ff + 8 * b * hw * r


__all__ = ["DitCtx", "gated", "joint_block", "lora_forward_transient", "modulated_norm", "unet_level_saved", "unet_lora_block_saved"]

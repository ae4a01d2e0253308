"""Per-block saved tensors of the LTX-Video, HunyuanVideo and Mochi denoisers (one stage per
block, then the output stage), replayed on the recorder from components/arch_video.py; the
parameters that split each block (its feed-forwards) and the modules PEFT adapts.

What every block reads once per forward is counted once, in the first block: the timestep
embedding, the projected text states (LTX), the rotary tables (LTX's are per sample,
(b, n, h) fp32 cos and sin from LTXVideoRotaryPosEmbed; HunyuanVideoRotaryPosEmbed's
(n, d); MochiRoPE's (n, a, d/2), whose `pos_frequencies` is a parameter, so under full
fine-tuning the einsum's fp32 frequencies are kept for cos/sin's backward). HunyuanVideo's
token refiner runs over the text before the blocks and is counted with the first block;
Mochi's text pooler and caption projection likewise, and its patch embedding's input
(Conv2d over the (b * F, C, H, W) permuted copy of the latents) when it trains.
Legend: b batch, n video tokens, m text tokens, h hidden, a heads, d head dim, c compute dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.arch_dit import DitCtx
from vramplan.components.arch_mmdit import modulate
from vramplan.components.arch_video import (hunyuan_double_block, hunyuan_single_block, ltx_block, mochi_block,
                                            refiner_block)
from vramplan.components.graph import Recorder
from vramplan.components.trainable import ParamSet
from vramplan.units import nbytes

LTX, HUNYUAN, MOCHI = "LTXVideoTransformer3DModel", "HunyuanVideoTransformer3DModel", "MochiTransformer3DModel"
VIDEO_CLASSES = (LTX, HUNYUAN, MOCHI)


def _stage(rec: Recorder, prefix: str) -> Breakdown:
    out = Breakdown()
    for name, size in rec.saved_items():
        out.add(f"denoiser/activations/{prefix}/{name.replace('/', '.')}", size)
    return out


def text_width(den: dict) -> int:
    """Width of the text stream inside the blocks: Mochi's own (pooled_projection_dim), else h."""
    if den["class"] == MOCHI:
        return den.get("pooled_projection_dim", 1536)
    return den["num_attention_heads"] * den["attention_head_dim"]


def video_stages(den: dict, ctx: DitCtx, backend: str, b: int, n: int, m: int) -> list[Breakdown]:
    """Saved tensors per block in forward order (the output stage is the caller's)."""
    cls, h, c, full = den["class"], ctx.hidden, ctx.dtype, ctx.trainable
    layers = den["num_layers"] + (den.get("num_single_layers", 0) if cls == HUNYUAN else 0)
    p = text_width(den)
    stages = []
    for i in range(layers):
        rec = Recorder(backend=backend)
        # the text stream requires grad where something before it trains: Hunyuan's refiner
        # carries LoRA adapters; LTX's projected caption is read by every block
        x = rec.new("hidden", (b, n, h), c, full or i > 0)
        txt = rec.new("text", (b, m, p), c, full or i > 0 or (cls == HUNYUAN and ctx.lora_rank > 0))
        # Mochi's conditioning adds the text pooler's output, whose `to_q` PEFT adapts
        temb = rec.new("temb", (b, h), c, full or (cls == MOCHI and ctx.lora_rank > 0))
        rec.seen.add(id(temb.storage))
        if cls == LTX:
            if i > 0:
                rec.seen.add(id(txt.storage))
            ltx_block(rec, ctx, x, txt, temb)
        elif cls == HUNYUAN and i < den["num_layers"]:
            hunyuan_double_block(rec, ctx, x, txt, temb)
        elif cls == HUNYUAN:
            hunyuan_single_block(rec, ctx, x, txt, temb)
        else:
            mochi_block(rec, ctx, x, txt, temb, last=i == layers - 1, rope_grad=full)
        stages.append(_stage(rec, f"blocks.{i}"))
    stages[0].merge(video_rotary(den, c, full, b, n)).merge(_embeddings(den, ctx, backend, b, n, m))
    return stages


def _embeddings(den: dict, ctx: DitCtx, backend: str, b: int, n: int, m: int) -> Breakdown:
    """What runs before the blocks and keeps tensors (outside any checkpointed block)."""
    rec = Recorder(backend=backend)
    temb = rec.new("temb", (b, ctx.hidden), ctx.dtype, ctx.trainable)
    rec.seen.add(id(temb.storage))
    if den["class"] == HUNYUAN:
        _refiner(rec, ctx, den, b, m, temb)
    elif den["class"] == MOCHI and ctx.trainable:
        _mochi_embeddings(rec, den, ctx.dtype, b, n, m)
    return _stage(rec, "embed")


def checkpointed(stages: list[Breakdown]) -> tuple[list[Breakdown], list[Breakdown]]:
    """Under diffusers' gradient checkpointing (each block in torch.utils.checkpoint) split
    the stages into what stays saved, the parts outside the blocks (rotary tables, the
    embeddings before and the output stage after them), and what the blocks recompute in
    backward."""
    outside = ("/rope/", "/embed/", "/output/")
    kept = [Breakdown(terms={k: v for k, v in s.terms.items() if any(o in k for o in outside)}) for s in stages]
    again = [Breakdown(terms={k: v for k, v in s.terms.items() if not any(o in k for o in outside)}) for s in stages]
    return kept, again


def _refiner(rec: Recorder, ctx: DitCtx, den: dict, b: int, m: int, temb) -> None:
    """HunyuanVideoTokenRefiner: proj_in over the text embeddings (saved when it trains),
    then the refiner blocks over b x m tokens."""
    h = ctx.hidden
    emb = rec.new("text_embeds", (b, m, den.get("text_embed_dim", 4096)), ctx.dtype, False)
    if ctx.trainable:
        rec.save(emb)
    x = rec.new("refiner.proj_in", (b, m, h), ctx.dtype, ctx.trainable)
    for _ in range(den.get("num_refiner_layers", 2)):
        x = refiner_block(rec, ctx, x, temb)


def _mochi_embeddings(rec: Recorder, den: dict, c: str, b: int, n: int, m: int) -> None:
    """Trained: the patch embedding's Conv2d keeps its input, the permuted copy of the
    latents (b x C x F x H x W elements); MochiAttentionPool keeps cat(mean, text) (for
    to_kv) and its k/v projection (for SDPA)."""
    pe = den.get("patch_size", 2)
    rec.save(rec.new("patch_embed.input", (b * n * pe * pe * den.get("in_channels", 12),), c, False))
    dt = den.get("text_embed_dim", 4096)
    rec.save(rec.new("pooler.cat", (b, m + 1, dt), c, True), rec.new("pooler.kv", (b, m + 1, 2 * dt), c, True))


def video_rotary(den: dict, c: str, full: bool, b: int, n: int) -> Breakdown:
    """The rotary tables every block's products keep, made once per forward in fp32."""
    h, d = den["num_attention_heads"] * den["attention_head_dim"], den["attention_head_dim"]
    key = "denoiser/activations/rope/cos_sin"
    if den["class"] == LTX:
        return Breakdown().add(key, 2 * nbytes(b * n * h, "fp32"))
    if den["class"] == HUNYUAN:
        return Breakdown().add(key, 2 * nbytes(n * d, "fp32"))
    out = Breakdown().add(key, 2 * nbytes(n * h // 2, "fp32"))
    if full:  # cos and sin of the trained frequencies keep their input
        out.add("denoiser/activations/rope/freqs", nbytes(n * h // 2, "fp32"))
    return out


def ltx_output_stage(ctx: DitCtx, backend: str, b: int, n: int) -> Breakdown:
    """LTX's output: `scale_shift_table + embedded_timestep` (b, 1, 2, h), LayerNorm without
    weights (saves the last block's output), `* (1 + scale) + shift`, proj_out (saves the
    modulated tensor when it trains); the prediction is already in token layout."""
    rec = Recorder(backend=backend)
    last = rec.new("last_block_output", (b, n, ctx.hidden), ctx.dtype, True)
    emb = rec.new("norm_out.emb", (b, 1, 2 * ctx.hidden), ctx.dtype, ctx.trainable)
    mod = modulate(rec, ctx, last, emb, "norm_out")
    if ctx.trainable:
        rec.save(mod)
    return _stage(rec, "output")


def video_feed_forward_params(den: dict, i: int) -> int:
    """Weights of block i's feed-forwards: LTX one GELU FeedForward (h -> 4h -> h, biases);
    Hunyuan's dual blocks two (video and text), its single blocks none (the MLP runs beside
    the attention); Mochi's SwiGLU without biases, (4 w * 2) // 3 wide, for the video (w = h)
    and, but in the last block, the text (w = pooled_projection_dim)."""
    h = den["num_attention_heads"] * den["attention_head_dim"]
    if den["class"] == MOCHI:
        def swi(w: int) -> int:
            return 3 * w * ((4 * w * 2) // 3)
        return swi(h) + (swi(text_width(den)) if i < den["num_layers"] - 1 else 0)
    f = int(den.get("mlp_ratio", 4) * h)
    one = 2 * h * f + f + h
    if den["class"] == LTX:
        return one
    return 2 * one if i < den["num_layers"] else 0


def video_lora_targets(den: dict, i: int) -> tuple[tuple[str, int], ...]:
    """(module, in + out features) of every Linear PEFT adapts in block i under the
    `to_q, to_k, to_v, to_out.0` suffixes: LTX's attn1 and attn2, Hunyuan's dual blocks'
    four and single blocks' three (no to_out), Mochi's attn1; with block 0 the modules
    outside the blocks that match: Hunyuan's refiner blocks' four each, Mochi's text
    pooler `to_q` (text_embed_dim square)."""
    h = den["num_attention_heads"] * den["attention_head_dim"]
    four = ("to_q", "to_k", "to_v", "to_out.0")
    cls = den["class"]
    if cls == LTX:
        return tuple((f"attn{j}.{t}", 2 * h) for j in (1, 2) for t in four)
    if cls == HUNYUAN:
        out = tuple((f"attn.{t}", 2 * h) for t in (four if i < den["num_layers"] else four[:3]))
        if i == 0:
            out += tuple((f"context_embedder.refiner.{j}.attn.{t}", 2 * h)
                         for j in range(den.get("num_refiner_layers", 2)) for t in four)
        return out
    out = tuple((f"attn1.{t}", 2 * h) for t in four)
    if i == 0:
        out += (("time_embed.pooler.to_q", 2 * den.get("text_embed_dim", 4096)),)
    return out


def checkpointed_forward_transient(den: dict, ctx: DitCtx, b: int, n: int, m: int) -> Breakdown:
    """Under checkpointing a block's forward keeps nothing, so the forward peaks inside one
    block's feed-forward, where its projection, activation and (SwiGLU) product are alive
    at once (measured with the exact CPU meter: Mochi's ff.net.0.proj, silu and mul)."""
    h, c = ctx.hidden, ctx.dtype
    if den["class"] == MOCHI:
        f = (4 * h * 2) // 3
        return Breakdown().add("denoiser/forward/checkpointed_ff", 4 * nbytes(b * n * f, c))
    f = ctx.ff_dim or ctx.ff_mult * h
    if den["class"] == HUNYUAN:  # a single block at proj_out: cat(attention, mlp), the GELU
        # output, the re-cat attention output and proj_out's output, over the joint sequence
        return Breakdown().add("denoiser/forward/checkpointed_single", nbytes(b * (n + m) * (2 * f + 3 * h), c))
    return Breakdown().add("denoiser/forward/checkpointed_ff", 2 * nbytes(b * n * f, c))


def checkpointed_backward_transient(den: dict, ctx: DitCtx, b: int, n: int) -> Breakdown | None:
    """Above a recomputed block's tensors (all alive until its backward ends, measured with
    the exact CPU meter): LTX peaks at its first backward op, the GELU output's gradient
    (b x n x f) beside the residual stream's; Mochi at its last, norm1's fp32 RMSNorm
    backward (MulBackward's result, MeanBackward's div and PowBackward's three temporaries,
    (b, n, h) fp32 each) beside the input's gradient. None: the block's own transient."""
    h, c = ctx.hidden, ctx.dtype
    if den["class"] == LTX:
        f = ctx.ff_dim or ctx.ff_mult * h
        return (Breakdown().add("denoiser/backward/grad_ff", nbytes(b * n * f, c))
                .add("denoiser/backward/grad_hidden", nbytes(b * n * h, c)))
    if den["class"] == MOCHI:
        return (Breakdown().add("denoiser/backward/rms_norm_fp32", 5 * nbytes(b * n * h, "fp32"))
                .add("denoiser/backward/grad_hidden", nbytes(b * n * h, c)))
    return None


def forward_transient(den: dict, ctx: DitCtx, b: int, n: int, m: int) -> Breakdown:
    """What the last block holds above the saved tensors at its end in forward (measured
    with the exact CPU meter): the feed-forward's hidden activation (not saved when the
    next linear is frozen, alive as a local until the block returns) and the gated product
    before the residual add. Hunyuan's last single block also holds the attention output
    re-cat over the joint sequence and, when its weights are frozen, the modulated norm,
    cat(attention, mlp) and proj_out's output, which nothing saves."""
    h, c, lora = ctx.hidden, ctx.dtype, not ctx.trainable
    f = ctx.ff_dim or ctx.ff_mult * h
    cls = den["class"]
    out = Breakdown()
    if cls == HUNYUAN:
        t = b * (n + m)
        out.add("denoiser/forward/act_mlp", nbytes(t * f, c)).add("denoiser/forward/attn_cat", nbytes(t * h, c))
        out.add("denoiser/forward/gated", nbytes(t * h, c))
        if lora:
            out.add("denoiser/forward/frozen_norm_cat_proj", nbytes(t * (h + h + f + h), c))
        return out
    if cls == MOCHI:
        f = (4 * h * 2) // 3
        if lora:  # SwiGLU's product `hidden * silu(gate)`: net.2 is frozen, nothing saves it
            out.add("denoiser/forward/glu", nbytes(b * n * f, c))
        return out
    if lora:
        out.add("denoiser/forward/gelu_out", nbytes(b * n * f, c)).add("denoiser/forward/ff_out", nbytes(b * n * h, c))
    return out.add("denoiser/forward/gated", nbytes(b * n * h, c))


def mochi_lora_transient(ctx: DitCtx, b: int, n: int) -> Breakdown:
    """A Mochi block's backward peak with LoRA (measured with the exact CPU meter), the
    larger of: in its SwiGLU, MmBackward's gradient of the product and MulBackward's two
    results (b x n x f each, f = (4h * 2) // 3) beside the residual stream's gradient
    (b x n x h), once norm4's normalized tensor and net.2's output (b x n x h each) were
    released by their backward (the fp32 peak); at norm4's fp32 RMSNorm backward,
    MulBackward's result, MeanBackward's div and PowBackward's three temporaries ((b, n, h)
    fp32 each) beside the incoming gradient, its fp32 normalized tensor already released
    (the bf16 peak, where the fp32 temporaries outweigh the 16-bit SwiGLU)."""
    f = (4 * ctx.hidden * 2) // 3
    bnh = nbytes(b * n * ctx.hidden, ctx.dtype)
    swiglu = 3 * nbytes(b * n * f, ctx.dtype) + bnh - 2 * bnh
    rms = 5 * nbytes(b * n * ctx.hidden, "fp32") + bnh - nbytes(b * n * ctx.hidden, "fp32")
    if rms > swiglu:
        return Breakdown().add("denoiser/backward/rms_norm_fp32", rms)
    return Breakdown().add("denoiser/backward/grad_swiglu", swiglu)


def first_block_grads(den: dict, params: ParamSet, grads: list[Breakdown]) -> list[Breakdown] | None:
    """The gradients alive at each stage's backward peak where the first block's comes at
    its first op (LTX's and Hunyuan's feed-forward backward, measured with the exact CPU
    meter): the first block's other weights get theirs after it (denoiser_params puts them
    in stage 0, the last in backward order). None: every stage's own gradients."""
    if den.get("class") not in VIDEO_CLASSES or den["class"] == MOCHI:
        return None
    later = sum(nbytes(p.numel, p.dtype) for p in params.trainable() if p.name == "blocks.0")
    if not later:
        return None
    return [Breakdown().add("denoiser/gradients", grads[0].total() - later)] + grads[1:]


__all__ = ["VIDEO_CLASSES", "checkpointed", "checkpointed_backward_transient", "checkpointed_forward_transient", "first_block_grads", "forward_transient", "mochi_lora_transient", "ltx_output_stage", "text_width", "video_feed_forward_params", "video_lora_targets",
           "video_rotary", "video_stages"]

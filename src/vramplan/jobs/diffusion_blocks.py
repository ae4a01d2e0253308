"""Per-block saved tensors of the Flux, SD3/SD3.5 and Wan denoisers (one stage per block,
then the output stage), replayed on the recorder from components/arch_mmdit.py.

Each block gets its own recorder; the tensors every block reads (the timestep embedding,
Wan's projected text states) are counted once. A block's inputs are saved by its first
LayerNorm, so they count in the block that reads them. With LoRA the first block's input
(the frozen patch embedding's output) does not require grad and saves nothing; every later
block's does, through the adapters of the blocks before it.
Legend: b batch, n image/video tokens, m text tokens, h hidden, c compute dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.arch_dit import DitCtx
from vramplan.components.arch_mmdit import double_block, modulate, single_block, wan_block
from vramplan.components.graph import Recorder
from vramplan.jobs.diffusion_scripts import adapter_dtype
from vramplan.jobs.diffusion_wan import wan_forward_transient, wan_recompute_transient
from vramplan.jobs.diffusion_video import (HUNYUAN, LTX, MOCHI, VIDEO_CLASSES, checkpointed_forward_transient,
                                           forward_transient, ltx_output_stage, mochi_lora_transient,
                                           video_feed_forward_params, video_lora_targets, video_stages)
from vramplan.spec import Checkpointing, JobSpec, Method
from vramplan.units import nbytes

FLUX, SD3, WAN = "FluxTransformer2DModel", "SD3Transformer2DModel", "WanTransformer3DModel"
BLOCK_CLASSES = (FLUX, SD3, WAN) + VIDEO_CLASSES


def block_ctx(den: dict, spec: JobSpec) -> DitCtx:
    full = spec.method is Method.FULL
    h = den["num_attention_heads"] * den["attention_head_dim"]
    return DitCtx(hidden=h, heads=den["num_attention_heads"], ff_mult=den.get("ff_mult", 4),
                  dtype=spec.precision.compute_dtype, trainable=full,
                  lora_rank=spec.lora.r if spec.lora and not full else 0, ff_dim=den.get("ffn_dim", 0),
                  lora_dtype=adapter_dtype(spec))


def _stage(rec: Recorder, prefix: str) -> Breakdown:
    out = Breakdown()
    for name, size in rec.saved_items():
        out.add(f"denoiser/activations/{prefix}/{name.replace('/', '.')}", size)
    return out


def block_stages(pipe: dict, spec: JobSpec, b: int, n: int, m: int) -> list[Breakdown]:
    """Saved tensors per block in forward order, the output stage last."""
    den = pipe["denoiser"]
    cls, ctx = den["class"], block_ctx(den, spec)
    h, c, full = ctx.hidden, ctx.dtype, ctx.trainable
    if cls in VIDEO_CLASSES:  # LTX-Video, HunyuanVideo, Mochi: jobs/diffusion_video.py
        stages = video_stages(den, ctx, spec.backend.value, b, n, m)
        if cls == LTX:
            return stages + [ltx_output_stage(ctx, spec.backend.value, b, n)]
        return stages + [output_stage(den, ctx, spec, b, n, n + m if cls == HUNYUAN else n)]
    stages = []
    doubles = den["num_layers"]
    singles = den.get("num_single_layers", 0) if cls == "FluxTransformer2DModel" else 0
    for i in range(doubles + singles):
        rec = Recorder(backend=spec.backend.value)
        rg = full or i > 0
        x = rec.new("hidden", (b, n, h), c, rg)
        txt = rec.new("text", (b, m, h), c, rg and cls != "WanTransformer3DModel")
        temb = rec.new("temb", (b, h), c, full)
        rec.seen.add(id(temb.storage))
        if cls == "WanTransformer3DModel":
            if i > 0:  # the projected text states are one tensor read by every block
                rec.seen.add(id(txt.storage))
            wan_block(rec, ctx, x, txt, temb)
        elif i < doubles:
            flux = cls == "FluxTransformer2DModel"
            last = not flux and den.get("context_pre_only_last", True) and i == doubles - 1
            double_block(rec, ctx, x, txt, temb, rotary=flux, qk_norm=flux or bool(den.get("qk_norm")), last=last,
                         dual=i in dual_layers(den))
        else:
            single_block(rec, ctx, x, txt, temb)
        stages.append(_stage(rec, f"blocks.{i}"))
    stages[0].merge(rotary_tables(den, spec, n, m))
    stages.append(output_stage(den, ctx, spec, b, n, m + n if singles else n))
    return stages


def dual_layers(den: dict) -> tuple[int, ...]:
    """SD3.5-medium's MMDiT-X blocks (SD3Transformer2DModel `dual_attention_layers`)."""
    return tuple(den.get("dual_attention_layers") or ()) if den.get("class") == SD3 else ()


def rotary_tables(den: dict, spec: JobSpec, n: int, m: int) -> Breakdown:
    """cos and sin made once per forward and saved by every block's rotary products (freed
    after the first block's backward): FluxPosEmbed over the (m + n) text and image ids,
    fp32 (get_1d_rotary_pos_embed(..., use_real=True) returns `.float()`); Wan's
    WanRotaryPosEmbed slices its buffers to (1, n, 1, d), in the buffers' dtype."""
    d = den["attention_head_dim"]
    if den["class"] == "FluxTransformer2DModel":
        return Breakdown().add("denoiser/activations/rope/cos_sin", 2 * nbytes((m + n) * d, "fp32"))
    if den["class"] == "WanTransformer3DModel":
        return Breakdown().add("denoiser/activations/rope/cos_sin", 2 * nbytes(n * d, spec.precision.weight_dtype))
    return Breakdown()


def buffers(den: dict, spec: JobSpec) -> Breakdown:
    """Buffers cast with the model: Wan's rotary tables (`freqs_cos`, `freqs_sin`, each
    rope_max_seq_len x d: WanRotaryPosEmbed.__init__); SD3's sinusoidal `pos_embed`
    (PatchEmbed: pos_embed_max_size^2 x h, or the sample's patch grid without a maximum), as
    DiTTransformer2DModel's PatchEmbed (built from `sample_size`, no maximum)."""
    w = spec.precision.weight_dtype
    if den["class"] == "WanTransformer3DModel":
        size = den.get("rope_max_seq_len", 1024) * den["attention_head_dim"]
        return Breakdown().add("denoiser/buffers/rope_freqs", 2 * nbytes(size, w))
    if den["class"] in ("SD3Transformer2DModel", "DiTTransformer2DModel"):
        side = den.get("pos_embed_max_size") or den.get("sample_size", 128) // den.get("patch_size", 2)
        h = den["num_attention_heads"] * den["attention_head_dim"]
        return Breakdown().add("denoiser/buffers/pos_embed", nbytes(side * side * h, w))
    return Breakdown()


def feed_forward_params(den: dict, i: int) -> int:
    """Weights and biases of block i's feed-forwards (h -> f -> h each): the image stream's
    and, in a joint block that keeps its text stream, the text's (ff_context); none counted
    for Flux's single blocks, whose MLP runs beside the attention."""
    if den["class"] in VIDEO_CLASSES:
        return video_feed_forward_params(den, i)
    h = den["num_attention_heads"] * den["attention_head_dim"]
    f = den.get("ffn_dim") or den.get("ff_mult", 4) * h
    one = 2 * h * f + f + h
    if den["class"] == "WanTransformer3DModel":
        return one
    if i >= den["num_layers"]:
        return 0
    last_pre_only = den["class"] == "SD3Transformer2DModel" and i == den["num_layers"] - 1
    return one if last_pre_only else 2 * one


def lora_targets(den: dict, i: int) -> tuple[tuple[str, int], ...]:
    """(module, in + out features) of block i's Linears that PEFT adapts with diffusers'
    training scripts' default targets (`to_q`, `to_k`, `to_v`, `to_out.0`, matched by name
    suffix): Wan's self- and cross-attention both have them; Flux's single blocks have no
    `to_out`; the video classes: jobs/diffusion_video.video_lora_targets."""
    if den.get("class") in VIDEO_CLASSES:
        return video_lora_targets(den, i)
    h = den["num_attention_heads"] * den["attention_head_dim"]
    return tuple((name, 2 * h) for name in _lora_names(den, i))


def _lora_names(den: dict, i: int) -> tuple[str, ...]:
    four = ("to_q", "to_k", "to_v", "to_out.0")
    if den.get("class") == "WanTransformer3DModel":
        return tuple(f"attn{j}.{t}" for j in (1, 2) for t in four)
    if den.get("class") == "FluxTransformer2DModel" and i >= den["num_layers"]:
        return four[:3]
    if i in dual_layers(den):  # attn2's to_q, to_k, to_v, to_out.0 match the same suffixes
        return four + tuple(f"attn2.{t}" for t in four)
    return four


def block_transients(pipe: dict, spec: JobSpec, b: int, n: int, m: int) -> list[Breakdown]:
    """Above a block's saved tensors during its backward with LoRA (the feed-forward
    frozen, so its GELU output was not saved): at GeluBackward the incoming gradient and its
    result (b x n x f each) beside the residual stream's gradient (b x n x h), measured
    with the exact CPU meter (Wan: mm, gelu_backward, native_layer_norm_backward alive at
    the peak). Flux's single blocks: below."""
    den = pipe["denoiser"]
    ctx = block_ctx(den, spec)
    if den["class"] == MOCHI:
        return [mochi_lora_transient(ctx, b, n) for _ in range(den["num_layers"])]
    f = ctx.ff_dim or ctx.ff_mult * ctx.hidden
    doubles = den["num_layers"]
    singles = den.get("num_single_layers", 0) if den["class"] in ("FluxTransformer2DModel", HUNYUAN) else 0
    out = []
    for i in range(doubles + singles):
        if i < doubles:
            at_gelu = (Breakdown().add("denoiser/backward/grad_ff", 2 * nbytes(b * n * f, ctx.dtype))
                       .add("denoiser/backward/grad_hidden", nbytes(b * n * ctx.hidden, ctx.dtype)))
            if den["class"] == WAN and spec.gradient_checkpointing is Checkpointing.FULL:
                at_gelu = max(at_gelu, wan_recompute_transient(ctx, b, n), key=Breakdown.total)
            out.append(at_gelu)
            continue
        # A single block's peak is later, at its q/k torch.nn.RMSNorm backward (aten rms_norm's
        # composite backward works in fp32: five (b, T, h) fp32 temporaries), with alive: the
        # gradient of proj_out's input cat(attention, mlp) (its mlp part standing where the
        # GELU's saved input was, already released by GeluBackward, so only the attention
        # part is new), the residual stream's and slice_backward's gradients and SDPA's.
        unit = b * (n + m) * ctx.hidden
        out.append(Breakdown().add("denoiser/backward/grad_cat_attention", nbytes(unit, ctx.dtype))
                   .add("denoiser/backward/rms_norm_fp32", 5 * nbytes(unit, "fp32"))
                   .add("denoiser/backward/grad_hidden", 3 * nbytes(unit, ctx.dtype)))
    return out


def output_backward_transient(den: dict, spec: JobSpec, b: int, n: int) -> Breakdown:
    """The start of backward, at norm_out: the incoming gradient and the output gradient
    (b x n x h each, c). Wan's norm_out works in fp32 (`(norm_out(x.float()) * (1 + scale)
    + shift).type_as(x)`): ToCopyBackward's fp32 gradient, then MulBackward's fp32 results
    for the normed tensor and, when the `scale_shift_table` trains, for `scale` before its
    sum (autograd computes only the inputs that need a gradient; frozen under LoRA),
    measured alive together with the exact CPU meter."""
    h = den["num_attention_heads"] * den["attention_head_dim"]
    if den["class"] == "WanTransformer3DModel":
        alive = 3 if spec.method is Method.FULL else 2
        return Breakdown().add("denoiser/backward/norm_out_fp32", alive * nbytes(b * n * h, "fp32"))
    return Breakdown().add("denoiser/backward/grad_hidden", 2 * nbytes(b * n * h, spec.precision.compute_dtype))


def output_stage(den: dict, ctx: DitCtx, spec: JobSpec, b: int, n: int, last_tokens: int) -> Breakdown:
    """norm_out (AdaLayerNormContinuous, Wan's FP32LayerNorm with its table) then proj_out:
    the LayerNorm saves the last block's output (for Flux a slice of the single stream's
    cat(text, image), which keeps all of it), the modulated tensor is saved by proj_out.
    proj_out's output is the prediction (Flux) or is unpatchified by a copy (SD3, Wan); the
    loss holds the prediction (jobs/diffusion.py)."""
    rec = Recorder(backend=spec.backend.value)
    full = ctx.trainable
    last = rec.new("last_block_output", (b, last_tokens, ctx.hidden), ctx.dtype, True)
    temb = rec.new("temb", (b, ctx.hidden), ctx.dtype, full)
    rec.seen.add(id(temb.storage))
    wan = den["class"] == "WanTransformer3DModel"
    # Mochi's conditioning requires grad under LoRA too (its text pooler's to_q is adapted)
    emb_grad = full or (den["class"] == MOCHI and ctx.lora_rank > 0)
    emb = rec.new("norm_out.emb", (b, 2 * ctx.hidden), "fp32" if wan else ctx.dtype, emb_grad)
    if not wan:  # AdaLayerNormContinuous: linear(silu(temb)) saves silu's output
        rec.save(rec.new("norm_out.silu", (b, ctx.hidden), ctx.dtype, full)) if full else None
    mod = modulate(rec, ctx, rec.view(last, (b, n, ctx.hidden)), emb, "norm_out", fp32=wan)
    if full:
        rec.save(rec.to(mod, ctx.dtype))
    return _stage(rec, "output")


def block_forward_transient(den: dict, ctx: DitCtx, b: int, n: int, m: int, checkpointed: bool) -> Breakdown:
    """The forward's own peak, inside one block, above the tensors saved before it (measured
    with the exact CPU meter; bench/jobs). The video classes: jobs/diffusion_video.py; Wan:
    jobs/diffusion_wan.py. Flux and SD3: without checkpointing the last block's feed-forward with it frozen (LoRA;
    trained, its intermediates are saved and the end of forward is the peak), under
    checkpointing a block's whole no-grad working set, where nothing is saved."""
    cls = den["class"]
    if cls in VIDEO_CLASSES:
        return (checkpointed_forward_transient if checkpointed else forward_transient)(den, ctx, b, n, m)
    if cls == WAN:
        return wan_forward_transient(ctx, b, n, m, checkpointed)
    if not checkpointed and ctx.trainable:
        return Breakdown()
    h, c = ctx.hidden, ctx.dtype
    f = ctx.ff_dim or ctx.ff_mult * h
    if cls == FLUX and den.get("num_single_layers", 0):
        return _flux_single(ctx, b * (n + m), f, checkpointed)
    out = Breakdown()
    # The locals the block holds through its feed-forward: SD3's gated `attn_output`, the norm2-modulated input, its text stream's
    # `norm_encoder_hidden_states` and `context_attn_output`, with the last block
    # (context_pre_only) a view that keeps JointAttnProcessor2_0's whole (b, n + m, h)
    # reshape copy (attention.py JointTransformerBlock.forward, attention_processor.py).
    out.add("denoiser/forward/attn_output", nbytes(b * n * h, c)).add("denoiser/forward/norm_ff_in", nbytes(b * n * h, c))
    if cls == SD3:
        pre_only = den.get("context_pre_only_last", True)
        out.add("denoiser/forward/norm_context", nbytes(b * m * h, c))
        out.add("denoiser/forward/context_attn_output", nbytes(b * ((n + m) if pre_only else m) * h, c))
    duals = dual_layers(den)
    if checkpointed and duals or duals and den["num_layers"] - 1 in duals:
        # an MMDiT-X block also holds `attn_output2` (gate_msa2 * attn2's output) and, where
        # nothing saved it (no grad), `norm_hidden_states2` through its feed-forward
        out.add("denoiser/forward/attn2_output", nbytes(b * n * h, c))
        if checkpointed:
            out.add("denoiser/forward/norm_attn2_in", nbytes(b * n * h, c))
    if checkpointed:
        # no_grad: the residual stream after the attention (its input is the checkpoint's),
        # and in FeedForward (attention.py) net.0.proj's output beside the GELU's
        return (out.add("denoiser/forward/hidden_after_attention", nbytes(b * n * h, c))
                .add("denoiser/forward/ff_proj", nbytes(b * n * f, c)).add("denoiser/forward/gelu_out", nbytes(b * n * f, c)))
    # frozen net.2 saves nothing: the GELU output (b, n, f) is alive while net.2 writes its own
    return out.add("denoiser/forward/gelu_out", nbytes(b * n * f, c)).add("denoiser/forward/ff_out", nbytes(b * n * h, c))


def _flux_single(ctx: DitCtx, t: int, f: int, checkpointed: bool) -> Breakdown:
    """Flux's last single block over t = b x (n + m) tokens (transformer_flux.py
    FluxSingleTransformerBlock.forward; the caller's loop still holds the previous block's
    output slices). With LoRA, at `gate * self.proj_out(cat(attn_output, mlp_hidden_states))`:
    the previous output, the modulated norm, the GELU output, the cat, proj_out's output and
    the product, none saved (proj_out and proj_mlp are frozen). Under checkpointing (no
    grad) the larger of that moment (with the block's own input cat and the attention
    output) and the rotary products in attention (embeddings.py apply_rotary_emb:
    `x.float() * cos + x_rotated.float() * sin`, fp32, beside the block's input cat, the
    norm, the GELU output, v, the normed q and k and `x_rotated`)."""
    h, c = ctx.hidden, ctx.dtype
    if not checkpointed:
        return Breakdown().add("denoiser/forward/single_block", nbytes(t * (2 * f + 5 * h), c))
    at_proj = nbytes(t * (2 * f + 6 * h), c)
    upcast = 2 if c == "fp32" else 3  # .float() of a 16-bit x is a copy
    at_rotary = nbytes(t * (f + 6 * h), c) + nbytes(upcast * t * h, "fp32")
    if at_rotary > at_proj:
        return Breakdown().add("denoiser/forward/single_block_rotary", at_rotary)
    return Breakdown().add("denoiser/forward/single_block", at_proj)


__all__ = ["BLOCK_CLASSES", "block_ctx", "block_forward_transient", "block_stages", "buffers", "feed_forward_params", "output_backward_transient", "rotary_tables", "block_transients", "lora_targets", "output_stage"]

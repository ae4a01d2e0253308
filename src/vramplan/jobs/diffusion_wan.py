"""What a Wan block (diffusers 0.42 transformer_wan.py WanTransformerBlock.forward) holds
beyond its saved tensors: the forward's locals at its own peak, and under gradient
checkpointing the recomputed forward's locals when recomputation stops.

The block computes its residuals in fp32 and casts back:
    hidden_states = (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)
so with a 16-bit compute dtype each `.float()` is a new (b, n, h) fp32 tensor, and with
fp32 it is the tensor itself. PEFT's adapters on to_q/to_k/to_v/to_out.0 run in fp32 on
a 16-bit base (arch_dit.lora_forward_transient). All found with the exact CPU meter's
trace on the real WanTransformer3DModel (bench/jobs, diffusion/*/lora/wan-tiny*).
Legend: b batch, n video tokens, m text tokens, h hidden, f ffn_dim, c compute dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.arch_dit import DitCtx, lora_forward_transient
from vramplan.units import nbytes


def wan_forward_transient(ctx: DitCtx, b: int, n: int, m: int, checkpointed: bool) -> Breakdown:
    """The forward's own peak inside the last block, above the saved tensors: the largest
    of the moments below (a trained block without checkpointing saves its intermediates:
    only its last line)."""
    if ctx.trainable and not checkpointed:
        return _tail(ctx, b, n, checkpointed)
    moments = [_tail(ctx, b, n, checkpointed), _feed_forward(ctx, b, n, checkpointed)]
    if checkpointed:
        moments.append(_cross_attention_out(ctx, b, n, m))
    return max(moments, key=Breakdown.total)


def _cross_attention_out(ctx: DitCtx, b: int, n: int, m: int) -> Breakdown:
    """Under checkpointing (nothing saved) at attn2.to_out.0 (WanAttnProcessor.__call__):
    the block's locals `attn_output` (attn1's, alive until attn2's result replaces it),
    `hidden_states` after the self-attention residual and norm2's output, the processor's
    query, key and value (key and value over the m text tokens) and the attention output,
    with the adapted projection's own working set."""
    h, c = ctx.hidden, ctx.dtype
    return (Breakdown().add("denoiser/forward/block_locals", 5 * nbytes(b * n * h, c))
            .add("denoiser/forward/text_key_value", 2 * nbytes(b * m * h, c))
            .add("denoiser/forward/to_out_lora", lora_forward_transient(ctx, b * n, h, h, grad=False)))


def _feed_forward(ctx: DitCtx, b: int, n: int, checkpointed: bool) -> Breakdown:
    """In FeedForward (attention.py): the cross-attention output `attn_output` and norm3's
    output beside the GELU's output; under checkpointing (nothing saved) also the residual
    stream and net.0.proj's output, otherwise (frozen net.2) net.2's output and, in 16-bit
    (where norm1 and norm3 saved `.float()` copies), the block's input held by the model's
    loop and the residual stream."""
    h, c = ctx.hidden, ctx.dtype
    f = ctx.ff_dim or ctx.ff_mult * h
    out = (Breakdown().add("denoiser/forward/attn_output", nbytes(b * n * h, c))
           .add("denoiser/forward/norm_ff_in", nbytes(b * n * h, c)).add("denoiser/forward/gelu_out", nbytes(b * n * f, c)))
    if checkpointed:
        return (out.add("denoiser/forward/hidden_after_attention", nbytes(b * n * h, c))
                .add("denoiser/forward/ff_proj", nbytes(b * n * f, c)))
    out.add("denoiser/forward/ff_out", nbytes(b * n * h, c))
    if c != "fp32":
        out.add("denoiser/forward/block_input_and_hidden", 2 * nbytes(b * n * h, c))
    return out


def _tail(ctx: DitCtx, b: int, n: int, checkpointed: bool) -> Breakdown:
    """At the block's last line: the locals `attn_output`, `hidden_states`, norm3's output
    and `ff_output` (c), with `hidden_states.float()`, `ff_output.float()` and the gated
    product, then the residual sum beside the product (fp32; in fp32 the casts are the
    tensors themselves). With grad the saved ones are not counted here: fp32
    `hidden_states` (norm3's input), norm3's output when net.0.proj trains, and when the
    gate trains `ff_output.float()` (fp32 `ff_output`); the block's input, held by the
    model's loop over the blocks, is new only when norm1 saved a `.float()` copy (16-bit).
    Measured on wan-tiny: bf16 LoRA and bf16 full fine-tuning peak here in forward."""
    h, c, half = ctx.hidden, ctx.dtype, ctx.dtype != "fp32"
    if checkpointed:  # nothing saved
        locals_, fp32 = 4, (3 if half else 2)
    elif ctx.trainable:  # attn_output; in 16-bit also the input, hidden_states, ff_output
        locals_, fp32 = (4 if half else 1), (3 if half else 2)
    else:  # the input and hidden_states (16-bit), attn_output, norm3's output, ff_output
        locals_, fp32 = (5 if half else 3), (3 if half else 2)
    return (Breakdown().add("denoiser/forward/block_locals", locals_ * nbytes(b * n * h, c))
            .add("denoiser/forward/residual_fp32", fp32 * nbytes(b * n * h, "fp32")))


def wan_recompute_transient(ctx: DitCtx, b: int, n: int) -> Breakdown:
    """Under checkpointing with the blocks frozen (LoRA), above the recomputed block's saved
    tensors: torch.utils.checkpoint (non-reentrant; early stop, checkpoint.py
    _StopRecomputationError) recomputes the block at its backward's first node that needs
    a saved tensor and stops when the last one is packed, by the final `ff_output.float() *
    c_gate_msa`, whose mul packs its inputs before it runs (autograd's generated
    VariableType). Alive: the block output's gradient (fp32: ToCopyBackward0 of the
    `.type_as`), the locals `attn_output`, norm3's output and `ff_output` (and in 16-bit
    `hidden_states`, which norm3 saved only as a `.float()` copy), and the larger of the
    GELU output (at ffn.net.2, before FeedForward's loop drops it) and the two `.float()`
    copies (16-bit, at the stop). Measured on wan-tiny: fp32 peaks at net.2, bf16 at the
    stop. With full fine-tuning the block's weight gradients make a later moment larger
    (diffusion/fp32/full/wan-tiny/gc peaks in block 0's AddmmBackward0)."""
    h, c = ctx.hidden, ctx.dtype
    f = ctx.ff_dim or ctx.ff_mult * h
    gelu = nbytes(b * n * f, c)
    casts = (2 if c != "fp32" else 0) * nbytes(b * n * h, "fp32")
    out = (Breakdown().add("denoiser/backward/grad_block_output", nbytes(b * n * h, "fp32"))
           .add("denoiser/backward/recompute_locals", (4 if c != "fp32" else 3) * nbytes(b * n * h, c)))
    if gelu >= casts:
        return out.add("denoiser/backward/recompute_gelu_out", gelu)
    return out.add("denoiser/backward/recompute_residual_fp32", casts)


__all__ = ["wan_forward_transient", "wan_recompute_transient"]

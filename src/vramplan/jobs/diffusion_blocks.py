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
from vramplan.spec import JobSpec, Method

BLOCK_CLASSES = ("FluxTransformer2DModel", "SD3Transformer2DModel", "WanTransformer3DModel")


def _ctx(den: dict, spec: JobSpec) -> DitCtx:
    full = spec.method is Method.FULL
    h = den["num_attention_heads"] * den["attention_head_dim"]
    return DitCtx(hidden=h, heads=den["num_attention_heads"], ff_mult=den.get("ff_mult", 4),
                  dtype=spec.precision.compute_dtype, trainable=full,
                  lora_rank=spec.lora.r if spec.lora and not full else 0, ff_dim=den.get("ffn_dim", 0))


def _stage(rec: Recorder, prefix: str) -> Breakdown:
    out = Breakdown()
    for name, size in rec.saved_items():
        out.add(f"denoiser/activations/{prefix}/{name.replace('/', '.')}", size)
    return out


def block_stages(pipe: dict, spec: JobSpec, b: int, n: int, m: int) -> list[Breakdown]:
    """Saved tensors per block in forward order, the output stage last."""
    den = pipe["denoiser"]
    cls, ctx = den["class"], _ctx(den, spec)
    h, c, full = ctx.hidden, ctx.dtype, ctx.trainable
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
            double_block(rec, ctx, x, txt, temb, rotary=flux, qk_norm=flux or bool(den.get("qk_norm")), last=last)
        else:
            single_block(rec, ctx, x, txt, temb)
        stages.append(_stage(rec, f"blocks.{i}"))
    stages.append(output_stage(den, ctx, spec, b, n, m + n if singles else n))
    return stages


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
    emb = rec.new("norm_out.emb", (b, 2 * ctx.hidden), "fp32" if wan else ctx.dtype, full)
    if not wan:  # AdaLayerNormContinuous: linear(silu(temb)) saves silu's output
        rec.save(rec.new("norm_out.silu", (b, ctx.hidden), ctx.dtype, full)) if full else None
    mod = modulate(rec, ctx, rec.view(last, (b, n, ctx.hidden)), emb, "norm_out", fp32=wan)
    if full:
        rec.save(rec.to(mod, ctx.dtype))
    return _stage(rec, "output")


__all__ = ["BLOCK_CLASSES", "block_stages", "output_stage"]

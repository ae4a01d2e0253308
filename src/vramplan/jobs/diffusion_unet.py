"""A UNet2DConditionModel denoiser (SD 1.x/2.x, SDXL): its saved tensors per resolution level,
fully trained or with LoRA on the attention projections, and its LoRA adapters.
Legend: b batch, c compute dtype, r LoRA rank, hw latent positions of a level.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.arch_dit import unet_level_saved, unet_lora_block_saved
from vramplan.components.trainable import HeldParam
from vramplan.jobs.diffusion_scripts import adapter_dtype
from vramplan.spec import JobSpec, Method
from vramplan.units import nbytes


def _layers(den: dict) -> list[int]:
    tl = den.get("transformer_layers_per_block", 1)
    return [tl] * len(den["block_out_channels"]) if isinstance(tl, int) else list(tl)


def unet_lora_params(den: dict, spec: JobSpec) -> tuple[HeldParam, ...]:
    """PEFT adapters on to_q, to_k, to_v, to_out.0 of every attn1 and attn2 (r x (in + out)
    each; attn2's to_k and to_v read the cross_attention_dim text states): per transformer
    block of width c, r (14 c + 2 ctx). Blocks: layers_per_block per CrossAttn down level,
    one more per CrossAttn up level, one attention in the mid block, each
    transformer_layers_per_block deep."""
    if spec.method not in (Method.LORA, Method.QLORA):
        return ()
    r, ctx, lpb = spec.lora.r, den["cross_attention_dim"], den["layers_per_block"]
    boc, tl = den["block_out_channels"], _layers(den)
    blocks = [(ch, lpb * tl[i]) for i, (ch, kind) in enumerate(zip(boc, den["down_block_types"]))
              if kind.startswith("CrossAttn")]
    if den.get("mid_block_type") != "UNetMidBlock2D":
        blocks.append((boc[-1], tl[-1]))
    blocks += [(ch, (lpb + 1) * t) for ch, t, kind in zip(boc[::-1], tl[::-1], den["up_block_types"])
               if kind.startswith("CrossAttn")]
    return tuple(HeldParam(f"unet.{i}.lora", (n * r * (14 * ch + 2 * ctx),), adapter_dtype(spec), True, "lora")
                 for i, (ch, n) in enumerate(blocks))


def unet_stages(pipe: dict, spec: JobSpec, b: int, lat_h: int, lat_w: int, m: int,
                frozen_up: bool = False) -> list[Breakdown]:
    """One stage per resolution level: the down path, the mid block, the up path, the output
    convolution (diffusers UNet2DConditionModel). A ResnetBlock2D saves 3 tensors of its input
    width (norm1's input, SiLU's, conv1's) and 3 of its output width; a down level's
    Downsample2D conv saves its input; an up level's resnets read cat(hidden, skip) (the
    lower level's or this level's channels plus the skip's: `res_skip_channels` of the next
    level for the last resnet), and its Upsample2D conv saves the 2x-interpolated tensor;
    up levels run layers_per_block + 1 resnets and use reversed block_out_channels and
    transformer_layers_per_block; UNetMidBlock2DCrossAttn is resnet, attention, resnet.
    `frozen_up`: a frozen UNet whose hidden state requires grad from the up path on (a
    ControlNet's residuals are added to its skips and mid output): the down path and mid
    block save nothing, the up path saves what a LoRA UNet saves without its adapters."""
    den = pipe["denoiser"]
    c = spec.precision.compute_dtype
    lpb, boc = den["layers_per_block"], den["block_out_channels"]
    tl = _layers(den)
    heads, ctx_dim, last = den.get("attention_head_dim", 8), den["cross_attention_dim"], len(boc) - 1
    hw0, out = lat_h * lat_w, []

    lora = spec.lora.r if spec.method is not Method.FULL and spec.lora else 0
    grad = [False]  # with LoRA: does the hidden state require grad yet (after the first adapter)?

    def level(name, ch, hw, res_in, n_attn, width, extra=0, level_heads=8):
        if lora or frozen_up:
            return _lora_level(name, ch, hw, res_in, n_attn, width, extra, level_heads)
        attn = unet_level_saved(ch, hw, b, 0, n_attn, m, ctx_dim, heads, width)["attentions"] if n_attn else 0
        resn = sum(3 * b * hw * (cin + ch) for cin in res_in)
        return (Breakdown().add(f"denoiser/activations/{name}/resnets", nbytes(resn, c))
                .add(f"denoiser/activations/{name}/attentions", nbytes(attn, c))
                .add(f"denoiser/activations/{name}/resample", nbytes(extra, c)))
    def _lora_level(name, ch, hw, res_in, n_attn, width, extra, level_heads):
        # Resnets and attentions alternate (a CrossAttn level: resnet, attention, resnet, ...).
        # Once the hidden state requires grad (after the first adapter), a frozen conv still
        # saves its input (ConvolutionBackward's one formula takes input and weight), so a
        # ResnetBlock2D saves what it saves when trained (3 (c_in + c)), as do Downsample2D /
        # Upsample2D; a frozen linear saves nothing for its input. A Transformer2DModel saves
        # its GroupNorm input, proj_in's and proj_out's inputs when they are 1x1 convs
        # (use_linear_projection false), and its blocks (arch_dit.unet_lora_block_saved),
        # with their fp32 statistics: each SDPA's logsumexp (b, heads, hw), each recorded
        # LayerNorm's mean and rstd (b, hw); norm1's only once the block input requires grad.
        conv = 0 if den.get("use_linear_projection") else 1
        bc = b * ch * hw
        resn = attn = stats = 0
        for k, cin in enumerate(res_in):
            resn += 3 * b * hw * (cin + ch) if grad[0] else 0
            if k < n_attn:
                attn += (1 + conv) * bc if grad[0] else 0
                for _ in range(width):
                    attn += unet_lora_block_saved(ch, hw, b, m, lora, grad[0])
                    if lora or grad[0]:
                        stats += 2 * b * level_heads * hw + 2 * (3 if grad[0] else 2) * b * hw
                    grad[0] = grad[0] or bool(lora)
                attn += conv * bc
        return (Breakdown().add(f"denoiser/activations/{name}/resnets", nbytes(resn, c))
                .add(f"denoiser/activations/{name}/attentions", nbytes(attn, c))
                .add(f"denoiser/activations/{name}/attention_stats", nbytes(stats, "fp32"))
                .add(f"denoiser/activations/{name}/resample", nbytes(extra if grad[0] else 0, c)))
    # diffusers' UNet2DConditionModel reads `attention_head_dim` as the heads per level
    nh = heads if isinstance(heads, list) else [heads] * len(boc)
    for i, (ch, kind) in enumerate(zip(boc, den["down_block_types"])):
        hw = hw0 // 4 ** i
        res_in = [boc[max(i - 1, 0)]] + [ch] * (lpb - 1)
        down = b * ch * hw if i < last else 0  # Downsample2D's conv input
        out.append(level(f"down_{i}", ch, hw, res_in, lpb if kind.startswith("CrossAttn") else 0, tl[i], down,
                         nh[i]))
    mid_attn = 0 if den.get("mid_block_type") == "UNetMidBlock2D" else 1
    out.append(level("mid", boc[-1], hw0 // 4 ** last, [boc[-1]] * 2, mid_attn, tl[-1], 0, nh[-1]))
    rev, rtl = boc[::-1], tl[::-1]
    grad[0] = grad[0] or frozen_up
    for j, kind in enumerate(den["up_block_types"]):
        ch, hw = rev[j], hw0 // 4 ** (last - j)
        res_in = []
        for r in range(lpb + 1):
            prev = (rev[max(j - 1, 0)] if r == 0 else ch)
            skip = ch if r < lpb else rev[min(j + 1, last)]
            res_in.append(prev + skip)
        up = 4 * b * ch * hw if j < last else 0  # Upsample2D: the interpolated tensor
        out.append(level(f"up_{last - j}", ch, hw, res_in, (lpb + 1) if kind.startswith("CrossAttn") else 0,
                         rtl[j], up, nh[last - j]))
    # conv_norm_out (GroupNorm input), conv_act (its output), conv_out (SiLU's output): a
    # stage of their own, after the last up level in forward and first in backward
    out.append(Breakdown().add("denoiser/activations/output/conv_out", 3 * nbytes(b * boc[0] * hw0, c)))
    return out


def unet_lora_transients(pipe: dict, spec: JobSpec, b: int, lat_h: int, lat_w: int,
                         frozen_up: bool = False) -> tuple[Breakdown, Breakdown]:
    """(forward, backward) working sets of the last up level above what it and the levels
    before it saved, with LoRA (measured with the exact CPU meter on tiny SD and SDXL UNets).
    Forward: the skip connections that level reads and that were made before the first
    adapter (conv_in's output and, when the first down level has no attention, its resnets'
    outputs: they require no grad, so nothing saved them, but UNet2DConditionModel.forward's
    `res_samples` holds them until the up block returns), and the level's input (the level
    below's upsampled output: `sample`, the caller's name for it, lives until the block
    returns; no op saves it, the cat with the first skip is a new tensor); then, with attention, the last
    block's GEGLU product (4c x hw; not saved: ff.net.2 is frozen) while ff.net.2 writes its
    output (c x hw); without attention (SDXL's layout), the last ResnetBlock2D's tail
    (models/resnet.py: `conv_shortcut(input_tensor)`, conv2's output, their sum and its
    division by output_scale_factor, c x hw each). Backward (with attention): that block
    first: ff.net.2's input gradient (4c) and MulBackward's two results (4c each), beside
    the gradients of the level's output and of the transformer's output that its residuals
    still hold (c each)."""
    den, c = pipe["denoiser"], spec.precision.compute_dtype
    if spec.method is Method.FULL and not frozen_up:
        return Breakdown(), Breakdown()
    boc, lpb = den["block_out_channels"], den["layers_per_block"]
    bc = b * boc[0] * lat_h * lat_w
    skips = 1 + (0 if den["down_block_types"][0].startswith("CrossAttn") else lpb)
    if frozen_up:  # every skip is `down_block_res_sample + residual`, which nothing saves
        skips = lpb + 1
    fwd = (Breakdown().add("denoiser/forward/skips_without_grad", nbytes(skips * bc, c))
           .add("denoiser/forward/level_input", nbytes(b * boc[min(1, len(boc) - 1)] * lat_h * lat_w, c)))
    if not den["up_block_types"][-1].startswith("CrossAttn"):
        return fwd.add("denoiser/forward/resnet_tail", nbytes(4 * bc, c)), Breakdown()
    return (fwd.add("denoiser/forward/geglu_product", nbytes(4 * bc, c)).add("denoiser/forward/ff_out", nbytes(bc, c)),
            Breakdown().add("denoiser/backward/geglu_grads", nbytes(12 * bc, c))
            .add("denoiser/backward/grad_residuals", nbytes(2 * bc, c)))


def unet_lora_acts_at_peak(pipe: dict, spec: JobSpec, stages: list[Breakdown], b: int, lat_h: int,
                           lat_w: int) -> list[Breakdown] | None:
    """What of each stage's saved tensors is alive at its backward peak, with LoRA and
    attention in the last up level: its peak is in its last block (unet_lora_transients),
    after the Transformer2DModel's proj_out backward, so a conv proj_out's saved input
    (c x hw) is gone. None: all of them (the default)."""
    den, c = pipe["denoiser"], spec.precision.compute_dtype
    if (not den["up_block_types"][-1].startswith("CrossAttn") or den.get("use_linear_projection")
            or spec.method is Method.FULL and not spec.diffusion.controlnet):
        return None
    at_peak = list(stages)
    last = Breakdown(terms=dict(stages[-2].terms))
    key = next(k for k in last.terms if k.endswith("/attentions"))
    last.terms[key] -= nbytes(b * den["block_out_channels"][0] * lat_h * lat_w, c)
    at_peak[-2] = last
    return at_peak


__all__ = ["unet_lora_acts_at_peak", "unet_lora_params", "unet_lora_transients", "unet_stages"]

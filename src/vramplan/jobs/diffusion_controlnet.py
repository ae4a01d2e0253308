"""ControlNet training (`diffusion.controlnet: true`; diffusers examples/controlnet/train_controlnet.py).

The step: the frozen VAE encodes the pixels and the frozen CLIP the prompt (weight dtype w);
a ControlNetModel made by `ControlNetModel.from_unet(unet)` (fp32, trained whole: a copy of
the UNet's conv_in, time embedding, down blocks and mid block, plus the conditioning-image
embedding and a zero 1x1 conv per skip and for the mid block; diffusers
models/controlnets/controlnet.py) reads the noisy latents and the conditioning image; its
residuals, each `.to(w)`, are added to the frozen UNet's skips and mid output
(UNet2DConditionModel.forward's `down_block_additional_residuals`), so the UNet's up path
records a graph back into the ControlNet; MSE against the noise; backward through both;
AdamW over the ControlNet; `zero_grad(set_to_none=False)` (the script's default): its
gradients stay allocated through the next step's forward.
Measured with vramplan.measure.diffusers_controlnet (bench/diffusers).
Legend: b batch, H, W pixels, h, w latents, c_i the conditioning embedding's widths.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.optimizer import optimizer_states, step_temporaries
from vramplan.components.trainable import HeldParam, ParamSet
from vramplan.i18n import Msg, _
from vramplan.jobs.compose import Step, finish
from vramplan.jobs.diffusion_frozen import frozen_modules
from vramplan.jobs.diffusion_unet import unet_lora_acts_at_peak, unet_lora_transients, unet_stages
from vramplan.spec import JobSpec, Method, SpecError
from vramplan.timeline import StepPlan
from vramplan.units import nbytes


def check_controlnet(pipe: dict, spec: JobSpec) -> dict:
    """The pipeline's `controlnet` entry, or one line naming the field to fix."""
    if pipe["kind"] != "unet":
        raise SpecError("diffusion.controlnet", _("a ControlNet is made from a UNet (ControlNetModel.from_unet); "
                                                  "this pipeline's denoiser is not one"))
    if spec.method is not Method.FULL:
        raise SpecError("method", _("train_controlnet.py trains the whole ControlNet: use method full"))
    if spec.diffusion.set_grads_to_none:
        raise SpecError("diffusion.set_grads_to_none", _("the ControlNet step is modelled with train_controlnet.py's "
                                                         "default, its gradients kept between steps; drop the field "
                                                         "or set it to false"))
    entry = pipe.get("controlnet") or {}
    if not isinstance(entry.get("num_params"), int):
        raise SpecError("model.controlnet.num_params", _("give the ControlNet's parameter count "
                                                         "(ControlNetModel.from_unet on the meta device)"))
    return entry


def cond_embedding_saved(entry: dict, b: int, height: int, width: int) -> int:
    """Elements ControlNetConditioningEmbedding saves (diffusers models/controlnets/controlnet.py):
    conv_in, then per width c_i a 3x3 conv and a stride-2 conv to c_{i+1}, a SiLU after each,
    conv_out. Every tensor of that chain is saved once (a trained conv saves its input, SiLU
    its input): conv_in's output and its SiLU, the two convs' outputs and SiLUs at each width
    but the last (4 c_i at H W / 4^i), the last width's conv output and SiLU (2 c_n). The
    conditioning image itself is counted in the batch."""
    widths = entry.get("conditioning_embedding_out_channels", (16, 32, 96, 256))
    plane, out = height * width, 0
    for i, ch in enumerate(widths):
        out += (4 if i < len(widths) - 1 else 2) * ch * plane // 4 ** i
    return b * out


def residual_elems(den: dict, b: int, lat_h: int, lat_w: int) -> int:
    """The ControlNet's residuals, one per UNet skip (conv_in's output, every down resnet's
    and downsampler's) and one for the mid block: their sizes summed."""
    boc, lpb = den["block_out_channels"], den["layers_per_block"]
    hw, out = lat_h * lat_w, b * boc[0] * lat_h * lat_w
    for i, ch in enumerate(boc):
        out += lpb * b * ch * hw // 4 ** i
        if i < len(boc) - 1:
            out += b * ch * hw // 4 ** (i + 1)
    return out + b * boc[-1] * hw // 4 ** (len(boc) - 1)


def controlnet_estimate(pipe: dict, spec: JobSpec, shape: tuple, gpu=None):
    entry = check_controlnet(pipe, spec)
    cfg, den = spec.diffusion, pipe["denoiser"]
    b, c, w = shape[0], spec.precision.compute_dtype, spec.precision.weight_dtype
    lat_h, lat_w = shape[3], shape[4]
    m = max(e["max_tokens"] for e in pipe["text_encoders"])
    latent = b * shape[1] * lat_h * lat_w
    # The ControlNet: fp32 weights, gradients (kept allocated), AdamW states
    params = ParamSet((HeldParam("controlnet", (entry["num_params"],), "fp32", True, "base"),))
    static = (Breakdown().add("controlnet/weights/trainable", nbytes(entry["num_params"], "fp32"))
              .add("controlnet/gradients", nbytes(entry["num_params"], "fp32"))
              .add("denoiser/weights/frozen", nbytes(den["num_params"], w)))
    static.merge(optimizer_states(spec, params), prefix="controlnet/")
    pixels = b * 3 * cfg.height * cfg.width
    static.add("batch/conditioning_pixels", nbytes(pixels, "fp32"))
    if w != "fp32":  # controlnet_image = conditioning_pixel_values.to(weight_dtype)
        static.add("batch/conditioning_image", nbytes(pixels, w))
    for name in ("latents", "noise", "noisy_latents"):
        static.add(f"batch/{name}", nbytes(latent, w))
    # its outputs, alive under their names (down_block_res_samples) to the next step
    static.add("controlnet/residuals", nbytes(residual_elems(den, b, lat_h, lat_w), "fp32"))
    # Forward stages: the ControlNet (conditioning embedding, down levels, mid: trained whole),
    # then the frozen UNet's up path (its down path and mid block record nothing)
    boc = den["block_out_channels"]
    full = unet_stages(pipe, spec, b, lat_h, lat_w, m)[:len(boc) + 1]
    frozen = unet_stages(pipe, spec, b, lat_h, lat_w, m, frozen_up=True)[len(boc) + 1:]
    cond = Breakdown().add("controlnet/activations/cond_embedding",
                           nbytes(cond_embedding_saved(entry, b, cfg.height, cfg.width), c))
    if c != "fp32":
        # accelerate's autocast around the ControlNet's forward: torch autocast's cached_cast
        # makes a c copy of each weight its convs and linears read, and autograd saves it for
        # their backward, to the end of it (all its parameters counted: its norms' few stay fp32)
        cond.add("controlnet/activations/autocast_weight_casts", nbytes(entry["num_params"], c))
    stages = [cond] + [Breakdown().merge(s) for s in full] + frozen
    for s in stages[1:len(boc) + 2]:  # the copied encoder's terms under the ControlNet's name
        s.terms = {k.replace("denoiser/", "controlnet/", 1): v for k, v in s.terms.items()}
    fwd, bwd = unet_lora_transients(pipe, spec, b, lat_h, lat_w, frozen_up=True)
    transient = [Breakdown() for _ in stages]
    transient[-2] = bwd
    if c == "fp32":
        loss_saved = Breakdown().add("loss/pred", nbytes(latent, c))
    else:  # the UNet is not prepared: its prediction is w; mse_loss saves the two .float() copies
        loss_saved = Breakdown().add("loss/pred_fp32", nbytes(latent, "fp32")).add("loss/target_fp32",
                                                                                  nbytes(latent, "fp32"))
        static.add("loss/pred", nbytes(latent, w))
    plan = StepPlan(static=static, grads_by_stage=[Breakdown() for _ in stages], stage_acts=stages,
                    loss_saved=loss_saved, forward_end_transient=Breakdown(),
                    loss_backward_transient=Breakdown().add("loss/grad_pred_fp32", nbytes(latent, "fp32")),
                    stage_backward_transient=transient, optimizer_temporaries=step_temporaries(spec, params),
                    labels=[f"stage {i} backward" for i in range(len(stages))])
    plan.stage_forward_transient = [Breakdown() for _ in stages]
    plan.stage_forward_transient[-2] = fwd
    plan.stage_acts_at_peak = unet_lora_acts_at_peak(pipe, spec, stages, b, lat_h, lat_w)
    step = Step(plan)
    notes = [f"latents {shape}", Msg("ControlNet of {count} parameters trained in fp32 beside the frozen UNet "
                                    "(train_controlnet.py); its gradients stay allocated (zero_grad(set_to_none=False))",
                                    count=entry["num_params"])]
    total = {"denoiser": den["num_params"], "controlnet": entry["num_params"]}
    total.update(frozen_modules(pipe, spec, step, b, c, w, notes, 0))
    from types import SimpleNamespace
    return finish(spec, SimpleNamespace(name=pipe.get("name", "pipeline")), step, num_params=total,
                  trainable_params=entry["num_params"], gpu=gpu, notes=notes)


__all__ = ["check_controlnet", "cond_embedding_saved", "controlnet_estimate", "residual_elems"]

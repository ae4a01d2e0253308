"""diffusers' example ControlNet training step (examples/controlnet/train_controlnet.py), run on a
tiny random-init pipeline under the meter.

    from vramplan.measure.diffusers_controlnet import measure_controlnet_step
    result = measure_controlnet_step(job)   # result.runner["entry"] ends with train_controlnet.py

As measure/diffusers_step.py does for the LoRA scripts, the script's loop body is followed
statement by statement around the real classes: `ControlNetModel.from_unet(unet)` (diffusers:
a copy of the UNet's conv_in, time embedding, down blocks and mid block, the conditioning-image
embedding `controlnet_cond_embedding`, and a zero 1x1 conv per skip and for the mid block),
the frozen UNet2DConditionModel, AutoencoderKL and CLIPTextModel, DDPMScheduler, and
accelerate's `Accelerator`, which prepares only the ControlNet and its optimizer (autocast
and fp32 outputs wrap the ControlNet's forward, not the UNet's).

Setup: the VAE, UNet and text encoder frozen and cast to `weight_dtype`; the ControlNet stays
fp32 (the script refuses any other dtype for it) and trains whole; AdamW over
`controlnet.parameters()`. Loop body: the VAE encodes the pixels; noise, timesteps,
`add_noise(latents.float(), noise.float(), t).to(weight_dtype)`; CLIP on the ids (frozen, no
graph); the conditioning image `.to(weight_dtype)`; the ControlNet's residuals, each
`.to(weight_dtype)` into the UNet's `down_block_additional_residuals` /
`mid_block_additional_residual`; `F.mse_loss(pred.float(), target.float())` against the
noise; backward through the frozen UNet into the ControlNet; `clip_grad_norm_` over the
ControlNet; step; `zero_grad(set_to_none=args.set_grads_to_none)` (False by default: the
gradients stay allocated, zeroed, through the next step). Phases `s{n}.fwd|bwd|opt`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import MeasureResult
from .build import build_optimizer, norm_precision
from .diffusion import build_denoiser, latent_dims
from .diffusers_models import build_text_encoder, build_vae
from .jobs import _live_tensors
from .meter import MemoryMeter
from .result import metered_result
from .run import unique_bytes

ENTRY = "examples/controlnet/train_controlnet.py"
KINDS = {"fwd": "forward", "bwd": "backward", "opt": "optimizer"}
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_controlnet(unet, pipe: dict):
    """`ControlNetModel.from_unet(unet)` with the pipeline's conditioning embedding widths;
    its parameter count must be the entry's `controlnet.num_params`."""
    from diffusers import ControlNetModel
    entry = pipe.get("controlnet") or {}
    widths = tuple(entry.get("conditioning_embedding_out_channels", (16, 32, 96, 256)))
    model = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=widths)
    built = sum(p.numel() for p in model.parameters())
    if entry.get("num_params") != built:
        raise ValueError(f"controlnet.num_params: the pipeline says {entry.get('num_params')}, "
                         f"the built ControlNetModel has {built}")
    return model


def measure_controlnet_step(job, steps: int = 2, trace: bool = False) -> MeasureResult:
    from accelerate import Accelerator
    job = dict(job.to_dict() if hasattr(job, "to_dict") else job)
    pipe, diffusion = job["model"], dict(job.get("diffusion") or {})
    if job.get("method", "full") != "full":
        raise ValueError("method: train_controlnet.py trains the whole ControlNet (full)")
    word = norm_precision(job.get("precision", "fp32")).split("-")[-1]
    if word not in WEIGHT_DTYPES:
        raise ValueError("precision: the ControlNet script takes fp32, bf16 or fp16 (--mixed_precision)")
    weight_dtype = WEIGHT_DTYPES[word]
    accelerator = Accelerator(mixed_precision="no" if word == "fp32" else word, cpu=True)
    torch.manual_seed(0)
    unet = build_denoiser(pipe, diffusion, torch.float32)
    controlnet = build_controlnet(unet, pipe)
    vae, text_encoder = build_vae(pipe), build_text_encoder(pipe["text_encoders"][0])
    for m in (vae, unet, text_encoder):
        m.requires_grad_(False)
    controlnet.train()
    if job.get("gradient_checkpointing") in ("full", True):
        controlnet.enable_gradient_checkpointing()
    optimizer = build_optimizer(list(controlnet.parameters()), job)
    prepared, optimizer = accelerator.prepare(controlnet, optimizer)
    for m in (vae, unet, text_encoder):
        m.to(dtype=weight_dtype)
    meter = MemoryMeter(trace=trace)
    if trace:
        meter.track_modules(controlnet)
    meter.register(controlnet.parameters(), "parameter")
    for m in (vae, unet, text_encoder):
        meter.register(m.parameters(), "frozen_parameter")
        meter.register(m.buffers(), "buffer")
    meter.register(controlnet.buffers(), "buffer")
    meter.register(_live_tensors(), "preexisting")
    with meter:
        grads = _steps(pipe, diffusion, vae, unet, text_encoder, prepared, controlnet, optimizer, accelerator, meter,
                       weight_dtype, int(job.get("micro_batch_size", 1)), steps)
    result = metered_result(meter, controlnet, optimizer, grads, KINDS, trace=trace)
    import diffusers
    result.runner = {"library": "diffusers", "version": diffusers.__version__, "entry": ENTRY,
                     "note": "the script's training step followed statement by statement around the real "
                             "diffusers, transformers and accelerate classes (measure/diffusers_controlnet.py)"}
    return result


def _steps(pipe, diffusion, vae, unet, text_encoder, controlnet, raw, optimizer, accelerator, meter, weight_dtype,
           b: int, steps: int) -> int:
    """train_controlnet.py's loop body (its names kept alive across steps)."""
    from diffusers import DDPMScheduler
    noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
    g = torch.Generator().manual_seed(0)
    f, c, h, w = latent_dims(pipe, diffusion)
    s = pipe["vae"]["spatial_compression"]
    entry = pipe["text_encoders"][0]
    grads = 0
    for n in range(1, steps + 1):
        with meter.phase(f"s{n}.fwd"):
            # the prepared dataloader's batch: fp32 pixels and conditioning images, int64 ids
            batch = {"pixel_values": torch.randn(b, 3, h * s, w * s, generator=g),
                     "conditioning_pixel_values": torch.rand(b, 3, h * s, w * s, generator=g),
                     "input_ids": torch.randint(0, entry.get("vocab_size", 1000), (b, entry["max_tokens"]), generator=g)}
            latents = vae.encode(batch["pixel_values"].to(dtype=weight_dtype)).latent_dist.sample()
            latents = latents * vae.config.scaling_factor
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (b,)).long()
            noisy_latents = noise_scheduler.add_noise(latents.float(), noise.float(), timesteps).to(dtype=weight_dtype)
            encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
            controlnet_image = batch["conditioning_pixel_values"].to(dtype=weight_dtype)
            down_block_res_samples, mid_block_res_sample = controlnet(
                noisy_latents, timesteps, encoder_hidden_states=encoder_hidden_states,
                controlnet_cond=controlnet_image, return_dict=False)
            model_pred = unet(noisy_latents, timesteps, encoder_hidden_states=encoder_hidden_states,
                              down_block_additional_residuals=[x.to(dtype=weight_dtype) for x in down_block_res_samples],
                              mid_block_additional_residual=mid_block_res_sample.to(dtype=weight_dtype),
                              return_dict=False)[0]
            target = noise
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        if n == steps:
            meter.mark("end_of_forward")
        with meter.phase(f"s{n}.bwd"):
            accelerator.backward(loss)
        grads = unique_bytes([q.grad for q in raw.parameters() if q.grad is not None])
        with meter.phase(f"s{n}.opt"):
            accelerator.clip_grad_norm_(raw.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    return grads


__all__ = ["ENTRY", "build_controlnet", "measure_controlnet_step"]

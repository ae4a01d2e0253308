"""diffusers' example LoRA training steps, run on tiny random-init pipelines under the meter.

    from vramplan.measure.diffusers_step import measure_diffusers_step
    result = measure_diffusers_step(job)   # result.runner["library"] == "diffusers"

The example scripts are not part of the installed package (they parse arguments and load
hub checkpoints), so their step is followed statement by statement here around the real
classes: the pipeline's diffusers denoiser, VAE and scheduler, the transformers text
encoder(s), PEFT's LoRA through `ModelMixin.add_adapter`, diffusers'
`training_utils.cast_training_params`, and accelerate's `Accelerator` (its `prepare` wraps
the denoiser's forward in torch.autocast and converts its outputs to fp32; `backward`;
`clip_grad_norm_`). Two scripts (diffusers main, examples/):

- text_to_image/train_text_to_image_lora.py (a `UNet2DConditionModel`): every frozen
  model and the UNet cast to `weight_dtype` (fp32, or the --mixed_precision dtype);
  LoRA (init "gaussian") on to_q/to_k/to_v/to_out.0, upcast to fp32 only under fp16
  (`cast_training_params`). In each step the VAE encodes the batch's pixels
  (`vae.encode(pixel_values.to(weight_dtype)).latent_dist.sample() * scaling_factor`) and
  the CLIP text encoder runs on the token ids, both frozen (no graph: nothing requires
  grad); DDPMScheduler.add_noise; `F.mse_loss(model_pred.float(), target.float())`
  against the noise; `accelerator.backward`; AdamW step; `zero_grad()`. The clip runs on
  `lora_layers`, a `filter` the optimizer already consumed: it clips nothing.
- cogvideo/train_cogvideox_lora.py (a `CogVideoXTransformer3DModel`): the same casts and
  LoRA (init True); the videos are encoded by the VAE *before* training
  (`encode_video`: one video at a time, its `latent_dist` kept on the device for the whole
  run), the collate function samples them (`sample() * scaling_factor`, cat, permute,
  contiguous, `.float()`); in the step the T5 encoder runs under `torch.no_grad()`, then
  `add_noise`, the transformer, `scheduler.get_velocity`, the loss
  `mean(weights * (pred - x0) ** 2)` with `weights = 1 / (1 - alphas_cumprod[t])`,
  backward, `clip_grad_norm_` over the transformer, step, `zero_grad()`.

The step's names live on as in the scripts (a loop body, nothing deleted): the previous
step's latents, noise, prediction and loss are alive until the next step rebinds them.
Precomputed text embeddings / latents (`diffusion.text_encoders|vae: precomputed`) come in
the batch instead. Phases: `s0.encode` (the cogvideo script's encoding ahead of training),
`s{n}.fwd` (the image scripts' VAE encode inside it as `s{n}.encode`, a forward phase of
its own so that its peak is reported: `phase_peaks`), `s{n}.bwd`, `s{n}.opt`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import MeasureResult
from .build import build_optimizer, norm_precision
from .diffusion import build_denoiser, latent_dims
from .diffusion_inputs import text_dim, text_tokens
from .diffusers_models import build_text_encoder, build_vae
from .jobs import _live_tensors
from .meter import MemoryMeter
from .result import metered_result
from .run import unique_bytes

SCRIPTS = {"UNet2DConditionModel": "examples/text_to_image/train_text_to_image_lora.py",
           "CogVideoXTransformer3DModel": "examples/cogvideo/train_cogvideox_lora.py"}
SDXL_SCRIPT = "examples/text_to_image/train_text_to_image_lora_sdxl.py"
KINDS = {"encode": "forward", "fwd": "forward", "bwd": "backward", "opt": "optimizer"}
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def script_of(pipe: dict) -> str:
    """The example script that trains this pipeline's denoiser: a UNet with SDXL's added
    conditioning (`addition_embed_type: text_time`) is train_text_to_image_lora_sdxl.py's."""
    den = pipe["denoiser"]
    if den["class"] == "UNet2DConditionModel" and den.get("addition_embed_type") == "text_time":
        return SDXL_SCRIPT
    return SCRIPTS[den["class"]]


def runs_script(job: dict) -> bool:
    """A diffusion job the scripts' step measures: a LoRA job on one of their denoisers."""
    cls = (job.get("model") or {}).get("denoiser", {}).get("class") if isinstance(job.get("model"), dict) else None
    return cls in SCRIPTS and job.get("method", "full") == "lora"


class _Pipeline:
    """The models of one script run, cast and adapted as the script does."""

    def __init__(self, job: dict, weight_dtype: torch.dtype):
        from peft import LoraConfig
        from diffusers.training_utils import cast_training_params
        pipe, diffusion = job["model"], dict(job.get("diffusion") or {})
        self.pipe, self.diffusion, self.dtype = pipe, diffusion, weight_dtype
        torch.manual_seed(0)
        self.denoiser = build_denoiser(pipe, diffusion, torch.float32)
        built = sum(p.numel() for p in self.denoiser.parameters())
        if pipe["denoiser"].get("num_params") != built:
            raise ValueError(f"denoiser.num_params: the pipeline says {pipe['denoiser'].get('num_params')}, "
                             f"the built {pipe['denoiser']['class']} has {built}")
        self.vae = build_vae(pipe) if diffusion.get("vae", "frozen") != "precomputed" else None
        self.encoders = ([build_text_encoder(e) for e in pipe["text_encoders"]]
                         if diffusion.get("text_encoders", "frozen") != "precomputed" else [])
        frozen = [m for m in [self.vae, *self.encoders] if m is not None]
        self.script = script_of(pipe)
        for m in [self.denoiser, *frozen]:  # requires_grad_(False), then .to(device, dtype=weight_dtype)
            m.requires_grad_(False).to(dtype=weight_dtype)
        if self.vae is not None and self.script == SDXL_SCRIPT:  # "The VAE is in float32 to avoid NaN losses."
            self.vae.to(dtype=torch.float32)
        if self.vae is not None:
            if diffusion.get("vae_slicing"):
                self.vae.enable_slicing()
            if diffusion.get("vae_tiling"):
                self.vae.enable_tiling()
        if job.get("gradient_checkpointing") in ("full", True):
            self.denoiser.enable_gradient_checkpointing()
        r = int((job.get("lora") or {}).get("r", 8))
        init = "gaussian" if pipe["denoiser"]["class"] == "UNet2DConditionModel" else True
        self.denoiser.add_adapter(LoraConfig(r=r, lora_alpha=r, init_lora_weights=init,
                                             target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
        if weight_dtype == torch.float16:  # only upcast trainable parameters (LoRA) into fp32
            cast_training_params(self.denoiser, dtype=torch.float32)
        self.frozen = frozen


def measure_diffusers_step(job, steps: int = 2, trace: bool = False) -> MeasureResult:
    from accelerate import Accelerator
    job = dict(job.to_dict() if hasattr(job, "to_dict") else job)
    cls = job["model"]["denoiser"]["class"]
    if not runs_script(job):
        raise ValueError(f"model.denoiser.class: the diffusers scripts' LoRA step runs {', '.join(SCRIPTS)}")
    word = norm_precision(job.get("precision", "fp32")).split("-")[-1]
    if word not in WEIGHT_DTYPES:
        raise ValueError("precision: the diffusers scripts take fp32, bf16 or fp16 (--mixed_precision)")
    accelerator = Accelerator(mixed_precision="no" if word == "fp32" else word, cpu=True)
    p = _Pipeline(job, WEIGHT_DTYPES[word])
    p.denoiser.train()
    opt = build_optimizer([q for q in p.denoiser.parameters() if q.requires_grad], job)
    model, prepared = accelerator.prepare(p.denoiser, opt)
    meter = MemoryMeter(trace=trace)
    if trace:
        meter.track_modules(p.denoiser)
    meter.register(p.denoiser.parameters(), "parameter")
    meter.register(p.denoiser.buffers(), "buffer")
    for m in p.frozen:
        meter.register(m.parameters(), "frozen_parameter")
        meter.register(m.buffers(), "buffer")
    meter.register(_live_tensors(), "preexisting")
    step = {SDXL_SCRIPT: _sdxl_steps, SCRIPTS["UNet2DConditionModel"]: _unet_steps}.get(p.script, _cogvideox_steps)
    with meter:
        grads = step(p, model, prepared, accelerator, meter, int(job.get("micro_batch_size", 1)), steps)
    result = metered_result(meter, p.denoiser, opt, grads, KINDS, trace=trace)
    import diffusers
    result.runner = {"library": "diffusers", "version": diffusers.__version__, "entry": p.script,
                     "note": "the script's training step followed statement by statement around the real "
                             "diffusers, transformers, PEFT and accelerate classes (measure/diffusers_step.py)"}
    return result


def _ids(entry: dict, b: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, entry.get("vocab_size", 1000), (b, entry["max_tokens"]), generator=g)


def _unet_steps(p: _Pipeline, unet, optimizer, accelerator, meter, b: int, steps: int) -> int:
    """train_text_to_image_lora.py's loop body (its names kept alive across steps)."""
    from diffusers import DDPMScheduler
    noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
    g = torch.Generator().manual_seed(0)
    f, c, h, w = latent_dims(p.pipe, p.diffusion)
    s = p.pipe["vae"]["spatial_compression"]
    grads = 0
    for n in range(1, steps + 1):
        with meter.phase(f"s{n}.fwd"):
            # the prepared dataloader's batch on the device: fp32 pixels, int64 token ids
            if p.vae is not None:
                pixel_values = torch.randn(b, 3, h * s, w * s, generator=g)
                with meter.phase(f"s{n}.encode"):  # the encode's own peak, beside the step's
                    latents = p.vae.encode(pixel_values.to(dtype=p.dtype)).latent_dist.sample()
                latents = latents * p.vae.config.scaling_factor
            else:
                latents = torch.randn(b, c, h, w, generator=g).to(p.dtype)
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (b,)).long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            if p.encoders:
                input_ids = _ids(p.pipe["text_encoders"][0], b, g)
                encoder_hidden_states = p.encoders[0](input_ids, return_dict=False)[0]
            else:
                encoder_hidden_states = torch.randn(b, text_tokens(p.pipe), text_dim(p.pipe), generator=g).to(p.dtype)
            target = noise
            model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        if n == steps:
            meter.mark("end_of_forward")
        with meter.phase(f"s{n}.bwd"):
            accelerator.backward(loss)
        grads = unique_bytes([q.grad for q in p.denoiser.parameters() if q.grad is not None])
        with meter.phase(f"s{n}.opt"):
            optimizer.step()
            optimizer.zero_grad()
    return grads


def _sdxl_steps(p: _Pipeline, unet, optimizer, accelerator, meter, b: int, steps: int) -> int:
    """train_text_to_image_lora_sdxl.py's loop body (no --pretrained_vae_model_name_or_path:
    the VAE is fp32 and reads the dataloader's fp32 pixels). `encode_prompt` runs both CLIP
    encoders with `output_hidden_states=True`, keeps each one's penultimate hidden state,
    concatenates them on the feature axis and keeps the last encoder's first output (CLIP-G's
    projected pooled embedding) as `text_embeds`; the six size/crop ids are built per image
    in the weight dtype. The clip runs on `params_to_optimize`, a list: it clips."""
    from diffusers import DDPMScheduler
    noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
    g = torch.Generator().manual_seed(0)
    f, c, h, w = latent_dims(p.pipe, p.diffusion)
    s = p.pipe["vae"]["spatial_compression"]
    size = h * s
    params_to_optimize = [q for q in p.denoiser.parameters() if q.requires_grad]
    grads = 0
    for n in range(1, steps + 1):
        with meter.phase(f"s{n}.fwd"):
            if p.vae is not None:
                pixel_values = torch.randn(b, 3, h * s, w * s, generator=g)
                with meter.phase(f"s{n}.encode"):
                    model_input = p.vae.encode(pixel_values).latent_dist.sample()
                model_input = model_input * p.vae.config.scaling_factor
                model_input = model_input.to(p.dtype)
            else:
                model_input = torch.randn(b, c, h, w, generator=g).to(p.dtype)
            noise = torch.randn_like(model_input)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (b,)).long()
            noisy_model_input = noise_scheduler.add_noise(model_input, noise, timesteps)
            add_time_ids = torch.cat([torch.tensor([[size, size, 0, 0, size, size]]).to(dtype=p.dtype)
                                      for _ in range(b)])
            unet_added_conditions = {"time_ids": add_time_ids}
            if p.encoders:
                prompt_embeds, pooled_prompt_embeds = _sdxl_encode_prompt(p, b, g)
            else:
                prompt_embeds = torch.randn(b, text_tokens(p.pipe), text_dim(p.pipe), generator=g).to(p.dtype)
                pooled_prompt_embeds = torch.randn(b, p.pipe["text_encoders"][-1]["projection_dim"],
                                                   generator=g).to(p.dtype)
            unet_added_conditions.update({"text_embeds": pooled_prompt_embeds})
            model_pred = unet(noisy_model_input, timesteps, prompt_embeds, added_cond_kwargs=unet_added_conditions,
                              return_dict=False)[0]
            target = noise
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        if n == steps:
            meter.mark("end_of_forward")
        with meter.phase(f"s{n}.bwd"):
            accelerator.backward(loss)
        grads = unique_bytes([q.grad for q in p.denoiser.parameters() if q.grad is not None])
        with meter.phase(f"s{n}.opt"):
            accelerator.clip_grad_norm_(params_to_optimize, 1.0)
            optimizer.step()
            optimizer.zero_grad()
    return grads


def _sdxl_encode_prompt(p: _Pipeline, b: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The SDXL script's `encode_prompt` on token ids."""
    prompt_embeds_list = []
    for entry, text_encoder in zip(p.pipe["text_encoders"], p.encoders):
        prompt_embeds = text_encoder(_ids(entry, b, g), output_hidden_states=True, return_dict=False)
        pooled_prompt_embeds = prompt_embeds[0]
        prompt_embeds = prompt_embeds[-1][-2]
        bs_embed, seq_len, _ = prompt_embeds.shape
        prompt_embeds_list.append(prompt_embeds.view(bs_embed, seq_len, -1))
    prompt_embeds = torch.concat(prompt_embeds_list, dim=-1)
    return prompt_embeds, pooled_prompt_embeds.view(bs_embed, -1)


def _cogvideox_steps(p: _Pipeline, transformer, optimizer, accelerator, meter, b: int, steps: int) -> int:
    """train_cogvideox_lora.py: the videos encoded ahead, then the loop body."""
    from diffusers import CogVideoXDPMScheduler
    scheduler = CogVideoXDPMScheduler(num_train_timesteps=1000)
    g = torch.Generator().manual_seed(0)
    f, c, h, w = latent_dims(p.pipe, p.diffusion)
    s, frames = p.pipe["vae"]["spatial_compression"], int(p.diffusion.get("num_frames", 1))
    with meter.phase("s0.encode"):
        if p.vae is not None:
            encoded = []
            for _ in range(b):  # the dataset: one batch of videos, (F, C, H, W) in host memory
                video = torch.randn(frames, 3, h * s, w * s, generator=g)
                meter.mark_host(video)
                # encode_video: .to(device, dtype=vae.dtype) is a copy onto the device
                video = video.to(dtype=p.vae.dtype, copy=True).unsqueeze(0).permute(0, 2, 1, 3, 4)
                encoded.append(p.vae.encode(video).latent_dist)
                del video
        else:  # precomputed latents, (F, C, H, W) each
            latents = [torch.randn(1, c, f, h, w, generator=g).to(p.dtype) for _ in range(b)]
    entry = p.pipe["text_encoders"][-1]
    grads = 0
    for n in range(1, steps + 1):
        with meter.phase(f"s{n}.fwd"):
            # collate_fn
            if p.vae is not None:
                videos = [e.sample() * p.vae.config.scaling_factor for e in encoded]
            else:
                videos = latents
            videos = torch.cat(videos)
            videos = videos.permute(0, 2, 1, 3, 4)
            videos = videos.to(memory_format=torch.contiguous_format).float()
            batch = {"videos": videos}
            model_input = batch["videos"].to(dtype=p.dtype)  # [B, F, C, H, W]
            if p.encoders:  # compute_prompt_embeddings(..., requires_grad=False)
                with torch.no_grad():
                    prompt_embeds = p.encoders[-1](_ids(entry, b, g))[0]
                    prompt_embeds = prompt_embeds.to(dtype=p.dtype)
                    _, seq_len, _ = prompt_embeds.shape
                    prompt_embeds = prompt_embeds.repeat(1, 1, 1)
                    prompt_embeds = prompt_embeds.view(b, seq_len, -1)
            else:
                prompt_embeds = torch.randn(b, text_tokens(p.pipe), text_dim(p.pipe), generator=g).to(p.dtype)
            noise = torch.randn_like(model_input)
            batch_size = model_input.shape[0]
            timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (batch_size,)).long()
            noisy_model_input = scheduler.add_noise(model_input, noise, timesteps)
            model_output = transformer(hidden_states=noisy_model_input, encoder_hidden_states=prompt_embeds,
                                       timestep=timesteps, image_rotary_emb=None, return_dict=False)[0]
            model_pred = scheduler.get_velocity(model_output, noisy_model_input, timesteps)
            alphas_cumprod = scheduler.alphas_cumprod[timesteps]
            weights = 1 / (1 - alphas_cumprod)
            while len(weights.shape) < len(model_pred.shape):
                weights = weights.unsqueeze(-1)
            target = model_input
            loss = torch.mean((weights * (model_pred - target) ** 2).reshape(batch_size, -1), dim=1)
            loss = loss.mean()
        if n == steps:
            meter.mark("end_of_forward")
        with meter.phase(f"s{n}.bwd"):
            accelerator.backward(loss)
        grads = unique_bytes([q.grad for q in p.denoiser.parameters() if q.grad is not None])
        with meter.phase(f"s{n}.opt"):
            accelerator.clip_grad_norm_(transformer.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    return grads


__all__ = ["SCRIPTS", "SDXL_SCRIPT", "measure_diffusers_step", "runs_script", "script_of"]

"""What diffusers' example training scripts (`stack: diffusers-scripts`) do that a generic
diffusion step does not, from their source (diffusers main, examples/):

- cogvideo/train_cogvideox_lora.py: the VAE encodes every video *before* training, one at
  a time (`encode_video`), and each `latent_dist` stays on the device for the whole run,
  with the VAE itself (it is not deleted); the loss is v-prediction through
  `scheduler.get_velocity`.
- text_to_image/train_text_to_image_lora.py: the VAE encodes the batch's pixels inside the
  step; `F.mse_loss(model_pred.float(), target.float())` against the noise.
- Both: every model cast to `weight_dtype` (the --mixed_precision dtype), LoRA adapters in
  it too (upcast to fp32 only under fp16), accelerate's autocast with its outputs converted
  to fp32 (`convert_outputs_to_fp32`), and the loop body's names (latents, noise,
  prediction, text states) alive until the next step rebinds them.
Measured with vramplan.measure.diffusers_step (bench/diffusers).
Legend: b batch, C latent channels, f latent frames, T frames in flight, w weight dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.spec import JobSpec, Method
from vramplan.spec.stack import Framework
from vramplan.units import nbytes


def scripts_stack(spec: JobSpec) -> bool:
    return spec.stack.framework is Framework.DIFFUSERS_SCRIPTS


def grads_kept(spec: JobSpec) -> bool:
    """Whether the trained part's gradients stay allocated from one step's optimizer step
    into the next forward: `optimizer.zero_grad(set_to_none=False)` zeroes them in place.
    diffusers' dreambooth/train_dreambooth.py (full fine-tuning; the script the spec's
    prior_preservation under `stack: diffusers-scripts` names) and the ControlNet scripts
    call `zero_grad(set_to_none=args.set_grads_to_none)` with `--set_grads_to_none` a
    store_true flag, so False unless given; the other scripts call `zero_grad()` (torch's
    default set_to_none=True). `diffusion.set_grads_to_none` overrides."""
    cfg = spec.diffusion
    if cfg is None:
        return False
    if cfg.set_grads_to_none is not None:
        return not cfg.set_grads_to_none
    if cfg.controlnet:
        return True
    return scripts_stack(spec) and spec.method is Method.FULL and cfg.prior_preservation


def adapter_dtype(spec: JobSpec) -> str:
    """The LoRA adapters' dtype. diffusers' scripts add them with `ModelMixin.add_adapter`
    (PEFT `inject_adapter_in_model`: the adapter takes the base layer's dtype, the
    `weight_dtype` the model was cast to) and upcast them to fp32 only under fp16
    (`if args.mixed_precision == "fp16": cast_training_params(unet, dtype=torch.float32)`,
    train_text_to_image_lora.py, train_cogvideox_lora.py). Elsewhere fp32 (PEFT's
    `autocast_adapter_dtype`)."""
    w = spec.precision.weight_dtype
    if scripts_stack(spec) and w != "fp16":
        return w
    return "fp32"


def sdxl_script(pipe: dict, spec: JobSpec) -> bool:
    """text_to_image/train_text_to_image_lora_sdxl.py: a UNet with SDXL's added conditioning
    (`addition_embed_type: text_time`) under the scripts' stack."""
    return scripts_stack(spec) and pipe["denoiser"].get("addition_embed_type") == "text_time"


def vae_dtype(pipe: dict, spec: JobSpec) -> str:
    """The VAE's dtype: the SDXL script keeps it in fp32 ("The VAE is in float32 to avoid NaN
    losses": `vae.to(accelerator.device, dtype=torch.float32)` without
    --pretrained_vae_model_name_or_path) and encodes the dataloader's fp32 pixels with it;
    elsewhere the weight dtype."""
    return "fp32" if sdxl_script(pipe, spec) else spec.precision.weight_dtype


def first_channels(vae: dict) -> int:
    """The width of the VAE's first level: the entry's `block_out_channels[0]` (the
    diffusers config key) or `first_channels` (128 for the SD/CogVideoX VAEs)."""
    if vae.get("block_out_channels"):
        return int(vae["block_out_channels"][0])
    return int(vae.get("first_channels", 128))


def encodes_ahead(pipe: dict, spec: JobSpec) -> bool:
    """The CogVideoX script's order: videos encoded before training, latents kept."""
    return scripts_stack(spec) and pipe["vae"].get("class") == "AutoencoderKLCogVideoX"


def cogvideox_encode(pipe: dict, spec: JobSpec, b: int) -> tuple[Breakdown, Breakdown]:
    """(kept through training, the encode's working set) of train_cogvideox_lora.py's
    `encode_video`, one video at a time in the weight dtype w.
    Kept: each video's DiagonalGaussianDistribution (diffusers models/autoencoders/vae.py):
    `parameters` (2C), the clamped `logvar` (C), `std` and `var` (C each): 5 latent sizes
    per video, b videos (the measured dataset is one batch; a real run keeps all of its
    videos). Working set: the video's device copy (all frames, 3 channels) and, at the
    first level's first ResnetBlock's conv2 (models/autoencoders/autoencoder_kl_cogvideox.py
    CogVideoXResnetBlock3D, CogVideoXCausalConv3d), T frames in flight ch0 wide: conv_in's
    output (the residual), the SiLU output, the causal cat of k - 1 cached frames before it
    (T + k - 1), conv2's output, and the k - 1 frame caches (`conv_cache`, a clone) of
    conv1 and conv2 (the time kernel k = 3), plus conv_in's cache of the 3-channel input.
    T: `_encode` runs `num_sample_frames_batch_size` (8) frames at a time, the first batch
    taking the remainder (8 + frames % 8)."""
    cfg, vae = spec.diffusion, pipe["vae"]
    w = spec.precision.weight_dtype
    s, t = vae["spatial_compression"], vae["temporal_compression"]
    frames, height, width = cfg.num_frames, cfg.height, cfg.width
    f = 1 if frames == 1 else (frames - 1) // t + 1
    latent = vae["latent_channels"] * f * (height // s) * (width // s)
    kept = Breakdown().add("batch/latent_dist", 5 * nbytes(b * latent, w))
    k, batch = 3, 8
    in_flight = min(frames, batch + frames % batch) if frames >= batch else frames
    plane = height * width
    work = (Breakdown().add("forward/video", nbytes(3 * frames * plane, w))
            .add("forward/conv_in_cache", nbytes(3 * (k - 1) * plane, w))
            .add("forward/level0", nbytes(first_channels(vae) * (4 * in_flight + 3 * (k - 1)) * plane, w)))
    return kept, work


def script_loss(pipe: dict, spec: JobSpec, latent_elems: int) -> tuple[Breakdown, Breakdown]:
    """(alive from the forward to the next step, saved for backward) of the scripts' loss.
    The prediction: accelerate's `convert_outputs_to_fp32` makes an fp32 copy of the
    denoiser's output under mixed precision (the output itself in fp32). CogVideoX:
    `model_pred = scheduler.get_velocity(model_output, noisy_model_input, t)` (fp32, a new
    tensor), then `mean(weights * (model_pred - target) ** 2)`: the pow saves the
    difference (fp32); the collate function's `.float()` copy of the latents stays in
    `batch` under mixed precision. The image script: `mse_loss` saves its two inputs, the
    fp32 prediction and, under mixed precision, `target.float()`'s copy of the noise."""
    w = spec.precision.weight_dtype
    named = Breakdown().add("loss/model_output", nbytes(latent_elems, "fp32"))
    if encodes_ahead(pipe, spec) or pipe["kind"] == "video-dit":
        named.add("loss/velocity", nbytes(latent_elems, "fp32"))
        if w != "fp32":
            named.add("batch/latents_fp32", nbytes(latent_elems, "fp32"))
        return named, Breakdown().add("loss/difference", nbytes(latent_elems, "fp32"))
    saved = Breakdown()
    if w != "fp32":
        saved.add("loss/target_fp32", nbytes(latent_elems, "fp32"))
    return named, saved


__all__ = ["sdxl_script", "vae_dtype", "adapter_dtype", "cogvideox_encode", "encodes_ahead", "first_channels",
           "grads_kept", "script_loss", "scripts_stack"]

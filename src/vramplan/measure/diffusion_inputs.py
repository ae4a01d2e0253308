"""The inputs each diffusers denoiser class takes in a training step, built from a pipeline.

Each class reads its latents in its own layout and its conditioning under its own keyword
names (diffusers 0.42 `forward` signatures); what the training scripts pass is built here
with random values:

- CogVideoXTransformer3DModel: latents (b, F, C, H, W) (examples/cogvideo/train_cogvideox_lora.py
  permutes the VAE's (b, C, F, H, W) before the call), T5 states, integer timesteps.
- FluxTransformer2DModel: latents packed 2x2 into tokens (b, H/2 * W/2, 4C)
  (FluxPipeline._pack_latents), T5 states, CLIP's pooled output, `img_ids`/`txt_ids`
  (FluxPipeline._prepare_latent_image_ids), float timesteps in [0, 1] and the guidance
  scale (examples/dreambooth/train_dreambooth_lora_flux.py).
- SD3Transformer2DModel: latents (b, C, H, W), joint CLIP + T5 states, pooled CLIP output.
- WanTransformer3DModel, HunyuanVideoTransformer3DModel, MochiTransformer3DModel: latents
  (b, C, F, H, W); Hunyuan and Mochi take an attention mask over the text, Hunyuan a
  pooled CLIP output and the guidance scale.
- LTXVideoTransformer3DModel: latents packed to tokens (b, F * H * W, C) with patch 1
  (LTXPipeline._pack_latents) and the latent frames/height/width given separately.
- UNet2DConditionModel: latents (b, C, H, W), CLIP states; SDXL (`addition_embed_type`
  text_time) the pooled CLIP-G output and six size/crop ids (train_text_to_image_sdxl.py).
- DiTTransformer2DModel: latents (b, C, H, W) and class labels (class-conditional).
"""
from __future__ import annotations

import torch

FLOW_MATCHING = {"FluxTransformer2DModel", "SD3Transformer2DModel", "WanTransformer3DModel",
                 "LTXVideoTransformer3DModel", "HunyuanVideoTransformer3DModel", "MochiTransformer3DModel"}


def text_dim(pipe: dict) -> int:
    """Width of the text states the denoiser reads (its config's name for it)."""
    den = pipe["denoiser"]
    for key in ("joint_attention_dim", "text_embed_dim", "text_dim", "caption_channels", "cross_attention_dim"):
        value = den.get(key)
        if isinstance(value, int):
            return value
    return pipe["text_encoders"][0]["d_model"]


def text_tokens(pipe: dict) -> int:
    """Text states per sample: SD3 concatenates CLIP's 77 and T5's tokens on the sequence
    axis (those marked joins_sequence); the others read one encoder's states."""
    encs = pipe["text_encoders"]
    joined = [e["max_tokens"] for e in encs if e.get("joins_sequence")]
    if pipe["denoiser"]["class"] == "SD3Transformer2DModel":
        return sum(joined)
    if pipe["denoiser"]["class"] == "UNet2DConditionModel":
        return max(e["max_tokens"] for e in encs)
    return joined[-1] if joined else encs[-1]["max_tokens"]


def denoiser_inputs(pipe: dict, b: int, latent: tuple[int, int, int, int], dtype: torch.dtype,
                    g: torch.Generator) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """(latents in the class's layout, the other keyword inputs, timesteps)."""
    den, cls = pipe["denoiser"], pipe["denoiser"]["class"]
    f, c, h, w = latent
    if cls == "DiTTransformer2DModel":
        latents = torch.randn(b, c, h, w, generator=g).to(dtype)
        labels = torch.randint(0, den.get("num_embeds_ada_norm", 1000), (b,), generator=g)
        return latents, {"class_labels": labels}, torch.randint(0, 1000, (b,), generator=g)
    m = text_tokens(pipe)
    embeds = torch.randn(b, m, text_dim(pipe), generator=g).to(dtype)
    kw = {"encoder_hidden_states": embeds}
    t = torch.randint(0, 1000, (b,), generator=g)
    if cls == "CogVideoXTransformer3DModel":
        latents = torch.randn(b, f, c, h, w, generator=g).to(dtype)
    elif cls == "FluxTransformer2DModel":
        latents = torch.randn(b, (h // 2) * (w // 2), 4 * c, generator=g).to(dtype)
        ids = torch.zeros(h // 2, w // 2, 3)
        ids[..., 1] += torch.arange(h // 2)[:, None]
        ids[..., 2] += torch.arange(w // 2)[None, :]
        kw.update(pooled_projections=torch.randn(b, den["pooled_projection_dim"], generator=g).to(dtype),
                  img_ids=ids.reshape(-1, 3).to(dtype), txt_ids=torch.zeros(m, 3).to(dtype))
        if den.get("guidance_embeds"):
            kw["guidance"] = torch.full((b,), 3.5).to(dtype)
        t = torch.rand(b, generator=g).to(dtype)
    elif cls == "SD3Transformer2DModel":
        latents = torch.randn(b, c, h, w, generator=g).to(dtype)
        kw["pooled_projections"] = torch.randn(b, den["pooled_projection_dim"], generator=g).to(dtype)
    elif cls == "LTXVideoTransformer3DModel":
        latents = torch.randn(b, f * h * w, c, generator=g).to(dtype)
        kw.update(encoder_attention_mask=torch.ones(b, m), num_frames=f, height=h, width=w)
    elif cls in ("HunyuanVideoTransformer3DModel", "MochiTransformer3DModel"):
        latents = torch.randn(b, c, f, h, w, generator=g).to(dtype)
        kw["encoder_attention_mask"] = torch.ones(b, m)
        if cls == "HunyuanVideoTransformer3DModel":
            kw.update(pooled_projections=torch.randn(b, den["pooled_projection_dim"], generator=g).to(dtype),
                      guidance=torch.full((b,), 6.0 * 1000).to(dtype))
    elif cls == "UNet2DConditionModel":
        latents = torch.randn(b, c, h, w, generator=g).to(dtype)
        if den.get("addition_embed_type") == "text_time":
            pooled = den["projection_class_embeddings_input_dim"] - 6 * den["addition_time_embed_dim"]
            kw["added_cond_kwargs"] = {"text_embeds": torch.randn(b, pooled, generator=g).to(dtype),
                                       "time_ids": torch.tensor([[h * 8, w * 8, 0, 0, h * 8, w * 8]] * b).to(dtype)}
    else:  # Wan: (b, C, F, H, W)
        latents = torch.randn(b, c, f, h, w, generator=g).to(dtype)
    return latents, kw, t


def call_denoiser(model, pipe: dict, hidden: torch.Tensor, kw: dict, t: torch.Tensor) -> torch.Tensor:
    key = "sample" if pipe["denoiser"]["class"] == "UNet2DConditionModel" else "hidden_states"
    pred = model(**{key: hidden}, timestep=t, return_dict=False, **kw)[0]
    if pred.shape != hidden.shape:  # DiT with learned sigma: the loss reads the mean channels
        pred = pred[:, :hidden.shape[1]]
    return pred


__all__ = ["FLOW_MATCHING", "call_denoiser", "denoiser_inputs", "text_dim", "text_tokens"]

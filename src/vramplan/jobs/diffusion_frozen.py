"""The frozen parts of a diffusion step: text encoders, the VAE and a frozen copy of the
denoiser, their weights (here, or only during their forward when offloaded) and their
no_grad forwards. Under `stack: diffusers-scripts` the scripts' own order applies
(jobs/diffusion_scripts.py). Legend: b batch, c compute dtype, w weight dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.i18n import Msg
from vramplan.jobs.diffusion_scripts import cogvideox_encode, encodes_ahead, first_channels, scripts_stack, sdxl_script, vae_dtype
from vramplan.spec.tasks import PRECOMPUTED
from vramplan.units import nbytes


def text_encoder_forward(enc: dict, b: int, c: str) -> Breakdown:
    """A frozen text encoder under no_grad: one layer's working set at a time (hidden,
    normed, q, k, v, the fp32 attention scores of T5's eager attention, the FF's d_ff
    activation twice: wi output and its activation) and its output embeddings."""
    t, d, f = enc["max_tokens"], enc["d_model"], enc["d_ff"]
    heads = enc["num_heads"]
    return (Breakdown().add("forward/hidden", 5 * nbytes(b * t * d, c))
            .add("forward/scores", nbytes(b * heads * t * t, "fp32")).add("forward/ff", 2 * nbytes(b * t * f, c)))


def frozen_block_forward(pipe: dict, b: int, tokens: int, c: str) -> Breakdown:
    """A frozen copy of a transformer denoiser under no_grad (measured with
    CogVideoXTransformer3DModel, diffusers models/transformers/cogvideox_transformer_3d.py
    CogVideoXBlock.forward): the peak is a block's feed-forward, where the block input (the
    residual stream, b x (m + n) x h), the attention residual, the attention output and the
    concatenated norm2 output (`torch.cat([norm_encoder_hidden_states, norm_hidden_states])`)
    are alive beside ff.net.0.proj's output and its GELU (b x (m + n) x f each); its
    prediction (latent-sized) is the step's target."""
    den = pipe["denoiser"]
    if pipe["kind"] == "unet":
        return Breakdown().add("forward/output", nbytes(b * pipe["vae"]["latent_channels"], c))
    h = den["num_attention_heads"] * den["attention_head_dim"]
    t = b * tokens
    f = den.get("ff_mult", 4) * h
    return (Breakdown().add("forward/hidden", 4 * nbytes(t * h, c)).add("forward/ff", 2 * nbytes(t * f, c)))


def vae_encode_forward(pipe: dict, b: int, frames: int, height: int, width: int, c: str, cfg=None) -> Breakdown:
    """A frozen VAE encode under no_grad: the first level's ResnetBlock holds its input, the
    GroupNorm output, the SiLU output and the conv output at once (diffusers
    models/resnet.py ResnetBlock2D.forward), `first_channels` wide (block_out_channels[0]:
    128 for the SD/CogVideoX VAEs, 96 for Wan's). What is in flight: a causal video VAE
    that encodes in frame chunks (`encode_chunk_frames`: AutoencoderKLWan._encode runs the
    first frame, then 4 at a time, with a cache of past frames) holds one chunk; slicing
    (`enable_slicing`) one sample; tiling (`enable_tiling`) one tile a side (`tile_side`) where
    the image is larger than a tile (AutoencoderKL._encode tiles only then).
    LTX-Video's encoder folds `first_level_stride`^2 pixels into channels before its first
    level (AutoencoderKLLTXVideo patch_size 4), which then runs at 1/4 of each side."""
    vae = pipe["vae"]
    ch = first_channels(vae)
    frames = min(frames, vae.get("encode_chunk_frames", frames))
    if cfg is not None and cfg.vae_slicing:
        b = 1
    if cfg is not None and cfg.vae_tiling:
        tile = tile_side(vae)
        height, width = min(height, tile), min(width, tile)
    stride = vae.get("first_level_stride", 1)
    pixels = (height // stride) * (width // stride)
    return Breakdown().add("forward/level0", 4 * nbytes(b * ch * frames * pixels, c))



def tile_side(vae: dict) -> int:
    """Pixels a side of one tile of a tiled encode. diffusers
    models/autoencoders/autoencoder_kl.py AutoencoderKL.__init__ sets `tile_sample_min_size =
    config.sample_size`, and `_tiled_encode` runs `self.encoder` on `x[:, :, i:i + tile,
    j:j + tile]` for i, j stepping by 0.75 tile (tile_overlap_factor 0.25): tiles overlap
    but none is larger than the tile, the tiles' small latents are kept and blended after.
    The video VAEs name their tile `tile_size` (tile_sample_min_height/width); 512 where the
    entry gives neither."""
    size = vae.get("tile_size") or vae.get("sample_size") or 512
    return int(size[0] if isinstance(size, (list, tuple)) else size)


def frozen_modules(pipe, spec, step, b, c, w, notes, tokens: int) -> dict[str, int]:
    """Text encoders, VAE and the frozen denoiser copy: weights (here, or only during their
    forward when offloaded) and their no_grad forwards; returns their parameter counts by name."""
    cfg, total, off = spec.diffusion, {}, spec.diffusion.offload_frozen
    modules = []
    if cfg.text_encoders != PRECOMPUTED:
        for enc in pipe["text_encoders"]:
            modules.append((f"text_encoder_{enc['role']}", enc["num_params"], text_encoder_forward(enc, b, c), "before"))
        if scripts_stack(spec):  # the step's text states stay named (prompt_embeds) to the next step
            last = pipe["text_encoders"][-1]
            width = last["d_model"]
            if sdxl_script(pipe, spec):  # encode_prompt: the penultimate states concatenated, CLIP-G's pooled
                width = sum(e["d_model"] for e in pipe["text_encoders"])
                step.plan.static.add("batch/pooled_text_embeddings",
                                     nbytes(b * last.get("projection_dim", last["d_model"]), w))
            step.plan.static.add("batch/text_embeddings", nbytes(b * last["max_tokens"] * width, w))
    else:
        m = sum(e["max_tokens"] * e["d_model"] for e in pipe["text_encoders"])
        step.plan.static.add("batch/text_embeddings", nbytes(b * m, w))
    if cfg.vae != PRECOMPUTED and encodes_ahead(pipe, spec):
        kept, work = cogvideox_encode(pipe, spec, b)
        step.plan.static.merge(kept)
        modules.append(("vae", pipe["vae"]["num_params"], work, "before"))
        notes.append(Msg("videos encoded before training (train_cogvideox_lora.py): the latent "
                         "distributions of {count} videos kept on the device", count=b))
    elif cfg.vae != PRECOMPUTED:
        modules.append(("vae", pipe["vae"]["num_params"],
                        vae_encode_forward(pipe, b, cfg.num_frames, cfg.height, cfg.width,
                                           vae_dtype(pipe, spec) if scripts_stack(spec) else c, cfg), "before"))
        # the diffusers scripts' dataloader yields fp32 pixels (torchvision ToTensor/Normalize),
        # cast to weight_dtype only for the encode (`pixel_values.to(dtype=weight_dtype)`)
        pixels = b * 3 * cfg.num_frames * cfg.height * cfg.width
        step.plan.static.add("batch/pixels", nbytes(pixels, "fp32" if scripts_stack(spec) or cfg.controlnet else w))
    if cfg.frozen_copy:
        copy = frozen_block_forward(pipe, b, tokens, c)
        modules.append(("frozen_denoiser", pipe["denoiser"]["num_params"], copy, "after"))
    for name, count, fwd, where in modules:
        total[name] = count
        weights = Breakdown().add("weights/frozen", nbytes(count, vae_dtype(pipe, spec) if name == "vae" else w))
        if name == "frozen_denoiser" and "denoiser/buffers/pos_embedding" in step.plan.static.terms:
            weights.add("buffers/pos_embedding", step.plan.static.terms["denoiser/buffers/pos_embedding"])
        event = Breakdown().merge(fwd, prefix=f"{name}/")
        if off:
            event.merge(weights, prefix=f"{name}/")
        else:
            step.plan.static.merge(weights, prefix=f"{name}/")
        label = f"{name} forward (no_grad{', moved in from the CPU' if off else ''})"
        if where == "before":
            step.before.append(("forward", label, event))
        else:
            step.after_forward.append(("forward", label, event, True))
    if off:
        notes.append(Msg("frozen modules offloaded: each is on the GPU only during its own forward"))
    return total


__all__ = ["frozen_block_forward", "frozen_modules", "text_encoder_forward", "tile_side", "vae_encode_forward"]

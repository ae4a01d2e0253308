"""Diffusion/video pipelines and vision-language models: data files under
catalog/diffusion/ and catalog/multimodal/, loaded lazily, and the token counts their
inputs turn into.

Each file holds the published config fields of the pipeline's parts (denoiser, VAE, text
encoders; vision tower, projector, language model). `num_params` figures are the
published totals of each part; check them against a meta-device build before relying on
them for weights (they are data, not derived here).
"""
from __future__ import annotations

import functools

from vramplan.catalog.data_files import json_names, read_json


@functools.lru_cache(maxsize=None)
def _entries(folder: str) -> dict[str, dict]:
    out = {}
    for name in json_names(folder):
        data = read_json(folder, name)
        out[data["name"]] = data
        out[data["hub_id"].lower()] = data
    return out


def find_pipeline(name: str) -> dict:
    """A diffusion/video pipeline by catalog name or hub id."""
    return _find("diffusion", name)


def pipeline_or_none(name: str) -> dict | None:
    """find_pipeline's entry, or None where `name` is no pipeline (no suggestion looked for:
    the CLI asks this of every model name)."""
    return _entries("diffusion").get(name.strip().lower())


def find_vlm(name: str) -> dict:
    """A vision-language model by catalog name or hub id."""
    return _find("multimodal", name)


def _find(folder: str, name: str) -> dict:
    index = _entries(folder)
    key = name.strip().lower()
    if key not in index:
        import difflib
        hint = difflib.get_close_matches(key, list(index), n=1)
        raise KeyError(f"{name!r} is not in catalog/{folder}" + (f"; did you mean {hint[0]!r}?" if hint else ""))
    return index[key]


def latent_shape(pipe: dict, batch: int, height: int, width: int, frames: int) -> tuple[int, ...]:
    """batch x channels x frames x height x width of the VAE latents. CogVideoX's causal
    3D VAE keeps the first frame and compresses the rest by `temporal_compression`
    (diffusers AutoencoderKLCogVideoX: 49 frames -> 13 latent frames)."""
    vae = pipe["vae"]
    s, t = vae["spatial_compression"], vae["temporal_compression"]
    f = 1 if frames == 1 or t == 1 else (frames - 1) // t + 1
    return (batch, vae["latent_channels"], f, height // s, width // s)


def patch_dims(den: dict) -> tuple[int, int, int]:
    """(frames, height, width) of one token in latents: Wan's `patch_size` is a (t, h, w)
    triple; CogVideoX 1.5 and others give `patch_size_t` beside a square `patch_size`;
    Flux packs 2x2 latents into one token (diffusers FluxPipeline._pack_latents)."""
    p = den.get("patch_size", 1)
    if isinstance(p, (list, tuple)):
        return int(p[0]), int(p[1]), int(p[2])
    p = (p or 1) * den.get("latent_packing", 1)
    return int(den.get("patch_size_t") or 1), p, p


def denoiser_tokens(pipe: dict, height: int, width: int, frames: int) -> dict[str, int]:
    """Tokens per sample the denoiser attends over: latent patches (frames x (h/p) x (w/p))
    plus, where text joins the sequence (CogVideoX, SD3/Flux joint attention), text tokens;
    `context`: the text states a cross-attention denoiser (Wan) reads beside them.
    A UNet has no token sequence: its attention runs per resolution level."""
    den = pipe["denoiser"]
    _, _, f, h, w = latent_shape(pipe, 1, height, width, frames)
    if pipe["kind"] == "unet":
        return {"image": h * w, "text": 0, "context": 0}
    pt, ph, pw = patch_dims(den)
    image = -(-f // pt) * (h // ph) * (w // pw)
    text = context = 0
    if pipe["kind"] == "video-dit":  # CogVideoX: T5 states concatenated before the video tokens
        text = den["max_text_seq_length"]
    elif pipe["kind"] == "mmdit":  # joint attention over text states and image tokens
        text = sum(e["max_tokens"] for e in pipe["text_encoders"] if e.get("joins_sequence"))
    elif pipe["text_encoders"]:  # cross-attention: the last encoder's states
        context = pipe["text_encoders"][-1]["max_tokens"]
    return {"image": image, "text": text, "context": context}


def check_shape(pipe: dict, height: int, width: int, frames: int) -> None:
    """Sizes the pipeline can take, else a SpecError naming the field: height and width
    multiples of the VAE's spatial factor times the token's side (the patch embedding's
    stride; diffusers pipelines' check_inputs), frames of a causal video VAE t * k + 1
    (its first frame is kept, every t later ones become one latent frame: CogVideoX, Wan,
    HunyuanVideo at t = 4)."""
    from vramplan.spec import SpecError
    vae, den = pipe["vae"], pipe["denoiser"]
    s = vae["spatial_compression"]
    patch = 1 if pipe["kind"] == "unet" else patch_dims(den)[1]
    step = s * patch
    for name, value in (("height", height), ("width", width)):
        if value % step:
            near = max(step, round(value / step) * step)
            raise SpecError(f"diffusion.{name}", f"{value} is not a multiple of {step} (VAE factor {s} x patch "
                            f"{patch}); use e.g. {near}")
        # SD3's PatchEmbed.cropped_pos_embed raises ValueError past pos_embed_max_size patches
        # a side; Wan's WanRotaryPosEmbed slices rope_max_seq_len positions per axis (a view fails)
        grid = den.get("pos_embed_max_size") or den.get("rope_max_seq_len")
        if grid and value // step > grid:
            raise SpecError(f"diffusion.{name}", f"{value} is {value // step} patches a side, past the {grid} "
                            f"that {pipe.get('name', 'the pipeline')}'s position embedding holds; use at most "
                            f"{grid * step}")
    t = vae.get("temporal_compression", 1)
    if t == 1 and frames > 1 and pipe.get("frames") is None:
        # an image VAE (AutoencoderKL: 4-D latents, no time axis); its pipelines take no num_frames
        raise SpecError("diffusion.num_frames", f"{pipe.get('name', 'the pipeline')} makes images (its VAE has no "
                        f"time axis), not {frames}-frame videos; drop num_frames")
    if t > 1 and frames > 1 and (frames - 1) % t:
        near = round((frames - 1) / t) * t + 1
        raise SpecError("diffusion.num_frames", f"{frames} frames do not fit {pipe.get('name', 'the pipeline')}'s "
                        f"VAE: use {t}k+1 frames, e.g. {near}")
    rope, pt = den.get("rope_max_seq_len"), patch_dims(den)[0] if pipe["kind"] != "unet" else 1
    if rope and t > 1 and ((frames - 1) // t + 1) // pt > rope:
        # Wan's WanRotaryPosEmbed holds rope_max_seq_len positions in time too (its view fails past them)
        raise SpecError("diffusion.num_frames", f"{frames} frames are {((frames - 1) // t + 1) // pt} latent "
                        f"positions in time, past the {rope} that {pipe.get('name', 'the pipeline')}'s rotary "
                        f"table holds; use at most {(rope * pt - 1) * t + 1} frames")


def list_pipelines() -> list[dict]:
    """Every diffusion/video pipeline of the catalog, once each, by name."""
    return _unique("diffusion")


def list_vlms() -> list[dict]:
    """Every vision-language model of the catalog, once each, by name."""
    return _unique("multimodal")


def _unique(folder: str) -> list[dict]:
    return sorted({e["name"]: e for e in _entries(folder).values()}.values(), key=lambda e: e["name"])


def image_tokens(vlm: dict, image_size: int) -> int:
    """Visual tokens one square image adds to the language model's sequence: (side / patch)^2
    patches, merged spatial_merge^2 to one (Qwen2-VL PatchMerger); LLaVA's 'default'
    feature strategy drops the CLS token (transformers LlavaModel.get_image_features).
    A published-config entry reads its vision_config: Qwen2-VL's side is taken as already a
    multiple of patch * merge (families/qwen2_vl/vision.py resizes any other); InternVL's is
    one tile's tokens (families/internvl/vision.py counts the tiles of an image)."""
    if "vision" in vlm:
        v = vlm["vision"]
        side = (v.get("image_size") or image_size) // v["patch_size"]
        return side * side // (v.get("spatial_merge", 1) ** 2)
    cfg = vlm["config"]
    v = cfg["vision_config"]
    if cfg["model_type"] == "internvl":  # one tile (no tiling): (448 / 14 * 0.5)^2 = 256
        tile, patch = (x[0] if isinstance(x, list) else x for x in (v["image_size"], v["patch_size"]))
        return int((tile // patch * cfg.get("downsample_ratio", 0.5)) ** 2)
    side = image_size // v["patch_size"]
    return side * side // (v["spatial_merge_size"] ** 2)


__all__ = ["check_shape", "denoiser_tokens", "patch_dims", "find_pipeline", "find_vlm", "image_tokens", "latent_shape", "list_pipelines",
           "list_vlms"]

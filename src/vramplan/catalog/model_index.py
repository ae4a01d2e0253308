"""A diffusers pipeline folder (`model_index.json` beside `transformer/` or `unet/`, `vae/`,
`text_encoder*/`) as the pipeline description the diffusion catalog's data files hold
(catalog/diffusion/*.json), so `vramplan estimate PATH --task diffusion` needs no catalog
entry.

Only JSON is read: model_index.json names the pipeline class (`_class_name`) and each
component's `[library, class]`; each component's config.json gives its fields. Nothing from
the folder is imported or executed; a class outside the table below is refused by name.
What the configs do not hold is the pipeline code's, cited per row: the latent packing,
the text lengths (each pipeline's `max_sequence_length` default, CLIP's 77-token
tokenizer), the default sizes, the VAE's compression and its encode chunking. Parameter
counts come from catalog/model_index_counts.py.
"""
from __future__ import annotations

import functools
import json
import os

from vramplan.spec import SpecError

# Per pipeline class: kind (as the catalog's), denoiser component, its classes, latent packing,
# text encoders in the catalog's order as (component, role, joins the denoiser's sequence,
# tokens), and the __call__ defaults (height, width, num_frames). Sources: diffusers 0.42
# pipelines/<family>/pipeline_*.py.
PIPELINES: dict[str, dict] = {
    # pipeline_flux.py: _pack_latents folds 2 x 2 latents into one token; T5 max_sequence_length
    # 512; default_sample_size 128 x vae_scale_factor 8
    "FluxPipeline": {"kind": "mmdit", "denoiser": "transformer", "classes": ("FluxTransformer2DModel",),
                     "latent_packing": 2, "defaults": (1024, 1024, 1),
                     "text": (("text_encoder", "clip_l", False, 77), ("text_encoder_2", "t5", True, 512))},
    # pipeline_stable_diffusion_3.py: CLIP-L and CLIP-G states joined on the feature axis and with T5
    # on the sequence axis (_get_clip_prompt_embeds, encode_prompt); max_sequence_length 256;
    # default_sample_size = transformer.config.sample_size (128) x 8
    "StableDiffusion3Pipeline": {"kind": "mmdit", "denoiser": "transformer", "classes": ("SD3Transformer2DModel",),
                                 "defaults": ("sample_size", 8, 1),
                                 "text": (("text_encoder", "clip_l", True, 77), ("text_encoder_2", "clip_g", False, 77),
                                          ("text_encoder_3", "t5", True, 256))},
    # pipeline_stable_diffusion_xl.py / pipeline_stable_diffusion.py: CLIP tokenizers of 77;
    # default size unet.config.sample_size x vae_scale_factor
    "StableDiffusionXLPipeline": {"kind": "unet", "denoiser": "unet", "classes": ("UNet2DConditionModel",),
                                  "defaults": ("sample_size", 8, 1),
                                  "text": (("text_encoder", "clip_l", False, 77), ("text_encoder_2", "clip_g", False, 77))},
    "StableDiffusionPipeline": {"kind": "unet", "denoiser": "unet", "classes": ("UNet2DConditionModel",),
                                "defaults": ("sample_size", 8, 1), "text": (("text_encoder", "clip_l", False, 77),)},
    # pipeline_cogvideox.py: max_sequence_length 226 (the transformer's max_text_seq_length);
    # height = sample_height x 8, width = sample_width x 8, 49 frames
    "CogVideoXPipeline": {"kind": "video-dit", "denoiser": "transformer", "classes": ("CogVideoXTransformer3DModel",),
                          "defaults": ("sample_hw", 8, 49), "text": (("text_encoder", "t5", False, 226),)},
    # pipeline_wan.py: __call__ max_sequence_length 512, 480 x 832 x 81
    "WanPipeline": {"kind": "cross-dit", "denoiser": "transformer", "classes": ("WanTransformer3DModel",),
                    "defaults": (480, 832, 81), "text": (("text_encoder", "umt5", False, 512),)},
    # pipeline_ltx.py: max_sequence_length 128, 512 x 704 x 161
    "LTXPipeline": {"kind": "cross-dit", "denoiser": "transformer", "classes": ("LTXVideoTransformer3DModel",),
                    "defaults": (512, 704, 161), "text": (("text_encoder", "t5", False, 128),)},
    # pipeline_hunyuan_video.py: the Llama states (256 tokens) join the sequence, CLIP (77) gives
    # the pooled projection; 720 x 1280 x 129
    "HunyuanVideoPipeline": {"kind": "mmdit", "denoiser": "transformer", "classes": ("HunyuanVideoTransformer3DModel",),
                             "defaults": (720, 1280, 129),
                             "text": (("text_encoder_2", "clip_l", False, 77), ("text_encoder", "llama", True, 256))},
    # pipeline_mochi.py: max_sequence_length 256, 480 x 848 x 19
    "MochiPipeline": {"kind": "mmdit", "denoiser": "transformer", "classes": ("MochiTransformer3DModel",),
                      "defaults": (480, 848, 19), "text": (("text_encoder", "t5", True, 256),)},
    # pipeline_dit.py: class-conditional, no text; latent side transformer.config.sample_size
    "DiTPipeline": {"kind": "dit", "denoiser": "transformer", "classes": ("DiTTransformer2DModel",),
                    "defaults": ("sample_size", 8, 1), "text": ()},
}

# The transformers class each text-encoder role is (the pipelines' __init__ annotations).
ROLE_CLASSES = {"clip_l": ("CLIPTextModel", "CLIPTextModelWithProjection"),
                "clip_g": ("CLIPTextModel", "CLIPTextModelWithProjection"),
                "t5": ("T5EncoderModel",), "umt5": ("UMT5EncoderModel",), "llama": ("LlamaModel",)}
TEXT_ENCODERS = ("CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel", "UMT5EncoderModel", "LlamaModel")
VAES = ("AutoencoderKL", "AutoencoderKLCogVideoX", "AutoencoderKLWan", "AutoencoderKLLTXVideo",
        "AutoencoderKLHunyuanVideo", "AutoencoderKLMochi")


def find_model_index(model: str) -> str | None:
    """The folder holding model_index.json for a local path or a hub id whose files are in
    the local Hugging Face cache (a file lookup, never a request); None where there is none."""
    path = os.path.expanduser(model)
    if os.path.isfile(path) and os.path.basename(path) == "model_index.json":
        return os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return path if os.path.isfile(os.path.join(path, "model_index.json")) else None
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
        cached = try_to_load_from_cache(model, "model_index.json")
    except Exception:  # no hub client, or an id it rejects: not cached
        return None
    return os.path.dirname(cached) if isinstance(cached, str) else None


def pipeline_at(model: str) -> dict | None:
    """The pipeline description of a local diffusers folder or a cached hub id, None where
    `model` has no model_index.json on this machine. Read once per folder state: a search
    (fit, compare) resolves the same pipeline again and again."""
    folder = find_model_index(model)
    if folder is None:
        return None
    name = model if not os.path.exists(os.path.expanduser(model)) else None
    return _pipeline_cached(os.path.abspath(folder), name, _state(folder))


def _state(folder: str) -> tuple:
    """What the description is read from: model_index.json and each */config.json (their
    modification times) and the weight files present (their names)."""
    out = [os.stat(os.path.join(folder, "model_index.json")).st_mtime_ns]
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_dir():
            names = sorted(os.listdir(entry.path))
            config = os.path.join(entry.path, "config.json")
            out.append((entry.name, os.stat(config).st_mtime_ns if "config.json" in names else None,
                        tuple(n for n in names if n.endswith(".safetensors"))))
    return tuple(out)


@functools.lru_cache(maxsize=16)
def _pipeline_cached(folder: str, name: str | None, _state: tuple) -> dict:
    return pipeline_from_folder(folder, name)


def not_cached(model: str) -> SpecError:
    """The one line for a pipeline that is neither a catalog entry nor on this machine."""
    return SpecError("model", f"{model!r} is not in the catalog, and no model_index.json for it is on this machine "
                     "(a local folder or the Hugging Face cache); vramplan reads pipelines offline: download its "
                     f"configs (huggingface-cli download {model} --include '*.json') or pass the pipeline's local "
                     "folder as model")


def _read(folder: str, *parts: str) -> dict:
    from vramplan.files import FileReadError, read_mapping
    path = os.path.join(folder, *parts)
    if not os.path.isfile(path):
        raise SpecError("model", f"{os.path.join(*parts)} is missing in {folder}; a diffusers pipeline folder "
                        "needs each component's config.json")
    try:
        return read_mapping(path, json_only=True)
    except FileReadError as exc:
        raise SpecError("model", str(exc)) from None


def _component(index: dict, name: str, allowed: tuple[str, ...]) -> str:
    """The class model_index.json names for component `name`, if it is one of `allowed`."""
    entry = index.get(name)
    cls = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
    if cls is None:
        raise SpecError("model", f"model_index.json: the pipeline's {name} is null or missing; vramplan needs it "
                        f"(one of {', '.join(allowed)}) with its config.json")
    if cls not in allowed:
        raise SpecError("model", f"model_index.json: component {name} is {cls!r}, not one vramplan models; "
                        f"known: {', '.join(allowed)}")
    return cls


def pipeline_from_folder(folder: str, name: str | None = None) -> dict:
    """The catalog-shaped pipeline description of the diffusers folder `folder`."""
    index = _read(folder, "model_index.json")
    pipe_cls = index.get("_class_name")
    row = PIPELINES.get(pipe_cls)
    if row is None:
        raise SpecError("model", f"model_index.json: pipeline {pipe_cls!r} is not one vramplan models; known: "
                        + ", ".join(PIPELINES))
    from vramplan.catalog.model_index_counts import component_params
    den_cls = _component(index, row["denoiser"], row["classes"])
    den_cfg = _read(folder, row["denoiser"], "config.json")
    vae_cls = _component(index, "vae", VAES)
    vae_cfg = _read(folder, "vae", "config.json")
    _check_modeled(row["denoiser"], den_cfg)
    den = {**_fields(den_cfg), "class": den_cls,
           "num_params": component_params(folder, row["denoiser"], den_cls, den_cfg)}
    if "latent_packing" in row:
        den["latent_packing"] = row["latent_packing"]
    vae = {**vae_fields(vae_cls, vae_cfg), "num_params": component_params(folder, "vae", vae_cls, vae_cfg)}
    pipe = {"name": name or os.path.basename(os.path.normpath(folder)), "hub_id": name or folder,
            "kind": row["kind"], "source": os.path.join(folder, "model_index.json"), "denoiser": den, "vae": vae,
            "text_encoders": _text_encoders(folder, index, row["text"]), "defaults": _defaults(row["defaults"], den, vae)}
    if vae["temporal_compression"] > 1:
        pipe["frames"] = f"{vae['temporal_compression']}k+1"
    if row["kind"] == "unet":
        pipe.update(_controlnet(folder, den_cfg))
    return pipe


def _text_encoders(folder: str, index: dict, rows: tuple) -> list[dict]:
    """The catalog's text-encoder entries, in the catalog's order, from each component's
    transformers config.json; the class of each is the one the pipeline's __init__ takes."""
    from vramplan.catalog.model_index_counts import component_params
    out = []
    for component, role, joins, tokens in rows:
        cls = _component(index, component, ROLE_CLASSES[role])
        cfg = _read(folder, component, "config.json")
        enc = {"role": role, "class": cls, **text_encoder_fields(cls, cfg), "max_tokens": tokens,
               "num_params": component_params(folder, component, cls, cfg)}
        out.append({**enc, "joins_sequence": True} if joins else enc)
    return out


def _controlnet(folder: str, unet_config: dict) -> dict:
    """The ControlNet train_controlnet.py makes from this UNet (`ControlNetModel.from_unet`:
    the UNet's down and mid blocks with their config, conditioning_embedding_out_channels
    at ControlNetModel's default), counted on the meta device; nothing where diffusers is
    not installed (a ControlNet job then asks for its count)."""
    from vramplan.catalog.model_index_counts import meta_params
    fields = {**_fields(unet_config), "conditioning_embedding_out_channels": [16, 32, 96, 256]}
    try:
        n = meta_params("ControlNetModel", json.dumps(fields, sort_keys=True), "unet", folder)
    except SpecError:
        return {}
    return {"controlnet": {"conditioning_embedding_out_channels": fields["conditioning_embedding_out_channels"],
                           "num_params": n}}


# Denoiser config fields that switch on parts the estimator's blocks do not model yet, with
# what they add (diffusers 0.42 models/transformers/*.py).
_UNMODELED = {
    "image_dim": "Wan image-to-video's image cross-attention (WanTransformer3DModel)",
    "added_kv_proj_dim": "Wan image-to-video's image key/value projections (WanTransformer3DModel)",
}


def _check_modeled(component: str, cfg: dict) -> None:
    for key, what in _UNMODELED.items():
        if cfg.get(key):
            raise SpecError("model", f"{component}/config.json: {key}={cfg[key]!r} adds {what}, which vramplan does "
                            "not model yet")


def _fields(cfg: dict) -> dict:
    """A diffusers config without its bookkeeping keys (`_class_name`, `_diffusers_version`)
    and without its null fields: null is the class's "derive it" (FluxTransformer2DModel
    `out_channels or in_channels`), which a catalog entry says by leaving the field out."""
    return {k: v for k, v in cfg.items() if not k.startswith("_") and v is not None}


def _defaults(rule: tuple, den: dict, vae: dict) -> dict:
    s = vae["spatial_compression"]
    height, width, frames = rule
    if height == "sample_size":  # a square latent side of sample_size x the VAE factor
        side = den.get("sample_size")
        side = side[0] if isinstance(side, list) else side
        if not isinstance(side, int):  # no default size in the config: the spec's height and width
            return {"num_frames": frames}
        height = width = side * s
    elif height == "sample_hw":  # CogVideoX: sample_height / sample_width latents
        height, width = den.get("sample_height", 60) * s, den.get("sample_width", 90) * s
    return {"height": int(height), "width": int(width), "num_frames": frames}


def vae_fields(cls: str, cfg: dict) -> dict:
    """The catalog's VAE fields from a diffusers VAE config: latent channels, the spatial and
    temporal compression the pipeline reads, the encoder's first-level width and the
    encode's chunking (models/autoencoders/autoencoder_kl*.py)."""
    out = {"class": cls}
    boc = cfg.get("block_out_channels") or [128, 256, 512, 512]
    if cls in ("AutoencoderKL", "AutoencoderKLCogVideoX"):
        # pipelines: vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1);
        # CogVideoX: vae_scale_factor_temporal = vae.config.temporal_compression_ratio
        t = cfg.get("temporal_compression_ratio", 4) if cls == "AutoencoderKLCogVideoX" else 1
        out.update(latent_channels=cfg.get("latent_channels", 4 if cls == "AutoencoderKL" else 16),
                   spatial_compression=2 ** (len(boc) - 1), temporal_compression=int(t), first_channels=boc[0])
        if cls == "AutoencoderKL" and cfg.get("sample_size"):
            # AutoencoderKL.__init__: tile_sample_min_size = config.sample_size (its first entry
            # where a list), the tile of a tiled encode (jobs/diffusion_frozen.tile_side)
            side = cfg["sample_size"]
            out["sample_size"] = int(side[0] if isinstance(side, (list, tuple)) else side)
    elif cls == "AutoencoderKLWan":
        # pipeline_wan.py: vae.config.scale_factor_spatial / scale_factor_temporal; the encoder's
        # first level is base_dim wide; AutoencoderKLWan._encode: the first frame, then 4 at a
        # time; tiled encode tiles of 256 px (tile_sample_min_height)
        out.update(latent_channels=cfg.get("z_dim", 16), spatial_compression=cfg.get("scale_factor_spatial") or 8,
                   temporal_compression=cfg.get("scale_factor_temporal") or 4, first_channels=cfg.get("base_dim", 96),
                   encode_chunk_frames=4, tile_size=256)
    elif cls == "AutoencoderKLLTXVideo":
        # AutoencoderKLLTXVideo.__init__: patch_size * 2 ** sum(spatio_temporal_scaling) spatially,
        # patch_size_t * 2 ** sum(...) in time, unless the config sets the ratios; the encoder
        # folds patch_size^2 pixels into channels before its first level; tiles of 512 px
        p, scaling = cfg.get("patch_size", 4), cfg.get("spatio_temporal_scaling") or [True, True, True, False]
        out.update(latent_channels=cfg.get("latent_channels", 128),
                   spatial_compression=cfg.get("spatial_compression_ratio") or p * 2 ** sum(map(bool, scaling)),
                   temporal_compression=(cfg.get("temporal_compression_ratio")
                                         or cfg.get("patch_size_t", 1) * 2 ** sum(map(bool, scaling))),
                   first_channels=boc[0], first_level_stride=p, tile_size=512)
    elif cls == "AutoencoderKLHunyuanVideo":
        # config spatial/temporal_compression_ratio (8, 4); AutoencoderKLHunyuanVideo._encode:
        # framewise encoding on by default, 17 frames at a time; tiles of 256 px
        out.update(latent_channels=cfg.get("latent_channels", 16),
                   spatial_compression=cfg.get("spatial_compression_ratio", 8),
                   temporal_compression=cfg.get("temporal_compression_ratio", 4), first_channels=boc[0],
                   encode_chunk_frames=17, tile_size=256)
    else:  # AutoencoderKLMochi; pipeline_mochi.py fixes 8 x 8 spatial, 6 temporal; tiles of 256 px
        enc = cfg.get("encoder_block_out_channels") or [64, 128, 256, 384]
        out.update(latent_channels=cfg.get("latent_channels", 12), spatial_compression=8, temporal_compression=6,
                   first_channels=enc[0], tile_size=256)
    return out


def text_encoder_fields(cls: str, cfg: dict) -> dict:
    """The catalog's text-encoder fields from a transformers config.json (CLIPTextConfig,
    T5Config / UMT5Config, LlamaConfig key names)."""
    model = cfg.get("_name_or_path") or cls
    if cls.startswith("CLIP"):
        return {"model": model, "d_model": cfg.get("hidden_size", 512), "num_layers": cfg.get("num_hidden_layers", 12),
                "num_heads": cfg.get("num_attention_heads", 8), "d_ff": cfg.get("intermediate_size", 2048)}
    if cls == "LlamaModel":
        heads = cfg.get("num_attention_heads", 32)
        return {"model": model, "d_model": cfg.get("hidden_size", 4096), "num_layers": cfg.get("num_hidden_layers", 32),
                "num_heads": heads, "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
                "d_ff": cfg.get("intermediate_size", 11008), "vocab_size": cfg.get("vocab_size", 32000)}
    t5 = _T5_DEFAULTS[cls]
    return {"model": model, **{k: cfg.get(k, v) for k, v in t5.items()}}


# transformers T5Config / UMT5Config __init__ defaults: what save_pretrained's diff-only
# config.json leaves out
_T5_DEFAULTS = {
    "T5EncoderModel": {"d_model": 512, "num_layers": 6, "num_heads": 8, "d_kv": 64, "d_ff": 2048, "vocab_size": 32128,
                       "feed_forward_proj": "relu"},
    "UMT5EncoderModel": {"d_model": 512, "num_layers": 8, "num_heads": 6, "d_kv": 64, "d_ff": 1024,
                         "vocab_size": 250112, "feed_forward_proj": "gated-gelu"},
}

__all__ = ["PIPELINES", "ROLE_CLASSES", "TEXT_ENCODERS", "VAES", "find_model_index", "not_cached", "pipeline_at", "pipeline_from_folder",
           "text_encoder_fields", "vae_fields"]

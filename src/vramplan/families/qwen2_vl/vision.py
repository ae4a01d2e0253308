"""Qwen2-VL / Qwen2.5-VL vision tower: description, exact parameters, and how many patches
and language-model tokens an image or a video becomes.

Sources (transformers 5.24):
- models/qwen2_vl/modeling_qwen2_vl.py: PatchEmbed (Conv3d, kernel = stride =
  (temporal_patch_size, patch, patch), no bias), Qwen2VLVisionBlock (LayerNorm norm1/norm2
  with bias, VisionAttention fused `qkv` + `proj`, VisionMlp fc1/fc2 with QuickGELU,
  width embed_dim * mlp_ratio), PatchMerger (LayerNorm ln_q, Linear(4e, 4e), GELU,
  Linear(4e, out)).
- models/qwen2_5_vl/modeling_qwen2_5_vl.py: RMSNorm instead of LayerNorm (weight only),
  a gated MLP with bias (gate_proj, up_proj, down_proj, SiLU), window attention except in
  `fullatt_block_indexes`, the merger's ln_q an RMSNorm.
- models/qwen2_vl/image_processing_qwen2_vl.py `smart_resize`, and the video processor's
  `get_num_of_video_patches`: both sides rounded to a multiple of patch * merge, the area
  kept in [min_pixels, max_pixels]; frames padded to a multiple of temporal_patch_size.
Legend: e vision width, f MLP width, a heads, p patch, tp temporal patch, m merge side,
H language-model width.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Qwen2VLImageProcessor.size / Qwen2VLVideoProcessor.size (image_processing_qwen2_vl.py,
# video_processing_qwen2_vl.py); Qwen2.5-VL uses the same processors.
IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS = 56 * 56, 28 * 28 * 1280
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 128 * 28 * 28, 28 * 28 * 768
MAX_ASPECT = 200
"""smart_resize refuses an image whose long side is over 200 times its short side."""

# Qwen2VLVisionConfig / Qwen2_5_VLVisionConfig defaults (configuration_qwen2_vl.py,
# configuration_qwen2_5_vl.py).
_V2 = {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "hidden_act": "quick_gelu", "mlp_ratio": 4,
       "num_heads": 16, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
_V25 = {"depth": 32, "hidden_size": 3584, "hidden_act": "silu", "intermediate_size": 3420, "num_heads": 16,
        "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "window_size": 112, "out_hidden_size": 3584, "fullatt_block_indexes": (7, 15, 23, 31)}

# Qwen2VLTextConfig / Qwen2_5_VLTextConfig defaults (the same in both).
TEXT_DEFAULTS = {"vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                 "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_act": "silu",
                 "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "attention_dropout": 0.0,
                 "use_sliding_window": False, "rope_theta": 1000000.0}


@dataclass(frozen=True, slots=True)
class QwenVisionDesc:
    """The tower (`visual.patch_embed`, `visual.blocks`) and its merger (`visual.merger`)."""

    version: str
    """qwen2_vl | qwen2_5_vl"""
    depth: int
    hidden_size: int
    """e: the tower's width (embed_dim in Qwen2-VL, hidden_size in Qwen2.5-VL)."""
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    """H: the merger's output, the language model's width."""
    hidden_act: str
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    window_size: int = 0
    """Qwen2.5-VL: window side in pixels (0: every block attends over the whole image)."""
    fullatt_block_indexes: tuple[int, ...] = ()

    @property
    def model_type(self) -> str:
        return self.version

    @property
    def rms(self) -> bool:
        """Qwen2.5-VL's RMSNorms (weight only) and gated MLP; Qwen2-VL's LayerNorms and fc1/fc2."""
        return self.version == "qwen2_5_vl"

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def patch_dim(self) -> int:
        """One flattened patch of pixel_values: C * tp * p * p."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def params(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """(name under `visual.`, shape, block) of the tower's parameters, merger excluded."""
        e, f, p, tp = self.hidden_size, self.intermediate_size, self.patch_size, self.temporal_patch_size
        out: list[tuple[str, tuple[int, ...], int | None]] = [
            ("patch_embed.proj.weight", (e, self.in_channels, tp, p, p), None)]
        mlp = (("gate_proj", f, e), ("up_proj", f, e), ("down_proj", e, f)) if self.rms else \
            (("fc1", f, e), ("fc2", e, f))
        for i in range(self.depth):
            pre = f"blocks.{i}"
            for n in ("norm1", "norm2"):
                out.append((f"{pre}.{n}.weight", (e,), i))
                if not self.rms:
                    out.append((f"{pre}.{n}.bias", (e,), i))
            out += [(f"{pre}.attn.qkv.weight", (3 * e, e), i), (f"{pre}.attn.qkv.bias", (3 * e,), i),
                    (f"{pre}.attn.proj.weight", (e, e), i), (f"{pre}.attn.proj.bias", (e,), i)]
            for n, o, k in mlp:
                out += [(f"{pre}.mlp.{n}.weight", (o, k), i), (f"{pre}.mlp.{n}.bias", (o,), i)]
        return out

    def merger_params(self) -> list[tuple[str, tuple[int, ...]]]:
        e, H = self.hidden_size, self.out_hidden_size
        wide = e * self.merge_unit
        out = [("merger.ln_q.weight", (e,))] + ([] if self.rms else [("merger.ln_q.bias", (e,))])
        return out + [("merger.mlp.0.weight", (wide, wide)), ("merger.mlp.0.bias", (wide,)),
                      ("merger.mlp.2.weight", (H, wide)), ("merger.mlp.2.bias", (H,))]


def vision_from_config(cfg: dict) -> QwenVisionDesc:
    """QwenVisionDesc of a qwen2_vl / qwen2_5_vl config's `vision_config` (class defaults
    filled in, as transformers' config classes do)."""
    version = cfg["model_type"]
    if version == "qwen2_vl":
        v = {**_V2, **cfg.get("vision_config", {})}
        e = v["embed_dim"]
        return QwenVisionDesc(version=version, depth=v["depth"], hidden_size=e, num_heads=v["num_heads"],
                              intermediate_size=int(e * v["mlp_ratio"]), out_hidden_size=v["hidden_size"],
                              hidden_act=v["hidden_act"], **_common(v))
    v = {**_V25, **cfg.get("vision_config", {})}
    return QwenVisionDesc(version=version, depth=v["depth"], hidden_size=v["hidden_size"], num_heads=v["num_heads"],
                          intermediate_size=v["intermediate_size"], out_hidden_size=v["out_hidden_size"],
                          hidden_act=v["hidden_act"], window_size=v["window_size"],
                          fullatt_block_indexes=tuple(v["fullatt_block_indexes"]), **_common(v))


def _common(v: dict) -> dict:
    return {"patch_size": v["patch_size"], "temporal_patch_size": v["temporal_patch_size"],
            "spatial_merge_size": v["spatial_merge_size"], "in_channels": v["in_channels"]}


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The processor's resize target (image_processing_qwen2_vl.py smart_resize): each side
    rounded to a multiple of `factor` (patch * merge); scaled down to at most max_pixels
    or up to at least min_pixels, keeping the aspect ratio. Raises ValueError past the
    200:1 aspect limit, as the processor does."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT}, "
                         f"got {max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def grid_thw(vis: QwenVisionDesc, height: int, width: int, frames: int, min_pixels: int,
             max_pixels: int) -> tuple[int, int, int]:
    """(t, h, w) patches of one image (frames = 1: the processor repeats it to tp frames,
    one temporal patch) or one video (frames padded to a multiple of tp by repeating the
    last, Qwen2VLVideoProcessor.get_num_of_video_patches)."""
    h, w = smart_resize(height, width, vis.patch_size * vis.spatial_merge_size, min_pixels, max_pixels)
    tp = vis.temporal_patch_size
    return -(-frames // tp), h // vis.patch_size, w // vis.patch_size


def lm_tokens(vis: QwenVisionDesc, grid: tuple[int, int, int]) -> int:
    """Tokens the merger hands the language model: t * h * w / merge^2
    (Qwen2VLModel.get_image_features' split sizes)."""
    t, h, w = grid
    return t * h * w // vis.merge_unit


__all__ = ["TEXT_DEFAULTS", "IMAGE_MAX_PIXELS", "IMAGE_MIN_PIXELS", "QwenVisionDesc", "VIDEO_MAX_PIXELS", "VIDEO_MIN_PIXELS",
           "grid_thw", "lm_tokens", "smart_resize", "vision_from_config"]

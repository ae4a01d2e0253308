"""The LLaVA-OneVision vision side: description, exact parameters, AnyRes tiles and tokens.

Sources (transformers 5.24):
- models/llava_onevision/configuration_llava_onevision.py: LlavaOnevisionConfig (SigLIP
  vision_config 1152/4304/26 layers/384 px/patch 14 without head, Qwen2 text_config,
  vision_feature_layer -1, select strategy "full", image_grid_pinpoints the 384-multiples
  from 384 to 2304 a side, vision_aspect_ratio anyres_max_9, projector bias).
- modeling_llava_onevision.py: LlavaOnevisionMultiModalProjector (linear_1 (e -> H), act,
  linear_2 (H -> H)), `image_newline` (H), image_size_to_num_patches (the best resolution's
  tiles + the base image), pack_image_features (the tiles' features laid out at the best
  resolution, unpad_image to the image's aspect, bilinear interpolation down when
  sqrt(h w / (max g^2)) > 1.1, one newline per row, the base image's g^2 first).
- image_processing_utils.py select_best_resolution; processing_llava_onevision.py
  _get_number_of_features (the same count, from the processor's side).
Legend: e vision width, g patches per side of one tile, H LM width.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from vramplan.components.arch_vit import VisionDesc
from vramplan.families.common import siglip_tower

# LlavaOnevisionConfig's vision_config init_kwargs (the So400m tower, last layer dropped).
VISION_DEFAULTS = {"hidden_size": 1152, "intermediate_size": 4304, "patch_size": 14, "image_size": 384,
                   "num_hidden_layers": 26, "num_attention_heads": 16, "vision_use_head": False}
_TOP = {"vision_feature_layer": -1, "vision_feature_select_strategy": "full", "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True, "vision_aspect_ratio": "anyres_max_9"}
PINPOINTS = tuple((h, w) for h in range(384, 2305, 384) for w in range(384, 2305, 384))
"""LlavaOnevisionConfig.__post_init__'s default image_grid_pinpoints."""


@dataclass(frozen=True, slots=True)
class OnevisionDesc:
    tower: VisionDesc
    text_hidden: int
    pinpoints: tuple[tuple[int, int], ...] = PINPOINTS
    max_tiles: int = 9
    """anyres_max_N: the unpadded grid is pooled down past N tiles' worth of features."""
    projector_bias: bool = True
    projector_act: str = "gelu"

    @property
    def model_type(self) -> str:
        return "llava_onevision"

    @property
    def side(self) -> int:
        return self.tower.image_size // self.tower.patch_size

    def params(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """(name under `vision_tower.`, shape, layer) of SiglipVisionModel's parameters."""
        return self.tower.params()

    def projector_params(self) -> list[tuple[str, tuple[int, ...]]]:
        """The projector's and the newline's (LlavaOnevisionModel.image_newline)."""
        e, H = self.tower.hidden_size, self.text_hidden
        out = [("linear_1.weight", (H, e))] + ([("linear_1.bias", (H,))] if self.projector_bias else [])
        out += [("linear_2.weight", (H, H))] + ([("linear_2.bias", (H,))] if self.projector_bias else [])
        return out + [("image_newline", (H,))]


def best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """select_best_resolution: the (height, width) that keeps most of the image's pixels when
    it is scaled to fit, the least wasted area on a tie."""
    best, most, waste = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > most or (effective == most and wasted < waste):
            best, most, waste = (h, w), effective, wasted
    return best


def tiles(vis: OnevisionDesc, height: int, width: int) -> int:
    """Tower inputs of one image: the best resolution's tiles plus the base image
    (image_size_to_num_patches)."""
    h, w = best_resolution(height, width, vis.pinpoints)
    return math.ceil(h / vis.tower.image_size) * math.ceil(w / vis.tower.image_size) + 1


def grid_features(vis: OnevisionDesc, height: int, width: int) -> tuple[int, int, bool]:
    """(rows, columns, interpolated) of one image's tile features after unpad_image and the
    anyres_max pooling (pack_image_features)."""
    bh, bw = best_resolution(height, width, vis.pinpoints)
    g = vis.side
    ch, cw = bh // vis.tower.image_size * g, bw // vis.tower.image_size * g
    if width / height > cw / ch:
        new = int(round(height * (cw / width), 7))
        ch -= (ch - new) // 2 * 2
    else:
        new = int(round(width * (ch / height), 7))
        cw -= (cw - new) // 2 * 2
    ratio = math.sqrt(ch * cw / (vis.max_tiles * g * g))
    if ratio > 1.1:
        return int(ch // ratio), int(cw // ratio), True
    return ch, cw, False


def image_tokens(vis: OnevisionDesc, height: int, width: int) -> int:
    """Language-model tokens of one image: the base image's g^2, the grid's rows x columns
    and one newline per row."""
    rows, cols, _ = grid_features(vis, height, width)
    return vis.side ** 2 + rows * (cols + 1)


def vision_from_config(cfg: dict, text_hidden: int) -> OnevisionDesc:
    """OnevisionDesc of a `llava_onevision` config (class defaults filled in)."""
    v = {**VISION_DEFAULTS, **cfg.get("vision_config", {})}
    top = {**_TOP, **{k: cfg[k] for k in _TOP if k in cfg}}
    if v["vision_use_head"]:
        raise ValueError("vision_config.vision_use_head: SigLIP's attention-pooling head (unused by LLaVA-OneVision) "
                         "is not modelled; set it to false, as the published LLaVA-OneVision configs do")
    if top["vision_feature_layer"] != -1 or top["vision_feature_select_strategy"] != "full":
        raise ValueError("vision_feature_layer: LLaVA-OneVision with features other than the last layer's, all "
                         "patches kept (-1, full), is not modelled")
    aspect = str(top["vision_aspect_ratio"])
    if not aspect.startswith("anyres_max_") or not aspect.removeprefix("anyres_max_").isdigit():
        raise ValueError(f"vision_aspect_ratio: expected anyres_max_N, got {aspect!r}")
    pins = cfg.get("image_grid_pinpoints") or PINPOINTS
    return OnevisionDesc(tower=siglip_tower(v), text_hidden=text_hidden, pinpoints=tuple(tuple(p) for p in pins),
                         max_tiles=int(aspect.removeprefix("anyres_max_")), projector_bias=top["multimodal_projector_bias"],
                         projector_act=top["projector_hidden_act"])


__all__ = ["OnevisionDesc", "PINPOINTS", "best_resolution", "grid_features", "image_tokens", "tiles",
           "vision_from_config"]

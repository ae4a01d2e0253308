"""InternViT and the InternVL projector: description, exact parameters, tiles and tokens.

Sources (transformers 5.24):
- models/internvl/modeling_internvl.py: InternVLVisionEmbeddings (Conv2d patch embedding
  with bias, a class token, absolute position embeddings for (image/patch)^2 + 1
  positions), InternVLVisionLayer (layernorm_before/after: LayerNorm or RMSNorm per
  `norm_type`; q/k/v with `attention_bias`, optional q_norm/k_norm RMSNorms over the whole
  width, `projection_layer` with bias; fc1/fc2 with bias; layer scale lambda_1, lambda_2),
  InternVLVisionModel.layernorm (Identity under use_mean_pooling), InternVLMultiModalProjector
  (LayerNorm(e / r^2), linear_1 to the LM width, act, linear_2), pixel_shuffle with
  downsample_ratio r.
- models/got_ocr2/image_processing_pil_got_ocr2.py: get_optimal_tiled_canvas (the grid of
  tiles whose aspect ratio is closest to the image's, min..max tiles) and
  get_number_of_image_patches (the tiles plus one thumbnail when there are several).
Legend: e width, f MLP width, p patch, g = image_size / p, r downsample ratio, H LM width.
"""
from __future__ import annotations

from dataclasses import dataclass

# InternVLVisionConfig defaults (configuration_internvl.py) and InternVLConfig's.
_V = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "attention_bias": False,
      "use_qk_norm": False, "intermediate_size": 4096, "hidden_act": "gelu", "norm_type": "layer_norm",
      "image_size": (448, 448), "patch_size": (14, 14), "num_channels": 3, "use_mask_token": False,
      "use_absolute_position_embeddings": True, "use_mean_pooling": True}
_TOP = {"downsample_ratio": 0.5, "projector_hidden_act": "gelu", "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default"}
MIN_TILES, MAX_TILES = 1, 12
"""GotOcr2ImageProcessor min_patches / max_patches (InternVL's processor crops to patches)."""


@dataclass(frozen=True, slots=True)
class InternVisionDesc:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    hidden_act: str = "gelu"
    rms: bool = False
    """norm_type rms_norm (InternViT-6B) instead of layer_norm (InternViT-300M)."""
    qk_norm: bool = False
    attention_bias: bool = False
    image_size: int = 448
    patch_size: int = 14
    num_channels: int = 3
    downsample_ratio: float = 0.5
    projector_act: str = "gelu"

    @property
    def model_type(self) -> str:
        return "internvl_vision"

    @property
    def shuffle(self) -> int:
        """Patches merged into one token per side: int(1 / downsample_ratio)."""
        return int(1 / self.downsample_ratio)

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_tile(self) -> int:
        """Tokens one tile hands the language model: (g * r)^2 (256 for 448 px, patch 14)."""
        return self.patches // self.shuffle ** 2

    def params(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """(name under `vision_tower.`, shape, layer) of InternVLVisionModel's parameters."""
        e, f, p, c = self.hidden_size, self.intermediate_size, self.patch_size, self.num_channels
        out: list[tuple[str, tuple[int, ...], int | None]] = [
            ("embeddings.cls_token", (1, 1, e), None), ("embeddings.position_embeddings", (1, self.patches + 1, e), None),
            ("embeddings.patch_embeddings.projection.weight", (e, c, p, p), None),
            ("embeddings.patch_embeddings.projection.bias", (e,), None)]
        norms = ("weight",) if self.rms else ("weight", "bias")
        for i in range(self.num_layers):
            pre = f"encoder.layer.{i}"
            out += [(f"{pre}.lambda_1", (e,), i), (f"{pre}.lambda_2", (e,), i)]
            for n in ("q_proj", "k_proj", "v_proj"):
                out.append((f"{pre}.attention.{n}.weight", (e, e), i))
                if self.attention_bias:
                    out.append((f"{pre}.attention.{n}.bias", (e,), i))
            out += [(f"{pre}.attention.projection_layer.weight", (e, e), i),
                    (f"{pre}.attention.projection_layer.bias", (e,), i)]
            if self.qk_norm:
                out += [(f"{pre}.attention.q_norm.weight", (e,), i), (f"{pre}.attention.k_norm.weight", (e,), i)]
            out += [(f"{pre}.mlp.fc1.weight", (f, e), i), (f"{pre}.mlp.fc1.bias", (f,), i),
                    (f"{pre}.mlp.fc2.weight", (e, f), i), (f"{pre}.mlp.fc2.bias", (e,), i)]
            for n in ("layernorm_before", "layernorm_after"):
                out += [(f"{pre}.{n}.{w}", (e,), i) for w in norms]
        return out

    def projector_params(self) -> list[tuple[str, tuple[int, ...]]]:
        wide, H = self.hidden_size * self.shuffle ** 2, self.out_hidden_size
        return [("layer_norm.weight", (wide,)), ("layer_norm.bias", (wide,)), ("linear_1.weight", (H, wide)),
                ("linear_1.bias", (H,)), ("linear_2.weight", (H, H)), ("linear_2.bias", (H,))]


def _side(value) -> int:
    if isinstance(value, (list, tuple)):
        if value[0] != value[1]:
            raise ValueError("vision_config: non-square InternViT tiles are not modelled")
        return int(value[0])
    return int(value)


def vision_from_config(cfg: dict, text_hidden: int) -> InternVisionDesc:
    """InternVisionDesc of an `internvl` config (class defaults filled in)."""
    v = {**_V, **cfg.get("vision_config", {})}
    top = {**_TOP, **{k: cfg[k] for k in _TOP if k in cfg}}
    if top["vision_feature_layer"] != -1 or top["vision_feature_select_strategy"] != "default":
        raise ValueError("vision_feature_layer: InternVL with features other than the last layer's patches "
                         "is not modelled")
    if v["use_mask_token"] or not v["use_absolute_position_embeddings"] or not v["use_mean_pooling"]:
        raise ValueError("vision_config: InternViT without absolute positions, or with a mask token or a final "
                         "layernorm, is not modelled")
    return InternVisionDesc(hidden_size=v["hidden_size"], num_layers=v["num_hidden_layers"],
                            num_heads=v["num_attention_heads"], intermediate_size=v["intermediate_size"],
                            out_hidden_size=text_hidden, hidden_act=v["hidden_act"], rms=v["norm_type"] == "rms_norm",
                            qk_norm=bool(v["use_qk_norm"]), attention_bias=bool(v["attention_bias"]),
                            image_size=_side(v["image_size"]), patch_size=_side(v["patch_size"]),
                            num_channels=v["num_channels"], downsample_ratio=top["downsample_ratio"],
                            projector_act=top["projector_hidden_act"])


def tile_grid(height: int, width: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of get_optimal_tiled_canvas: the allowed grid (min..max tiles) whose
    width/height ratio is closest to the image's; on a tie the larger grid while the image
    covers more than half of it."""
    # h runs to max_tiles // w only (the same grids in the same order as the processor's
    # double loop, which is quadratic in max_tiles: a --max-tiles 100000 ran for minutes)
    grids = sorted(((w, h) for w in range(1, max_tiles + 1) for h in range(1, max_tiles // w + 1)
                    if min_tiles <= w * h), key=lambda g: g[0] * g[1])
    ratio, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for g in grids:
        diff = abs(ratio - g[0] / g[1])
        if diff < best_diff:
            best, best_diff = g, diff
        elif diff == best_diff and area > 0.5 * tile * tile * g[0] * g[1]:
            best = g
    return best


def num_tiles(vis: InternVisionDesc, height: int, width: int, min_tiles: int = MIN_TILES,
              max_tiles: int = MAX_TILES) -> int:
    """Tiles of one image: the grid's, plus the thumbnail when the grid has more than one
    (GotOcr2ImageProcessor.get_number_of_image_patches, crop_to_patches)."""
    if max_tiles <= 1:
        return 1
    cols, rows = tile_grid(height, width, vis.image_size, min_tiles, max_tiles)
    return 1 + cols * rows if cols * rows > 1 else 1


__all__ = ["InternVisionDesc", "MAX_TILES", "MIN_TILES", "num_tiles", "tile_grid", "vision_from_config"]

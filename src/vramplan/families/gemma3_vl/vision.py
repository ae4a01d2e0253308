"""The Gemma 3 vision side: description, exact parameters and tokens per image.

Sources (transformers 5.24):
- models/gemma3/configuration_gemma3.py: Gemma3Config (mm_tokens_per_image 256, the
  vision_config a SiglipVisionConfig, tie_word_embeddings true).
- models/siglip/modeling_siglip.py SiglipVisionModel: Conv2d patch embedding with bias,
  learned positions for (image/patch)^2 patches, SiglipEncoderLayer (LayerNorms with bias,
  q/k/v/out_proj with bias, fc1/fc2 with bias, gelu_pytorch_tanh), post_layernorm; the
  attention-pooling head only when vision_use_head (Gemma 3's configs set it false).
- models/gemma3/modeling_gemma3.py Gemma3MultiModalProjector: mm_input_projection_weight
  (e, H) (a bare Parameter used by torch.matmul), mm_soft_emb_norm (Gemma3RMSNorm(e): one
  weight, applied as x_hat * (1 + w)), AvgPool2d with kernel = patches per side / tokens per
  side.
Legend: e vision width, f MLP width, g patches per side, k tokens per side, H LM width.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from vramplan.components.arch_vit import VisionDesc
from vramplan.families.common import SIGLIP_DEFAULTS, siglip_tower

@dataclass(frozen=True, slots=True)
class Gemma3VisionDesc:
    tower: VisionDesc
    """The SigLIP tower (components/arch_vit.py: no class token, no pre-norm; every layer
    feeds last_hidden_state, then post_layernorm)."""
    text_hidden: int
    mm_tokens_per_image: int = 256

    @property
    def model_type(self) -> str:
        """`gemma3`: the projector's RMSNorm is Gemma's x_hat * (1 + w) (components/arch.rms_norm)."""
        return "gemma3"

    @property
    def patches_per_side(self) -> int:
        return self.tower.image_size // self.tower.patch_size

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @property
    def patches(self) -> int:
        return self.patches_per_side ** 2

    def params(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """(name under `vision_tower.`, shape, layer) of SiglipVisionModel's parameters."""
        return self.tower.params()

    def projector_params(self) -> list[tuple[str, tuple[int, ...]]]:
        e = self.tower.hidden_size
        return [("mm_input_projection_weight", (e, self.text_hidden)), ("mm_soft_emb_norm.weight", (e,))]


def vision_from_config(cfg: dict, text_hidden: int) -> Gemma3VisionDesc:
    """Gemma3VisionDesc of a `gemma3` config with a vision_config."""
    v = {**SIGLIP_DEFAULTS, **cfg.get("vision_config", {})}
    if v["vision_use_head"]:
        raise ValueError("vision_config.vision_use_head: SigLIP's attention-pooling head (unused by Gemma 3) is not "
                         "modelled; set it to false, as the published Gemma 3 configs do")
    tower = siglip_tower(v)
    tokens = cfg.get("mm_tokens_per_image", 256)
    side = math.isqrt(tokens) if isinstance(tokens, int) and tokens > 0 else 0
    g = tower.image_size // tower.patch_size
    if side * side != tokens or g % side:
        raise ValueError(f"mm_tokens_per_image: {tokens!r} must be a square whose side divides the {g} patches "
                         "per side (Gemma3MultiModalProjector's AvgPool2d)")
    return Gemma3VisionDesc(tower=tower, text_hidden=text_hidden, mm_tokens_per_image=tokens)


__all__ = ["Gemma3VisionDesc", "vision_from_config"]

"""What the processors of Gemma 3 and LLaVA-OneVision hand the model, for the VLM step of
measure/vlm.py (random pixels and token ids, the shapes and special tokens exact).

Sources (transformers 5.24):
- models/gemma3/processing_gemma3.py: each image becomes "\\n\\n<start_of_image>", then
  `image_seq_length` (= mm_tokens_per_image) image tokens, then "<end_of_image>\\n\\n";
  `token_type_ids` mark the image tokens with 1 (they attend to each other both ways,
  Gemma3Model.forward create_masks_for_vision_model); pixel_values (images, 3, side, side).
- models/llava_onevision/processing_llava_onevision.py `_get_number_of_features` and
  image_processing_llava_onevision.py: an image is resized to the best of
  `image_grid_pinpoints`, cut into tiles of the tower's side plus the resized base image
  (pixel_values (images, tiles + 1, 3, side, side), padded to the batch's most tiles), and
  becomes the base image's g^2 tokens plus the unpadded grid's features with one newline per
  row, pooled down when over anyres_max_9 (vramplan.families.llava_onevision.vision counts it).
"""
from __future__ import annotations

import torch


def make_gemma3_batch(job: dict, model, dtype) -> dict:
    """Per sample: each image's boi, mm_tokens_per_image image tokens and eoi, then the text
    (boi/eoi count in seq_len, as the chat template's text); token_type_ids 1 on image tokens."""
    b, s = int(job.get("micro_batch_size", 1)), int(job.get("seq_len", 128))
    v = job.get("vision") or {}
    m = int(v.get("num_images", 1))
    cfg = model.config
    per = int(cfg.mm_tokens_per_image)
    if s < 2 * m:
        raise ValueError("seq_len: each image takes its start and end tokens from seq_len")
    g = torch.Generator().manual_seed(0)
    special = min(int(cfg.image_token_id), int(cfg.boi_token_id), int(cfg.eoi_token_id))
    text = torch.randint(0, special, (b, s - 2 * m), generator=g)
    ids, types = [], []
    for _ in range(m):
        for token, count, kind in ((cfg.boi_token_id, 1, 0), (cfg.image_token_id, per, 1), (cfg.eoi_token_id, 1, 0)):
            ids.append(torch.full((b, count), int(token), dtype=torch.long))
            types.append(torch.full((b, count), kind, dtype=torch.long))
    input_ids = torch.cat(ids + [text], dim=1)
    side = int(cfg.vision_config.image_size)
    pixels = torch.randn(b * m, 3, side, side, generator=g).to(dtype)
    return {"input_ids": input_ids, "pixel_values": pixels,
            "token_type_ids": torch.cat(types + [torch.zeros_like(text)], dim=1), "labels": input_ids.clone()}


def onevision_image_tokens(model, height: int, width: int) -> tuple[int, int]:
    """(tower inputs, language-model tokens) of one image by transformers' own counts:
    image_size_to_num_patches (the model's) and LlavaOnevisionProcessor._get_number_of_features
    (the processor's, run on the model's config without a tokenizer)."""
    from types import SimpleNamespace

    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor
    cfg = model.config
    side = int(cfg.vision_config.image_size)
    n = image_size_to_num_patches((height, width), cfg.image_grid_pinpoints, side)
    proc = SimpleNamespace(image_processor=SimpleNamespace(image_grid_pinpoints=cfg.image_grid_pinpoints),
                           num_image_tokens=(side // int(cfg.vision_config.patch_size)) ** 2,
                           vision_aspect_ratio=cfg.vision_aspect_ratio)
    proc._get_unpadded_features = lambda *a: LlavaOnevisionProcessor._get_unpadded_features(proc, *a)
    return n, LlavaOnevisionProcessor._get_number_of_features(proc, height, width, side, side)


def make_llava_onevision_batch(job: dict, model, dtype) -> dict:
    """Per sample: each image's tokens (the processor expands `<image>`), then the text;
    pixel_values (images, tiles + 1, 3, side, side) and image_sizes (images, 2)."""
    b, s = int(job.get("micro_batch_size", 1)), int(job.get("seq_len", 128))
    v = job.get("vision") or {}
    m, cfg = int(v.get("num_images", 1)), model.config
    side = int(cfg.vision_config.image_size)
    height, width = int(v.get("image_height") or v.get("image_size", side)), int(v.get("image_width") or v.get("image_size", side))
    n, per = onevision_image_tokens(model, height, width)
    g = torch.Generator().manual_seed(0)
    special = min(int(cfg.image_token_id), int(cfg.video_token_id))
    text = torch.randint(0, special, (b, s), generator=g)
    ids = torch.cat([torch.full((b, m * per), int(cfg.image_token_id), dtype=torch.long), text], dim=1)
    pixels = torch.randn(b * m, n, 3, side, side, generator=g).to(dtype)
    sizes = torch.tensor([[height, width]] * (b * m), dtype=torch.long)
    return {"input_ids": ids, "pixel_values": pixels, "image_sizes": sizes, "labels": ids.clone()}


__all__ = ["make_gemma3_batch", "make_llava_onevision_batch", "onevision_image_tokens"]

"""A real vision-language training step (LLaVA, Qwen2-VL, Qwen2.5-VL) under the exact CPU meter.

    from vramplan.measure.vlm import measure_vlm
    result = measure_vlm({"task": "sft", "model": {"model_type": "llava", ...},
                          "vision": {"num_images": 1, "freeze_vision_tower": True}, ...})

The model is transformers' ``LlavaForConditionalGeneration`` built from the inline config
with random weights (nothing downloaded). The batch is what LLaVA's processor produces:
``seq_len`` text tokens plus, per image, ``image_tokens`` copies of ``image_token_id``
(the processor expands ``<image>`` to one token per visual feature), ``pixel_values`` of
``(b * num_images, 3, image_size, image_size)`` in the model dtype, and
``labels = input_ids.clone()``; the loss is the model's own (ForCausalLMLoss).
Qwen2-VL / Qwen2.5-VL (``Qwen2VLForConditionalGeneration``, ...) get what Qwen2VLProcessor
makes instead: flattened patches, ``image_grid_thw`` from the processor's smart_resize,
``mm_token_type_ids`` for M-RoPE, and videos as ``pixel_values_videos``.
Trainable: the language model (full, or LoRA on its modules) and the projector; the
vision tower only when ``vision.freeze_vision_tower`` is false.
"""
from __future__ import annotations

import gc
from typing import Any

import torch

from . import PHASE_KINDS, MeasureResult
from .build import _apply_lora, apply_checkpointing, build_optimizer, norm_precision, precision_dtypes
from .meter import MemoryMeter
from .result import metered_result
from .run import unique_bytes


QWEN_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
CLASSES = {**QWEN_CLASSES, "internvl": "InternVLForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration",
           "llava_onevision": "LlavaOnevisionForConditionalGeneration"}


def build_vlm(job: dict, dtype: torch.dtype):
    import transformers
    from transformers import AutoConfig

    cfg = dict(job["model"])
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    cls = getattr(transformers, CLASSES.get(model_type, "LlavaForConditionalGeneration"))
    attn = job.get("attention", "sdpa") or "sdpa"
    model = cls._from_config(config, attn_implementation=attn, dtype=dtype)
    model.config.use_cache = False
    vision = job.get("vision") or {}
    lora_run = job.get("method", "full") == "lora"
    if lora_run:
        lora = dict(job.get("lora") or {})
        targets = lora.get("target_modules") or ["q_proj", "v_proj"]
        # LoRA on the language model only (LLaVA and Qwen-VL recipes): a regex over its
        # module paths, the projector trained in full (modules_to_save would copy it; here it
        # is simply left trainable after get_peft_model).
        lora["target_modules"] = r".*language_model.*\.(" + "|".join(targets) + r")"
        model = _apply_lora(model, lora, "sft")
    core = model.get_base_model().model if lora_run else model.model
    tower, projector = (core.visual, core.visual.merger) if model_type in QWEN_CLASSES else \
        (core.vision_tower, core.multi_modal_projector)
    if vision.get("freeze_vision_tower", True):
        tower.requires_grad_(False)
    for p in projector.parameters():  # Qwen's merger sits inside `visual`: after the freeze
        p.requires_grad_(True)
    if getattr(core, "image_newline", None) is not None:  # LLaVA-OneVision: trained with the projector
        core.image_newline.requires_grad_(True)
    # every GradientCheckpointingLayer, the tower's too (measure/build.py: non-reentrant)
    apply_checkpointing(model, job)
    model.train()
    return model, core


def image_token_count(model_cfg: dict) -> int:
    v = model_cfg["vision_config"]
    n = (v["image_size"] // v["patch_size"]) ** 2
    return n if model_cfg.get("vision_feature_select_strategy", "default") == "default" else n + 1


def make_vlm_batch(job: dict, model, dtype) -> dict:
    if job["model"]["model_type"] in QWEN_CLASSES:
        return make_qwen_batch(job, model, dtype)
    if job["model"]["model_type"] == "internvl":
        return make_internvl_batch(job, model, dtype)
    if job["model"]["model_type"] in ("gemma3", "llava_onevision"):
        from . import vlm_inputs
        return getattr(vlm_inputs, f"make_{job['model']['model_type']}_batch")(job, model, dtype)
    b, s = int(job.get("micro_batch_size", 1)), int(job.get("seq_len", 128))
    vision = job.get("vision") or {}
    n_img = int(vision.get("num_images", 1))
    cfg = model.config
    image_id = int(cfg.image_token_id)
    per_image = image_token_count(job["model"])
    vocab = int(cfg.text_config.vocab_size)
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, vocab, (b, s), generator=g)
    text[text == image_id] = 0
    images = torch.full((b, n_img * per_image), image_id, dtype=torch.long)
    ids = torch.cat([images, text], dim=1)
    side = int(job["model"]["vision_config"]["image_size"])
    pixels = torch.randn(b * n_img, 3, side, side, generator=g).to(dtype)
    return {"input_ids": ids, "pixel_values": pixels, "labels": ids.clone()}


def internvl_tiles(model, height: int, width: int, max_tiles: int) -> int:
    """Tiles of one image by the processor's own count (transformers
    image_processing_pil_got_ocr2.py get_number_of_image_patches, crop_to_patches as
    InternVLProcessor's image processor is configured), at the tower's tile size."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    side = model.config.vision_config.image_size[0]
    proc = GotOcr2ImageProcessorPil(crop_to_patches=True, max_patches=max_tiles, size={"height": side, "width": side})
    return proc.get_number_of_image_patches(height, width, {})


def make_internvl_batch(job: dict, model, dtype) -> dict:
    """What InternVLProcessor hands the model: per sample, each image's tiles x
    image_seq_length image tokens (the processor expands `<image>`), then the text;
    pixel_values (tiles of the batch, 3, side, side)."""
    b, s = int(job.get("micro_batch_size", 1)), int(job.get("seq_len", 128))
    v = job.get("vision") or {}
    cfg = model.config
    side = int(v.get("image_size", 336))
    tiles = internvl_tiles(model, int(v.get("image_height") or side), int(v.get("image_width") or side),
                           int(v.get("max_tiles") or 12))
    m = int(v.get("num_images", 1))
    per_tile = (cfg.vision_config.image_size[0] // cfg.vision_config.patch_size[0]) ** 2 * cfg.downsample_ratio ** 2
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, min(int(cfg.text_config.vocab_size), int(cfg.image_token_id)), (b, s), generator=g)
    images = torch.full((b, m * tiles * int(per_tile)), int(cfg.image_token_id), dtype=torch.long)
    ids = torch.cat([images, text], dim=1)
    tile = int(cfg.vision_config.image_size[0])
    pixels = torch.randn(b * m * tiles, 3, tile, tile, generator=g).to(dtype)
    return {"input_ids": ids, "pixel_values": pixels, "labels": ids.clone()}


def qwen_grid(vcfg, height: int, width: int, frames: int, min_pixels: int, max_pixels: int) -> list[int]:
    """(t, h, w) of one image or video, by the processor's own smart_resize (transformers
    image_processing_pil_qwen2_vl.py) and its frame padding to the temporal patch
    (video_processing_qwen2_vl.py get_num_of_video_patches)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    p, m, tp = vcfg.patch_size, vcfg.spatial_merge_size, vcfg.temporal_patch_size
    h, w = smart_resize(height, width, p * m, min_pixels=min_pixels, max_pixels=max_pixels)
    return [(frames + -frames % tp) // tp, h // p, w // p]


def make_qwen_batch(job: dict, model, dtype) -> dict:
    """What Qwen2VLProcessor hands the model: per sample, each image's (t*h*w / merge^2)
    image tokens between its vision start and end tokens, each video's the same, then the
    text (the start/end tokens count in seq_len, as the chat template's text); mm_token_type_ids (1 image,
    2 video) for M-RoPE's get_rope_index; pixel_values (patches, C*tp*p*p) and
    image_grid_thw (and the video pair) for the whole batch."""
    b, s = int(job.get("micro_batch_size", 1)), int(job.get("seq_len", 128))
    v = job.get("vision") or {}
    cfg, vcfg = model.config, model.config.vision_config
    side = int(v.get("image_size", 336))
    height, width = int(v.get("image_height") or side), int(v.get("image_width") or side)
    kinds = []
    if int(v.get("num_images", 1)):
        kinds.append(("image", int(v.get("num_images", 1)), cfg.image_token_id, 1,
                      qwen_grid(vcfg, height, width, 1, v.get("min_pixels") or 56 * 56,
                                v.get("max_pixels") or 28 * 28 * 1280)))
    if int(v.get("num_videos", 0)):
        kinds.append(("video", int(v["num_videos"]), cfg.video_token_id, 2,
                      qwen_grid(vcfg, int(v.get("video_height") or height), int(v.get("video_width") or width),
                                int(v.get("video_frames", 16)), v.get("video_min_pixels") or 128 * 28 * 28,
                                v.get("video_max_pixels") or 28 * 28 * 768)))
    g = torch.Generator().manual_seed(0)
    vocab = int(cfg.text_config.vocab_size)
    items = sum(count for _, count, *_ in kinds)
    if s < 2 * items:
        raise ValueError("seq_len: each image or video takes its vision start and end tokens from seq_len")
    text = torch.randint(0, min(vocab, int(cfg.image_token_id)), (b, s - 2 * items), generator=g)
    ids, types, out = [], [], {}
    merge = vcfg.spatial_merge_size ** 2
    patch_dim = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size ** 2
    start, end = (torch.full((b, 1), t, dtype=torch.long) for t in (cfg.vision_start_token_id, cfg.vision_end_token_id))
    for kind, count, token, type_id, (t, h, w) in kinds:
        per = t * h * w // merge
        for _ in range(count):  # <|vision_start|> pads <|vision_end|>: get_rope_index reads one grid per run
            ids += [start, torch.full((b, per), token, dtype=torch.long), end]
            types += [torch.zeros_like(start), torch.full((b, per), type_id, dtype=torch.long), torch.zeros_like(end)]
        key = "pixel_values" if kind == "image" else "pixel_values_videos"
        out[key] = torch.randn(b * count * t * h * w, patch_dim, generator=g).to(dtype)
        out[f"{kind}_grid_thw"] = torch.tensor([[t, h, w]] * (b * count), dtype=torch.long)
    input_ids = torch.cat(ids + [text], dim=1)
    out["mm_token_type_ids"] = torch.cat(types + [torch.zeros_like(text)], dim=1)
    return {"input_ids": input_ids, **out, "labels": input_ids.clone()}


def _live_tensors() -> list[torch.Tensor]:
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def measure_vlm(job: Any, steps: int = 2, trace: bool = False) -> MeasureResult:
    job = dict(job.to_dict() if hasattr(job, "to_dict") else job)
    precision = norm_precision(job.get("precision", "fp32"))
    dtype, autocast = precision_dtypes(precision)
    if autocast is not None or precision.startswith("mixed"):
        raise ValueError("measure_vlm: pure precisions (fp32, bf16, fp16) only")
    torch.manual_seed(0)
    model, _ = build_vlm(job, dtype)
    opt = build_optimizer([p for p in model.parameters() if p.requires_grad], job)
    meter = MemoryMeter(trace=trace)
    meter.register(model.parameters(), "parameter")
    meter.register(model.buffers(), "buffer")
    meter.register(_live_tensors(), "preexisting")
    grads = 0
    with meter:
        batch = make_vlm_batch(job, model, dtype)
        meter.register(batch.values(), "batch")
        for step in range(1, steps + 1):
            with meter.phase(f"s{step}.fwd"):
                out = model(**batch)
                loss = out.loss
                del out
            with meter.phase(f"s{step}.bwd"):
                loss.backward()
            grads = unique_bytes([p.grad for p in model.parameters() if p.grad is not None])
            with meter.phase(f"s{step}.opt"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            del loss
    return metered_result(meter, model, opt, grads, PHASE_KINDS, trace=trace)


__all__ = ["build_vlm", "image_token_count", "internvl_tiles", "make_internvl_batch", "make_qwen_batch", "make_vlm_batch", "measure_vlm", "qwen_grid"]

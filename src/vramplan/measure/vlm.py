"""A real vision-language training step (LLaVA-style) under the exact CPU meter.

    from vramplan.measure.vlm import measure_vlm
    result = measure_vlm({"task": "sft", "model": {"model_type": "llava", ...},
                          "vision": {"num_images": 1, "freeze_vision_tower": True}, ...})

The model is transformers' ``LlavaForConditionalGeneration`` built from the inline config
with random weights (nothing downloaded). The batch is what LLaVA's processor produces:
``seq_len`` text tokens plus, per image, ``image_tokens`` copies of ``image_token_id``
(the processor expands ``<image>`` to one token per visual feature), ``pixel_values`` of
``(b * num_images, 3, image_size, image_size)`` in the model dtype, and
``labels = input_ids.clone()``; the loss is the model's own (ForCausalLMLoss).
Trainable: the language model (full, or LoRA on its modules) and the projector; the
vision tower only when ``vision.freeze_vision_tower`` is false.
"""
from __future__ import annotations

import gc
from typing import Any

import torch

from . import PHASE_KINDS, MeasureResult
from .build import _apply_lora, build_optimizer, norm_precision, precision_dtypes
from .meter import MemoryMeter
from .result import metered_result
from .run import unique_bytes


def build_vlm(job: dict, dtype: torch.dtype):
    from transformers import AutoConfig, LlavaForConditionalGeneration

    cfg = dict(job["model"])
    cfg.pop("model_type")
    config = AutoConfig.for_model("llava", **cfg)
    attn = job.get("attention", "sdpa") or "sdpa"
    model = LlavaForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype)
    model.config.use_cache = False
    vision = job.get("vision") or {}
    if job.get("method", "full") == "lora":
        lora = dict(job.get("lora") or {})
        targets = lora.get("target_modules") or ["q_proj", "v_proj"]
        # LoRA on the language model only (LLaVA recipes): a regex over its module paths,
        # the projector trained in full (modules_to_save would copy it; here it is simply
        # left trainable after get_peft_model).
        lora["target_modules"] = r".*language_model.*\.(" + "|".join(targets) + r")"
        model = _apply_lora(model, lora, "sft")
    core = model.get_base_model().model if job.get("method", "full") == "lora" else model.model
    for p in core.multi_modal_projector.parameters():
        p.requires_grad_(True)
    if vision.get("freeze_vision_tower", True):
        core.vision_tower.requires_grad_(False)
    model.train()
    return model, core


def image_token_count(model_cfg: dict) -> int:
    v = model_cfg["vision_config"]
    n = (v["image_size"] // v["patch_size"]) ** 2
    return n if model_cfg.get("vision_feature_select_strategy", "default") == "default" else n + 1


def make_vlm_batch(job: dict, model, dtype) -> dict:
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


__all__ = ["build_vlm", "image_token_count", "make_vlm_batch", "measure_vlm"]

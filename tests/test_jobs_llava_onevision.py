"""LLaVA-OneVision: the SigLIP tower, projector and image_newline against transformers'
LlavaOnevisionForConditionalGeneration built on the meta device, AnyRes tiles and tokens
against transformers' own counts (the model's image_size_to_num_patches, the processor's
_get_number_of_features), spec validation, and the estimate against the exact CPU
measurements committed in bench/accuracy/results-cpu.json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import vramplan
from vramplan.catalog.pipelines import find_vlm, list_vlms
from vramplan.families.llava_onevision.vision import best_resolution, image_tokens, tiles
from vramplan.jobs.vlm import resolve_vlm, vlm_num_params
from vramplan.spec import SpecError

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "accuracy" / "results-cpu.json"
TEXT = {"model_type": "qwen2", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}
VISION = {"model_type": "siglip_vision_model", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "image_size": 112, "patch_size": 14, "vision_use_head": False}
PINS = [[112, 112], [112, 224], [224, 112], [224, 224], [224, 336], [336, 224], [336, 336]]
OV = {"model_type": "llava_onevision", "text_config": TEXT, "vision_config": VISION, "image_token_index": 2040,
      "video_token_index": 2041, "image_grid_pinpoints": PINS, "vision_aspect_ratio": "anyres_max_4"}
TIED_NO_BIAS = {**OV, "text_config": {**TEXT, "tie_word_embeddings": True}, "multimodal_projector_bias": False}
BASE = {"task": "sft", "micro_batch_size": 2, "seq_len": 64, "optimizer": "adamw", "optimizer_impl": "foreach",
        "attention": "sdpa", "backend": "cpu", "precision": "fp32"}
SIZES = [(200, 336), (336, 336), (112, 112), (100, 300), (300, 90), (1080, 1920), (2000, 500), (384, 768)]


def _meta_model(cfg: dict):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, LlavaOnevisionForConditionalGeneration
    cfg = dict(cfg)
    cfg.pop("model_type")
    with torch.device("meta"):
        return LlavaOnevisionForConditionalGeneration._from_config(AutoConfig.for_model("llava_onevision", **cfg))


@pytest.mark.parametrize("cfg", [OV, TIED_NO_BIAS], ids=["untied", "tied-no-bias"])
def test_tower_projector_and_language_model_match_transformers(cfg):
    model = _meta_model(cfg)
    vis, lm = resolve_vlm(cfg)
    assert {n: s for n, s, _ in vis.params()} == {n: tuple(p.shape) for n, p in model.model.vision_tower.named_parameters()}
    projector = {n: tuple(p.shape) for n, p in model.model.multi_modal_projector.named_parameters()}
    assert dict(vis.projector_params()) == {**projector, "image_newline": tuple(model.model.image_newline.shape)}
    text = sum(p.numel() for p in model.model.language_model.parameters())
    assert lm.num_params() == text + (0 if model.config.tie_word_embeddings else model.lm_head.weight.numel())


@pytest.mark.parametrize("name", [e["name"] for e in list_vlms() if e["kind"] == "llava_onevision"])
def test_catalog_counts_match_the_meta_model_and_the_published_size(name):
    entry = find_vlm(name)
    real = sum(p.numel() for p in _meta_model(entry["config"]).parameters())
    assert vlm_num_params(entry) == real
    published = float(entry["published_params"].rstrip("B")) * 1e9
    assert abs(real / published - 1) < 0.005, (real, published)


@pytest.mark.parametrize("cfg", [OV, "llava-onevision-qwen2-7b"], ids=["tiny-anyres-max-4", "catalog-anyres-max-9"])
def test_tiles_and_tokens_match_transformers_counts(cfg):
    pytest.importorskip("torch")
    from transformers.image_processing_utils import select_best_resolution
    from vramplan.measure.vlm_inputs import onevision_image_tokens
    model = _meta_model(cfg if isinstance(cfg, dict) else find_vlm(cfg)["config"])
    vis, _ = resolve_vlm(cfg)
    for h, w in SIZES:
        assert best_resolution(h, w, vis.pinpoints) == tuple(select_best_resolution((h, w), model.config.image_grid_pinpoints))
        assert (tiles(vis, h, w), image_tokens(vis, h, w)) == onevision_image_tokens(model, h, w), (h, w)


def test_the_measured_batch_has_the_estimates_sequence_and_pixels():
    torch = pytest.importorskip("torch")
    from vramplan.measure.vlm import build_vlm, make_vlm_batch
    job = {**BASE, "model": OV, "vision": {"num_images": 1, "image_height": 200, "image_width": 336}}
    model, _ = build_vlm(job, torch.float32)
    batch = make_vlm_batch(job, model, torch.float32)
    e = vramplan.estimate(job)
    assert any(f"seq_len {batch['input_ids'].shape[1]}" in n for n in e.notes)
    assert e.components.terms["batch/pixel_values"] == batch["pixel_values"].numel() * 4


@pytest.mark.parametrize("change, field", [
    ({"vision": {"num_videos": 1}}, "vision.num_videos"),
    ({"vision": {"freeze_vision_tower": False}, "method": "lora"}, "vision.freeze_vision_tower"),
    ({"vision": {"num_images": 20, "image_size": 336}, "model": {**OV, "text_config": {**TEXT, "max_position_embeddings": 2048}}},
     "vision"),
    ({"model": {**OV, "vision_feature_layer": -2}}, "vision_feature_layer"),
    ({"model": {**OV, "vision_aspect_ratio": "pad"}}, "vision_aspect_ratio"),
])
def test_bad_inputs_name_their_field(change, field):
    job = {**BASE, "model": OV, "vision": {"num_images": 1}, **change}
    with pytest.raises(SpecError) as err:
        vramplan.estimate(job)
    assert err.value.field == field, str(err.value)


def _measured() -> dict:
    rows = json.loads(RESULTS.read_text())["cases"]
    return {r["name"]: r for r in rows if r["name"].startswith("llava-ov/")}


@pytest.mark.parametrize("name", sorted(_measured()))
def test_estimate_matches_the_measured_step(name):
    row = _measured()[name]
    measured = row["measured"]["peak_allocated_bytes"]
    assert abs(vramplan.estimate(row["job"]).peak_allocated_bytes / measured - 1) < 0.02

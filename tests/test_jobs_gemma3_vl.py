"""Gemma 3 multimodal: the SigLIP tower and the pooling projector against transformers'
Gemma3ForConditionalGeneration built on the meta device, the processor's batch against the
estimate's sequence, spec validation, and the estimate against the exact CPU measurements
committed in bench/accuracy/results-cpu.json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import vramplan
from vramplan.catalog.pipelines import find_vlm, list_vlms
from vramplan.jobs.vlm import resolve_vlm, vlm_num_params
from vramplan.spec import SpecError

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "accuracy" / "results-cpu.json"
TEXT = {"model_type": "gemma3_text", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 344,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 4096}
VISION = {"model_type": "siglip_vision_model", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 3,
          "num_attention_heads": 4, "image_size": 448, "patch_size": 14, "vision_use_head": False}
GEMMA3 = {"model_type": "gemma3", "text_config": TEXT, "vision_config": VISION, "mm_tokens_per_image": 64,
          "image_token_index": 2040, "boi_token_index": 2041, "eoi_token_index": 2042}
UNTIED = {**GEMMA3, "tie_word_embeddings": False, "mm_tokens_per_image": 16}
BASE = {"task": "sft", "micro_batch_size": 2, "seq_len": 64, "optimizer": "adamw", "optimizer_impl": "foreach",
        "attention": "sdpa", "backend": "cpu", "precision": "fp32"}


def _meta_model(cfg: dict):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, Gemma3ForConditionalGeneration
    cfg = dict(cfg)
    cfg.pop("model_type")
    with torch.device("meta"):
        return Gemma3ForConditionalGeneration._from_config(AutoConfig.for_model("gemma3", **cfg))


@pytest.mark.parametrize("cfg", [GEMMA3, UNTIED], ids=["tied", "untied-16-tokens"])
def test_tower_projector_and_language_model_match_transformers(cfg):
    model = _meta_model(cfg)
    vis, lm = resolve_vlm(cfg)
    assert {n: s for n, s, _ in vis.params()} == {n: tuple(p.shape) for n, p in model.model.vision_tower.named_parameters()}
    assert dict(vis.projector_params()) == {n: tuple(p.shape) for n, p in model.model.multi_modal_projector.named_parameters()}
    text = sum(p.numel() for p in model.model.language_model.parameters())
    assert lm.num_params() == text + (0 if model.config.tie_word_embeddings else model.lm_head.weight.numel())
    assert vis.mm_tokens_per_image == model.model.multi_modal_projector.tokens_per_side ** 2
    assert vis.patches_per_side == model.model.multi_modal_projector.patches_per_image


@pytest.mark.parametrize("name", [e["name"] for e in list_vlms() if e["kind"] == "gemma3"])
def test_catalog_counts_match_the_meta_model_and_the_published_size(name):
    entry = find_vlm(name)
    real = sum(p.numel() for p in _meta_model(entry["config"]).parameters())
    assert vlm_num_params(entry) == real
    published = float(entry["published_params"].rstrip("B")) * 1e9
    assert abs(real / published - 1) < 0.005, (real, published)


def test_the_measured_batch_has_the_estimates_sequence():
    torch = pytest.importorskip("torch")
    from vramplan.measure.vlm import build_vlm, make_vlm_batch
    job = {**BASE, "model": GEMMA3, "vision": {"num_images": 2}}
    model, _ = build_vlm(job, torch.float32)
    batch = make_vlm_batch(job, model, torch.float32)
    e = vramplan.estimate(job)
    assert any(f"seq_len {batch['input_ids'].shape[1]}" in n for n in e.notes)
    assert e.components.terms["batch/pixel_values"] == batch["pixel_values"].numel() * 4
    assert e.components.terms["batch/token_type_ids"] == batch["token_type_ids"].numel() * 8


def test_image_tokens_put_a_mask_on_every_layer():
    """The bidirectional image-token mask reaches the global layers too: each SDPA call
    converts it to a float (b, 1, S, S) mask it keeps for backward."""
    job = {**BASE, "model": GEMMA3, "vision": {"num_images": 1}}
    b, S = BASE["micro_batch_size"], BASE["seq_len"] + GEMMA3["mm_tokens_per_image"]
    terms = vramplan.estimate(job).components.terms
    assert terms["language_model/activations/layers/attn/core.mask_float"] == \
        TEXT["num_hidden_layers"] * b * S * S * 4  # fp32, both layers (the global one too)


@pytest.mark.parametrize("change, field", [
    ({"vision": {"num_videos": 1}}, "vision.num_videos"),
    ({"vision": {"freeze_vision_tower": False}, "method": "lora"}, "vision.freeze_vision_tower"),
    ({"attention": "flash"}, "attention"),
    ({"model": {**GEMMA3, "vision_config": {**VISION, "vision_use_head": True}}}, "vision_config.vision_use_head"),
    ({"model": {**GEMMA3, "mm_tokens_per_image": 50}}, "mm_tokens_per_image"),
])
def test_bad_inputs_name_their_field(change, field):
    job = {**BASE, "model": GEMMA3, "vision": {"num_images": 1}, **change}
    with pytest.raises(SpecError) as err:
        vramplan.estimate(job)
    assert err.value.field == field, str(err.value)


def _measured() -> dict:
    rows = json.loads(RESULTS.read_text())["cases"]
    return {r["name"]: r for r in rows if r["name"].startswith("gemma3-vl/")}


@pytest.mark.parametrize("name", sorted(_measured()))
def test_estimate_matches_the_measured_step(name):
    row = _measured()[name]
    measured = row["measured"]["peak_allocated_bytes"]
    assert abs(vramplan.estimate(row["job"]).peak_allocated_bytes / measured - 1) < 0.02

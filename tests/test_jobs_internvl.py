"""InternVL: InternViT and the projector against transformers' model built on the meta
device, the tiles against the processor's own count, spec validation, and the estimate
against the exact CPU measurements in bench/jobs/results.json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import vramplan
from vramplan.catalog.pipelines import find_vlm, image_tokens, list_vlms
from vramplan.families.internvl.vision import num_tiles
from vramplan.jobs.vlm import resolve_vlm, vlm_num_params
from vramplan.spec import SpecError

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "jobs" / "results.json"
TEXT = {"model_type": "qwen2", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 344,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}
VISION = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 256,
          "image_size": 224, "patch_size": 14, "attention_bias": True}
INTERNVL = {"model_type": "internvl", "text_config": TEXT, "image_token_id": 2040, "tie_word_embeddings": False,
            "vision_config": VISION}
RMS = {**INTERNVL, "tie_word_embeddings": True,
       "vision_config": {**VISION, "norm_type": "rms_norm", "use_qk_norm": True, "attention_bias": False}}
BASE = {"task": "sft", "micro_batch_size": 2, "seq_len": 32, "optimizer": "adamw", "optimizer_impl": "foreach",
        "attention": "sdpa", "backend": "cpu", "precision": "fp32"}


def _meta_model(cfg: dict):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, InternVLForConditionalGeneration
    cfg = dict(cfg)
    cfg.pop("model_type")
    with torch.device("meta"):
        return InternVLForConditionalGeneration._from_config(AutoConfig.for_model("internvl", **cfg))


@pytest.mark.parametrize("cfg", [INTERNVL, RMS], ids=["layer_norm", "rms_qk_norm"])
def test_tower_projector_and_language_model_match_transformers(cfg):
    model = _meta_model(cfg)
    vis, lm = resolve_vlm(cfg)
    assert {n: s for n, s, _ in vis.params()} == {n: tuple(p.shape) for n, p in model.model.vision_tower.named_parameters()}
    assert dict(vis.projector_params()) == {n: tuple(p.shape) for n, p in model.model.multi_modal_projector.named_parameters()}
    text = sum(p.numel() for p in model.model.language_model.parameters())
    assert lm.num_params() == text + (0 if model.config.tie_word_embeddings else model.lm_head.weight.numel())


@pytest.mark.parametrize("name", [e["name"] for e in list_vlms() if e["kind"] == "internvl"])
def test_catalog_counts_match_the_meta_model_and_the_published_size(name):
    entry = find_vlm(name)
    real = sum(p.numel() for p in _meta_model(entry["config"]).parameters())
    assert vlm_num_params(entry) == real
    published = float(entry["published_params"].rstrip("B")) * 1e9
    assert abs(real / published - 1) < 0.005, (real, published)


def test_tiles_match_the_processors_own_count():
    pytest.importorskip("PIL")
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    vis, _ = resolve_vlm("internvl3-8b")
    for max_tiles in (1, 6, 12):
        proc = GotOcr2ImageProcessorPil(crop_to_patches=True, max_patches=max_tiles, size={"height": 448, "width": 448})
        for h, w in [(448, 448), (448, 896), (1080, 1920), (3000, 400), (500, 500), (800, 1300), (100, 2000)]:
            assert num_tiles(vis, h, w, max_tiles=max_tiles) == proc.get_number_of_image_patches(h, w, {}), (h, w)
    assert vis.tokens_per_tile == 256 == image_tokens(find_vlm("internvl3-8b"), 448)


def test_tiles_become_tokens_and_pixel_values():
    e = vramplan.estimate({**BASE, "model": INTERNVL, "vision": {"num_images": 1, "image_height": 224,
                                                                   "image_width": 448}})
    # a 2 x 1 grid of 224 px tiles + the thumbnail, 64 tokens each
    assert any("192 visual tokens" in n for n in e.notes)
    assert e.components.terms["batch/pixel_values"] == 2 * 3 * 3 * 224 * 224 * 4


@pytest.mark.parametrize("vision, field", [
    ({"num_videos": 1}, "vision.num_videos"),
    ({"num_images": 40, "image_height": 2000, "image_width": 2000}, "vision"),
    ({"freeze_vision_tower": False, "_lora": True}, "vision.freeze_vision_tower"),
])
def test_bad_vision_inputs_name_their_field(vision, field):
    vision = dict(vision)
    lora = {"method": "lora"} if vision.pop("_lora", False) else {}
    with pytest.raises(SpecError) as err:
        vramplan.estimate({**BASE, **lora, "model": INTERNVL, "vision": vision})
    assert err.value.field == field


@pytest.mark.parametrize("name", [k for k in json.loads(RESULTS.read_text()) if k.startswith("internvl")])
def test_estimate_matches_the_measured_internvl_step(name):
    row = json.loads(RESULTS.read_text())[name]
    measured = row["measured"]["peak_allocated_bytes"]
    e = vramplan.estimate(row["job"])
    assert abs(e.peak_allocated_bytes / measured - 1) < 0.01, (e.peak_allocated_bytes, measured)


def test_the_measured_batch_has_the_estimates_sequence_and_tiles():
    torch = pytest.importorskip("torch")
    from vramplan.measure.vlm import build_vlm, make_vlm_batch
    job = {**BASE, "model": INTERNVL, "vision": {"num_images": 2, "image_height": 300, "image_width": 1000,
                                                 "max_tiles": 6}}
    model, _ = build_vlm(job, torch.float32)
    batch = make_vlm_batch(job, model, torch.float32)  # GotOcr2's own tile count, not ours
    e = vramplan.estimate(job)
    assert any(f"seq_len {batch['input_ids'].shape[1]}" in n for n in e.notes)
    assert e.components.terms["batch/pixel_values"] == batch["pixel_values"].numel() * 4

"""Qwen2-VL / Qwen2.5-VL: parameters against transformers' models built on the meta device,
the image/video token arithmetic against the processor's own functions, spec validation,
and the estimate against the exact CPU measurements in bench/jobs/results.json."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import vramplan
from vramplan.catalog.pipelines import find_vlm, list_vlms
from vramplan.families.qwen2_vl.vision import grid_thw, lm_tokens, smart_resize, vision_from_config
from vramplan.jobs.vlm import resolve_vlm, vlm_num_params
from vramplan.spec import SpecError

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "jobs" / "results.json"
TEXT = {"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}}
IDS = {"image_token_id": 2040, "video_token_id": 2041, "vision_start_token_id": 2042, "vision_end_token_id": 2043}
QWEN2_VL = {"model_type": "qwen2_vl", "text_config": TEXT, **IDS,
            "vision_config": {"depth": 2, "embed_dim": 64, "num_heads": 4, "mlp_ratio": 4, "hidden_size": 128}}
QWEN25_VL = {"model_type": "qwen2_5_vl", "text_config": TEXT, **IDS,
             "vision_config": {"depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
                               "out_hidden_size": 128, "window_size": 112, "fullatt_block_indexes": [1, 3]}}
BASE = {"task": "sft", "micro_batch_size": 2, "seq_len": 32, "optimizer": "adamw", "optimizer_impl": "foreach",
        "attention": "sdpa", "backend": "cpu", "precision": "fp32"}
QWEN_CATALOG = [e["name"] for e in list_vlms() if e["kind"] in ("qwen2-vl", "qwen2.5-vl")]


def _meta_model(cfg: dict):
    torch = pytest.importorskip("torch")
    import transformers
    from transformers import AutoConfig
    cfg = dict(cfg)
    model_type = cfg.pop("model_type")
    cls = {"qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
           "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration}[model_type]
    with torch.device("meta"):
        return cls._from_config(AutoConfig.for_model(model_type, **cfg))


@pytest.mark.parametrize("cfg", [QWEN2_VL, QWEN25_VL], ids=["qwen2_vl", "qwen2_5_vl"])
def test_tower_merger_and_language_model_match_transformers_names_and_shapes(cfg):
    model = _meta_model(cfg)
    vis, lm = resolve_vlm(cfg)
    real = {n: tuple(p.shape) for n, p in model.model.visual.named_parameters()}
    ours = {n: s for n, s, _ in vis.params()} | dict(vis.merger_params())
    assert ours == real
    text = sum(p.numel() for p in model.model.language_model.parameters())
    head = 0 if model.config.tie_word_embeddings else model.lm_head.weight.numel()
    assert lm.num_params() == text + head


@pytest.mark.parametrize("name", QWEN_CATALOG)
def test_catalog_counts_match_the_meta_model_and_the_published_size(name):
    entry = find_vlm(name)
    model = _meta_model(entry["config"])
    real = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    assert vlm_num_params(entry) == real
    published = float(entry["published_params"].rstrip("B")) * 1e9
    assert abs(real / published - 1) < 0.005, (real, published)


def test_image_patches_match_the_processors_own_arithmetic():
    pytest.importorskip("PIL")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
    proc = Qwen2VLImageProcessorPil()
    vis = vision_from_config(find_vlm("qwen2.5-vl-7b")["config"])
    for h, w in [(224, 336), (1080, 1920), (4000, 3000), (30, 40), (28, 5000), (333, 517)]:
        for lo, hi in [(56 * 56, 28 * 28 * 1280), (256 * 28 * 28, 512 * 28 * 28)]:
            assert smart_resize(h, w, 28, lo, hi) == hf_smart_resize(h, w, 28, lo, hi)
            t, gh, gw = grid_thw(vis, h, w, 1, lo, hi)
            assert t == 1 and gh * gw == proc.get_number_of_image_patches(h, w, {"min_pixels": lo, "max_pixels": hi})
            assert lm_tokens(vis, (t, gh, gw)) * 4 == gh * gw
    with pytest.raises(ValueError):
        hf_smart_resize(10, 2500, 28)
    with pytest.raises(ValueError):
        smart_resize(10, 2500, 28, 56 * 56, 28 * 28 * 1280)


def test_video_frames_pad_to_the_temporal_patch():
    vis = vision_from_config(find_vlm("qwen2-vl-7b")["config"])
    h, w = smart_resize(360, 640, 28, 128 * 28 * 28, 768 * 28 * 28)
    for frames in (1, 2, 7, 8, 9):
        t, gh, gw = grid_thw(vis, 360, 640, frames, 128 * 28 * 28, 768 * 28 * 28)
        assert t == math.ceil(frames / 2) and (gh, gw) == (h // 14, w // 14)


def est(model, **vision):
    return vramplan.estimate({**BASE, "model": model, "vision": vision})


def test_tokens_from_the_image_size_join_the_sequence():
    e = est(QWEN2_VL, num_images=2, image_height=224, image_width=336)
    assert any("192 visual tokens" in n and "seq_len 224" in n for n in e.notes)
    patches = 2 * 2 * 16 * 24
    assert e.components.terms["batch/pixel_values_image"] == patches * 3 * 2 * 14 * 14 * 4
    big = est(QWEN2_VL, num_images=1, image_height=2240, image_width=2240, max_pixels=448 * 448)
    assert any("256 visual tokens" in n for n in big.notes)  # max_pixels caps the resize


def test_window_attention_keeps_its_index_and_a_frozen_tower_saves_nothing():
    trained = est(QWEN25_VL, image_height=224, image_width=336, freeze_vision_tower=False)
    frozen = est(QWEN25_VL, image_height=224, image_width=336, freeze_vision_tower=True)
    t = trained.components.terms
    assert t["vision_tower/activations/embeddings/vision.window_index"] == 2 * 384 // 4 * 8
    assert frozen.components.total("vision_tower/activations") == 0
    assert frozen.components.total("projector/activations") > 0  # the merger trains
    assert any(e.label == "vision tower forward (frozen)" for e in frozen.events)
    assert trained.peak_allocated_bytes > frozen.peak_allocated_bytes


@pytest.mark.parametrize("vision, field", [
    ({"image_height": 10, "image_width": 2500}, "vision.image_size"),
    ({"num_images": 8, "image_height": 2000, "image_width": 2000}, "vision"),
    ({"min_pixels": 10000, "max_pixels": 5000}, "vision.min_pixels"),
    ({"num_images": 1, "freeze_vision_tower": False, "_lora": True}, "vision.freeze_vision_tower"),
])
def test_bad_vision_inputs_name_their_field(vision, field):
    vision = dict(vision)
    lora = {"method": "lora"} if vision.pop("_lora", False) else {}
    with pytest.raises(SpecError) as err:
        vramplan.estimate({**BASE, **lora, "model": QWEN2_VL, "vision": vision})
    assert err.value.field == field


def test_a_fixed_size_tower_refuses_videos():
    from test_jobs_vlm import LLAVA
    with pytest.raises(SpecError) as err:
        vramplan.estimate({**BASE, "model": LLAVA, "vision": {"num_videos": 1}})
    assert err.value.field == "vision.num_videos"


@pytest.mark.parametrize("name", [k for k in json.loads(RESULTS.read_text()) if k.startswith("qwen")])
def test_estimate_matches_the_measured_qwen_vl_step(name):
    row = json.loads(RESULTS.read_text())[name]
    measured = row["measured"]["peak_allocated_bytes"]
    e = vramplan.estimate(row["job"])
    assert abs(e.peak_allocated_bytes / measured - 1) < 0.01, (e.peak_allocated_bytes, measured)


def test_full_checkpointing_keeps_each_tower_layers_input_and_recomputes_the_rest():
    plain = est(QWEN25_VL, image_height=224, image_width=336, freeze_vision_tower=False)
    gc = vramplan.estimate({**BASE, "model": QWEN25_VL, "gradient_checkpointing": "full",
                            "vision": {"image_height": 224, "image_width": 336, "freeze_vision_tower": False}})
    n, e, depth = 2 * 16 * 24, 64, 4
    end = [next(ev.live for ev in x.events if ev.label.startswith("end of forward")) for x in (plain, gc)]
    assert end[1].total("vision_tower/activations/layers") == depth * n * e * 4
    layer0 = next(ev for ev in gc.events if ev.label.startswith("image vision layer 0"))
    recomputed = layer0.live.total("recomputed")
    assert 0 < recomputed < end[0].total("vision_tower/activations/layers")


@pytest.mark.parametrize("cfg, vision", [
    (QWEN2_VL, {"num_images": 2, "image_height": 300, "image_width": 500}),
    (QWEN25_VL, {"num_images": 1, "image_size": 224, "num_videos": 1, "video_frames": 5, "video_min_pixels": 3136}),
])
def test_the_measured_batch_has_the_estimates_sequence_and_patches(cfg, vision):
    torch = pytest.importorskip("torch")
    from vramplan.measure.vlm import build_vlm, make_vlm_batch
    job = {**BASE, "model": cfg, "vision": vision}
    model, _ = build_vlm(job, torch.float32)
    batch = make_vlm_batch(job, model, torch.float32)  # the processor's smart_resize, not ours
    e = vramplan.estimate(job)
    S = batch["input_ids"].shape[1]
    assert any(f"seq_len {S}" in n for n in e.notes)
    for kind, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        if key in batch:
            assert e.components.terms[f"batch/pixel_values_{kind}"] == batch[key].numel() * 4

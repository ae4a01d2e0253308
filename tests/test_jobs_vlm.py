"""Vision-language jobs: the tower's parameters against transformers, mechanisms, and the
estimate against the exact CPU measurements committed in bench/jobs/results.json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import vramplan
from vramplan.jobs.vlm import vision_from_llava_config

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "jobs" / "results.json"


def as_measured(job: dict) -> dict:
    """These steps were measured by bench/jobs (measure/jobs.py, measure/vlm.py), which build
    the model in the precision's dtype and run it without autocast: pure 16-bit. Under the
    default stack (HF Trainer) the word `bf16` now means autocast over the load dtype, so
    the committed job is read with the word for what ran."""
    if job.get("precision") in ("bf16", "fp16"):
        return {**job, "precision": "pure-" + job["precision"]}
    return job
TEXT = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 344,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 1024, "tie_word_embeddings": False}
VISION = {"model_type": "clip_vision_model", "hidden_size": 96, "intermediate_size": 384, "num_hidden_layers": 3,
          "num_attention_heads": 4, "image_size": 112, "patch_size": 14, "projection_dim": 64}
LLAVA = {"model_type": "llava", "text_config": TEXT, "vision_config": VISION, "image_token_id": 2047,
         "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu"}
BASE = {"task": "sft", "model": LLAVA, "micro_batch_size": 2, "seq_len": 64, "optimizer": "adamw",
        "optimizer_impl": "foreach", "attention": "sdpa", "backend": "cpu", "precision": "fp32"}


def est(**fields):
    return vramplan.estimate({**BASE, **fields})


def test_tower_and_projector_parameters_match_transformers():
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, LlavaForConditionalGeneration
    cfg = dict(LLAVA)
    cfg.pop("model_type")
    with torch.device("meta"):
        model = LlavaForConditionalGeneration._from_config(AutoConfig.for_model("llava", **cfg))
    vis = vision_from_llava_config(LLAVA)
    tower = sum(p.numel() for p in model.model.vision_tower.parameters())
    proj = sum(p.numel() for p in model.model.multi_modal_projector.parameters())
    assert sum(_numel(s) for _, s, _ in vis.params()) == tower
    assert sum(_numel(s) for _, s in vis.projector_params()) == proj
    assert vis.visual_tokens(112) == (112 // 14) ** 2  # default strategy drops the class token


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_visual_tokens_join_the_language_models_sequence():
    one, two = est(vision={"num_images": 1}), est(vision={"num_images": 2})
    assert any("64 visual tokens" in n and "seq_len 128" in n for n in one.notes)
    lse = lambda e: max(ev.live.total("language_model/logits/log_softmax") for ev in e.events)  # noqa: E731
    assert lse(one) == 2 * 128 * 2048 * 4 and lse(two) == 2 * 192 * 2048 * 4
    assert one.components.terms["batch/pixel_values"] == 2 * 3 * 112 * 112 * 4


def test_trained_tower_saves_activations_and_holds_optimizer_state():
    frozen, trained = est(vision={"freeze_vision_tower": True}), est(vision={"freeze_vision_tower": False})
    assert frozen.components.total("vision_tower/activations") == 0
    assert "vision_tower/weights/frozen" in frozen.components.terms
    assert trained.components.total("vision_tower/activations") > 0
    assert trained.peak_allocated_bytes > frozen.peak_allocated_bytes
    # the last layer feeds nothing (feature layer -2): its weights stay frozen, no state
    vis = vision_from_llava_config(LLAVA)
    last = sum(_numel(s) for n, s, layer in vis.params() if layer == 2) * 4
    post = 2 * 96 * 4
    assert trained.components.terms["vision_tower/weights/frozen"] == last + post
    assert any(e.label == "vision tower forward (frozen)" for e in frozen.events)


@pytest.mark.parametrize("name", ["vlm/fp32/full/tower-frozen", "vlm/fp32/full/tower-trained", "vlm/fp32/full/tower-trained/gc",
                                  "vlm/bf16/full/tower-trained", "vlm/bf16/lora/tower-frozen/2img"])
def test_estimate_matches_the_measured_llava_step(name):
    row = json.loads(RESULTS.read_text())[name]
    measured = row["measured"]["peak_allocated_bytes"]
    e = vramplan.estimate(as_measured(row["job"]))
    assert abs(e.peak_allocated_bytes / measured - 1) < 0.01, (e.peak_allocated_bytes, measured)

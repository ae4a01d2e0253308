"""LTX-Video, HunyuanVideo and Mochi: parameter counts against the real diffusers /
transformers classes built on the meta device, LoRA adapter counts against PEFT on the real
tiny models, the frames/resolution/patch arithmetic, bad sizes as one line, and the
estimate against the committed exact-meter measurements (bench/video)."""
from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import pytest

import vramplan
from vramplan.catalog.pipelines import denoiser_tokens, find_pipeline, latent_shape, list_pipelines
from vramplan.spec import SpecError

NEW = ["ltx-video", "hunyuanvideo", "mochi-1-preview"]
BENCH = Path(__file__).resolve().parents[1] / "bench" / "video"


def _meta_count(build) -> int:
    import torch
    with torch.device("meta"):
        model = build()
    return sum(p.numel() for p in model.parameters())


def _from_fields(cls, fields: dict):
    keys = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in fields.items() if k in keys})


@pytest.mark.parametrize("name", NEW)
def test_denoiser_and_vae_counts_are_the_diffusers_classes_on_meta(name):
    diffusers = pytest.importorskip("diffusers")
    from vramplan.measure.diffusion import count_params
    pipe = find_pipeline(name)
    assert count_params(pipe) == pipe["denoiser"]["num_params"]
    vae = getattr(diffusers, pipe["vae"]["class"])
    assert _meta_count(lambda: _from_fields(vae, pipe["vae"])) == pipe["vae"]["num_params"]


@pytest.mark.parametrize("name", NEW)
def test_text_encoder_counts_are_the_transformers_classes_on_meta(name):
    transformers = pytest.importorskip("transformers")
    for enc in find_pipeline(name)["text_encoders"]:
        if enc["class"] == "T5EncoderModel":
            cfg = transformers.T5Config(vocab_size=enc["vocab_size"], d_model=enc["d_model"], d_kv=enc["d_kv"],
                                        d_ff=enc["d_ff"], num_layers=enc["num_layers"], num_heads=enc["num_heads"],
                                        feed_forward_proj=enc["feed_forward_proj"])
        elif enc["class"] == "LlamaModel":
            cfg = transformers.LlamaConfig(vocab_size=enc["vocab_size"], hidden_size=enc["d_model"],
                                           intermediate_size=enc["d_ff"], num_hidden_layers=enc["num_layers"],
                                           num_attention_heads=enc["num_heads"],
                                           num_key_value_heads=enc["num_key_value_heads"])
        else:  # CLIP-L's text tower (the pooled projection)
            cfg = transformers.CLIPTextConfig(hidden_size=enc["d_model"], intermediate_size=enc["d_ff"],
                                              num_hidden_layers=enc["num_layers"], num_attention_heads=enc["num_heads"])
        assert _meta_count(lambda: getattr(transformers, enc["class"])(cfg)) == enc["num_params"], enc["role"]


def test_tokens_follow_each_vae_and_patch():
    ltx = find_pipeline("ltx-video")  # 32 x 32 x 8 compression, patch 1: 161 frames -> 1 + 160 / 8 = 21
    assert latent_shape(ltx, 1, 512, 704, 161) == (1, 128, 21, 16, 22)
    assert denoiser_tokens(ltx, 512, 704, 161) == {"image": 21 * 16 * 22, "text": 0, "context": 128}
    hunyuan = find_pipeline("hunyuanvideo")  # 8 x 8 x 4, patch (1, 2, 2); 256 Llama tokens join the sequence
    assert latent_shape(hunyuan, 1, 720, 1280, 129) == (1, 16, 33, 90, 160)
    assert denoiser_tokens(hunyuan, 720, 1280, 129) == {"image": 33 * 45 * 80, "text": 256, "context": 0}
    mochi = find_pipeline("mochi-1-preview")  # 8 x 8 x 6, patch 2: 19 frames -> 1 + 18 / 6 = 4
    assert latent_shape(mochi, 1, 480, 848, 19) == (1, 12, 4, 60, 106)
    assert denoiser_tokens(mochi, 480, 848, 19) == {"image": 4 * 30 * 53, "text": 256, "context": 0}


@pytest.mark.parametrize("name,field,diffusion", [
    ("ltx-video", "diffusion.width", {"height": 512, "width": 700, "num_frames": 161}),
    ("ltx-video", "diffusion.num_frames", {"height": 512, "width": 704, "num_frames": 160}),
    ("hunyuanvideo", "diffusion.height", {"height": 712, "width": 1280, "num_frames": 129}),
    ("mochi-1-preview", "diffusion.num_frames", {"height": 480, "width": 848, "num_frames": 17}),
])
def test_bad_sizes_name_the_field(name, field, diffusion):
    with pytest.raises(SpecError) as err:
        vramplan.estimate({"task": "diffusion", "model": name, "diffusion": diffusion})
    assert err.value.field == field


def test_models_lists_the_video_pipelines():
    assert set(NEW) <= {e["name"] for e in list_pipelines()}


@pytest.mark.parametrize("name", NEW)
def test_catalog_estimates_order_by_mechanism(name):
    d = find_pipeline(name)["defaults"]
    pre = {"vae": "precomputed", "text_encoders": "precomputed"}

    def est(method, diffusion, **fields):
        job = {"task": "diffusion", "model": name, "method": method, "precision": "bf16",
               "diffusion": {**d, **diffusion}, **fields}
        return vramplan.estimate(job)
    lora, full = est("lora", pre), est("full", pre)
    assert lora.peak_allocated_bytes < full.peak_allocated_bytes
    assert full.trainable_params == find_pipeline(name)["denoiser"]["num_params"]
    assert est("lora", pre, gradient_checkpointing="full").peak_allocated_bytes < lora.peak_allocated_bytes
    assert est("lora", {}).components.terms.get(f"text_encoder_{find_pipeline(name)['text_encoders'][-1]['role']}"
                                                 "/weights/frozen", 0) > 0


def _bench():
    sys.path.insert(0, str(BENCH))
    import run
    return run


@pytest.mark.parametrize("case", ["ltx/fp32/lora", "hunyuan/fp32/lora", "mochi/fp32/lora"])
def test_lora_adapters_are_what_peft_adds(case):
    pytest.importorskip("peft")
    from peft import LoraConfig

    from vramplan.measure.diffusion import build_denoiser
    import torch
    job = _bench().CASES[case]
    with torch.device("meta"):
        model = build_denoiser(job["model"], job["diffusion"], torch.float32)
    model.add_adapter(LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert vramplan.estimate(job).trainable_params == adapters


def test_committed_measurements_within_two_percent():
    rows = json.loads((BENCH / "results.json").read_text())
    assert {k.split("/")[0] for k in rows} == {"ltx", "hunyuan", "mochi"}
    for name, row in rows.items():
        measured = row["measured"]["peak_allocated_bytes"]
        assert abs(vramplan.estimate(row["job"]).peak_allocated_bytes / measured - 1) < 0.02, name


def test_live_cpu_measurement_of_the_real_ltx_transformer():
    pytest.importorskip("diffusers")
    from conftest import measure_fresh  # the meter counts what earlier tests left alive
    job = _bench().CASES["ltx/fp32/full"]
    m, e = measure_fresh(job), vramplan.estimate(job)
    assert abs(e.peak_allocated_bytes / m["peak_allocated_bytes"] - 1) < 0.02, (e.peak_allocated_bytes, m)

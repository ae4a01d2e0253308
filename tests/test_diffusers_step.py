"""diffusers' example LoRA scripts (`stack: diffusers-scripts`): the pipeline's parameter
counts against the real classes, the scripts' mechanisms in the estimate, and one step
measured in a fresh process against the estimate."""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

import vramplan

BENCH = Path(__file__).resolve().parents[1] / "bench" / "diffusers"
needs_diffusers = pytest.mark.skipif(importlib.util.find_spec("diffusers") is None, reason="diffusers not installed")


def bench_job(name: str) -> dict:
    return copy.deepcopy(json.loads((BENCH / "results.json").read_text())[name]["job"])


@needs_diffusers
@pytest.mark.parametrize("case", ["cogvideox-lora/fp32", "sd-lora/fp32", "sdxl-lora/fp32"])
def test_pipeline_counts_match_the_real_classes_on_meta(case):
    from vramplan.measure.diffusion import count_params
    from vramplan.measure.diffusers_models import count_frozen
    job = bench_job(case)
    pipe = job["model"]
    frozen = count_frozen(pipe)
    assert count_params(pipe, job["diffusion"]) == pipe["denoiser"]["num_params"]
    assert frozen["vae"] == pipe["vae"]["num_params"]
    for enc in pipe["text_encoders"]:
        assert frozen[f"text_encoder_{enc['role']}"] == enc["num_params"]


@needs_diffusers
def test_unet_lora_adapters_count_as_peft_adds_them():
    from peft import LoraConfig
    from vramplan.measure.diffusion import build_denoiser
    import torch
    job = bench_job("sd-lora/fp32")
    with torch.device("meta"):  # no storage: later in-process measurements see nothing left over
        unet = build_denoiser(job["model"], job["diffusion"], torch.float32).requires_grad_(False)
        unet.add_adapter(LoraConfig(r=8, lora_alpha=8, target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    trained = sum(p.numel() for p in unet.parameters() if p.requires_grad)
    assert trained > 0
    assert vramplan.estimate(job).trainable_params == trained


def test_scripts_keep_adapters_in_the_weight_dtype_and_latents_of_encoded_videos():
    bf16 = vramplan.estimate(bench_job("cogvideox-lora/bf16"))
    fp16 = vramplan.estimate({**bench_job("cogvideox-lora/bf16"), "precision": "fp16"})
    plain = vramplan.estimate({**bench_job("cogvideox-lora/bf16"), "stack": "plain"})
    lora = bf16.components.terms["denoiser/weights/lora_adapters"]
    # bf16: adapters in the weight dtype; fp16: cast_training_params upcasts them; plain: PEFT's fp32
    assert fp16.components.terms["denoiser/weights/lora_adapters"] == 2 * lora
    assert plain.components.terms["denoiser/weights/lora_adapters"] == 2 * lora
    encode = next(e for e in bf16.events if e.label.startswith("vae forward"))
    assert "batch/latent_dist" in encode.live.terms and "batch/pixels" not in encode.live.terms
    assert "batch/pixels" in next(e for e in plain.events if e.label.startswith("vae forward")).live.terms


def test_committed_measurements_are_within_two_percent():
    rows = json.loads((BENCH / "results.json").read_text())
    assert rows
    for name, row in rows.items():
        assert row["measured"]["runner"]["library"] == "diffusers", name
        e = vramplan.estimate(row["job"])
        assert abs(e.peak_allocated_bytes / row["measured"]["peak_allocated_bytes"] - 1) < 0.02, name
        for kind, value in row["measured"]["phases"].items():
            assert abs(e.phases[kind] / value - 1) < 0.05, (name, kind)


@needs_diffusers
def test_a_small_script_step_measured_fresh_matches_the_estimate():
    from conftest import measure_fresh
    job = bench_job("cogvideox-lora/bf16")
    job["diffusion"].update(height=64, width=64)
    m = measure_fresh(job)
    assert m["runner"]["library"] == "diffusers" and m["runner"]["entry"].endswith("train_cogvideox_lora.py")
    e = vramplan.estimate(job)
    assert abs(e.peak_allocated_bytes / m["peak_allocated_bytes"] - 1) < 0.02
    for kind, value in m["phases"].items():
        assert abs(e.phases[kind] / value - 1) < 0.05, kind


def test_sdxl_script_keeps_its_vae_in_fp32_and_concatenates_both_text_states():
    job = bench_job("sdxl-lora/bf16")
    sdxl = vramplan.estimate(job)
    pipe = job["model"]
    assert sdxl.components.terms["vae/weights/frozen"] == 4 * pipe["vae"]["num_params"]
    width = sum(e["d_model"] for e in pipe["text_encoders"])
    assert sdxl.components.terms["batch/text_embeddings"] == 2 * job["micro_batch_size"] * 77 * width
    plain = vramplan.estimate({**job, "stack": "plain"})  # no script: the VAE in the weight dtype
    assert plain.components.terms["vae/weights/frozen"] == 2 * pipe["vae"]["num_params"]


@needs_diffusers
@pytest.mark.parametrize("source", ["bench", "catalog"])
def test_controlnet_count_is_from_unet_on_meta(source):
    import torch
    from diffusers import ControlNetModel
    from vramplan.catalog.pipelines import find_pipeline
    from vramplan.measure.diffusion import build_denoiser
    pipe = bench_job("sd-controlnet/fp32")["model"] if source == "bench" else find_pipeline("stable-diffusion-v1-5")
    widths = tuple(pipe["controlnet"]["conditioning_embedding_out_channels"])
    with torch.device("meta"):
        unet = build_denoiser(pipe, {}, torch.float32)
        net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=widths)
    assert sum(p.numel() for p in net.parameters()) == pipe["controlnet"]["num_params"]


@pytest.mark.parametrize("change,field", [
    ({"model": "flux.1-dev"}, "diffusion.controlnet"),
    ({"method": "lora", "lora": {"r": 8}}, "method"),
    ({"model": {**bench_job("sd-controlnet/fp32")["model"], "controlnet": {}}}, "model.controlnet.num_params")])
def test_controlnet_jobs_that_cannot_run_name_their_field(change, field):
    from vramplan.spec import SpecError
    with pytest.raises(SpecError) as err:
        vramplan.estimate({**bench_job("sd-controlnet/fp32"), **change})
    assert err.value.field == field


def test_controlnet_trains_in_fp32_with_its_gradients_kept_and_autocast_copies():
    bf16 = vramplan.estimate(bench_job("sd-controlnet/bf16"))
    n = bench_job("sd-controlnet/bf16")["model"]["controlnet"]["num_params"]
    terms = bf16.components.terms
    assert terms["controlnet/weights/trainable"] == terms["controlnet/gradients"] == 4 * n
    assert bf16.trainable_params == n
    peak = max(bf16.events, key=lambda e: e.total)
    assert peak.live.terms["controlnet/activations/autocast_weight_casts"] == 2 * n


@needs_diffusers
def test_a_small_controlnet_step_measured_fresh_matches_the_estimate():
    from conftest import measure_fresh
    job = bench_job("sd-controlnet/bf16")
    job["diffusion"].update(height=128, width=128)  # the committed rows are 256 x 256
    m = measure_fresh(job)
    assert m["runner"]["entry"].endswith("train_controlnet.py")
    e = vramplan.estimate(job)
    assert abs(e.peak_allocated_bytes / m["peak_allocated_bytes"] - 1) < 0.02
    for kind, value in m["phases"].items():
        assert abs(e.phases[kind] / value - 1) < 0.05, kind


def _vae_event(e) -> tuple[int, dict]:
    ev = next(ev for ev in e.events if ev.label.startswith("vae forward"))
    return ev.total, ev.live.terms


def test_vae_encode_tiled_and_sliced_matches_its_measured_phase():
    """train_text_to_image_lora.py's VAE encode, measured as its own phase (`s{n}.encode`)
    with `enable_tiling()` (AutoencoderKL's tile_sample_min_size = config.sample_size, 128
    px here: 3 x 3 overlapping tiles of the 256 px batch) and `enable_slicing()` (one sample
    at a time), against the estimate's VAE forward event."""
    rows = json.loads((BENCH / "results.json").read_text())
    for name in ("sd-lora/fp32/vae-tiling", "sd-lora/fp32/vae-slicing"):
        row = rows[name]
        measured = max(v for k, v in row["measured"]["phase_peaks"].items() if k.endswith(".encode"))
        total, _ = _vae_event(vramplan.estimate(row["job"]))
        assert abs(total / measured - 1) < 0.02, (name, f"{total / measured - 1:+.2%}")


def test_vae_tiling_holds_one_tile_and_only_where_the_image_is_larger():
    """The first level's working set (4 tensors of b x c x side^2): one 128 px tile a side
    when tiled; a 128 px image is not tiled (AutoencoderKL._encode tiles only larger ones)."""
    job = bench_job("sd-lora/fp32/vae-tiling")
    untiled = copy.deepcopy(job)
    del untiled["diffusion"]["vae_tiling"]
    level = "vae/forward/level0"
    b, c = job["micro_batch_size"], job["model"]["vae"]["block_out_channels"][0]
    assert _vae_event(vramplan.estimate(job))[1][level] == 4 * b * c * 128 * 128 * 4
    assert _vae_event(vramplan.estimate(untiled))[1][level] == 4 * b * c * 256 * 256 * 4
    for j in (job, untiled):
        j["diffusion"].update(height=128, width=128)
    assert _vae_event(vramplan.estimate(job)) == _vae_event(vramplan.estimate(untiled))

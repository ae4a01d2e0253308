"""Generation pipelines: parameter counts against the real diffusers / transformers classes
built on the meta device, the frames/resolution/patch arithmetic, bad sizes as one line,
the new training options, and the recorder's blocks against the committed measurements."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import vramplan
from vramplan.catalog.pipelines import denoiser_tokens, find_pipeline, latent_shape, list_pipelines
from vramplan.cli import main
from vramplan.spec import SpecError

NEW = ["flux.1-dev", "flux.1-schnell", "stable-diffusion-3-medium", "stable-diffusion-3.5-large", "stable-diffusion-3.5-medium",
       "wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "dit-xl-2-256",
       "stable-diffusion-xl-base-1.0"]
BENCH = Path(__file__).resolve().parents[1] / "bench" / "jobs" / "results.json"


@pytest.mark.parametrize("name", NEW)
def test_denoiser_count_is_the_diffusers_class_on_meta(name):
    pytest.importorskip("diffusers")
    from vramplan.measure.diffusion import count_params
    pipe = find_pipeline(name)
    assert count_params(pipe) == pipe["denoiser"]["num_params"]


@pytest.mark.parametrize("name", ["flux.1-dev", "wan2.1-t2v-1.3b"])
def test_vae_and_t5_counts_are_the_real_classes_on_meta(name):
    diffusers = pytest.importorskip("diffusers")
    import inspect

    import torch
    import transformers
    pipe = find_pipeline(name)
    vae = pipe["vae"]
    cls = getattr(diffusers, vae["class"])
    keys = inspect.signature(cls.__init__).parameters
    with torch.device("meta"):
        built = cls(**{k: v for k, v in vae.items() if k in keys})
    assert sum(p.numel() for p in built.parameters()) == vae["num_params"]
    enc = pipe["text_encoders"][-1]
    config_cls = transformers.UMT5Config if enc["class"] == "UMT5EncoderModel" else transformers.T5Config
    cfg = config_cls(vocab_size=enc["vocab_size"], d_model=enc["d_model"], d_kv=enc["d_kv"], d_ff=enc["d_ff"],
                     num_layers=enc["num_layers"], num_heads=enc["num_heads"],
                     feed_forward_proj=enc["feed_forward_proj"])
    with torch.device("meta"):
        model = getattr(transformers, enc["class"])(cfg)
    assert sum(p.numel() for p in model.parameters()) == enc["num_params"]


def test_tokens_follow_vae_patch_and_packing():
    wan = find_pipeline("wan2.1-t2v-1.3b")
    # 81 frames -> 1 + 80/4 = 21 latent frames; 480x832 / 8 -> 60 x 104; patch (1, 2, 2)
    assert latent_shape(wan, 1, 480, 832, 81) == (1, 16, 21, 60, 104)
    assert denoiser_tokens(wan, 480, 832, 81) == {"image": 21 * 30 * 52, "text": 0, "context": 512}
    flux = find_pipeline("flux.1-dev")  # 1024 / 8 = 128 latents, packed 2x2 -> 64 x 64 tokens + 512 T5
    assert denoiser_tokens(flux, 1024, 1024, 1) == {"image": 4096, "text": 512, "context": 0}
    sd35 = find_pipeline("stable-diffusion-3.5-large")  # CLIP 77 + T5 256 joined on the sequence
    assert denoiser_tokens(sd35, 1024, 1024, 1)["text"] == 333


@pytest.mark.parametrize("field,diffusion", [
    ("diffusion.height", {"height": 500, "width": 832, "num_frames": 81}),
    ("diffusion.width", {"height": 480, "width": 840, "num_frames": 81}),
    ("diffusion.num_frames", {"height": 480, "width": 832, "num_frames": 80}),
])
def test_bad_sizes_name_the_field(field, diffusion):
    with pytest.raises(SpecError) as err:
        vramplan.estimate({"task": "diffusion", "model": "wan2.1-t2v-1.3b", "diffusion": diffusion})
    assert err.value.field == field


def test_bad_size_is_one_cli_line(capsys):
    code = main(["estimate", "flux.1-dev", "--height", "1000"])
    err = capsys.readouterr().err
    import re
    line = err.strip().splitlines()[-1]
    assert code == 2 and "error: diffusion.height" in line and "error" not in err.replace(line, "")
    assert int(re.search(r"use e\.g\. (\d+)", line).group(1)) % 16 == 0  # 8 (VAE) x 2 (packing)


def test_models_lists_the_new_pipelines(capsys):
    main(["models", "--kind", "diffusion", "--json"])
    names = {r["name"] for r in json.loads(capsys.readouterr().out)}
    assert set(NEW) <= names and names == {e["name"] for e in list_pipelines()}


def test_flags_reach_a_wan_estimate(capsys):
    args = ["estimate", "wan2.1-t2v-1.3b", "--method", "lora", "--vae", "precomputed", "--text-encoders",
            "precomputed", "--json"]
    short = json.loads((main(args + ["--num-frames", "17", "--height", "240", "--width", "416"]),
                        capsys.readouterr().out)[1])
    long = json.loads((main(args + ["--num-frames", "33", "--height", "240", "--width", "416"]),
                       capsys.readouterr().out)[1])
    assert short["spec"]["diffusion"]["num_frames"] == 17
    assert long["peak_allocated_bytes"] > short["peak_allocated_bytes"]


def _est(**diffusion):
    base = {"height": 1024, "width": 1024}
    return vramplan.estimate({"task": "diffusion", "model": "flux.1-dev", "method": "lora", "precision": "bf16",
                              "micro_batch_size": 2, "diffusion": {**base, **diffusion}})


def test_prior_preservation_doubles_the_denoiser_batch():
    one, two = _est(vae="precomputed"), _est(vae="precomputed", prior_preservation=True)
    assert two.components.terms["batch/latents"] == 2 * one.components.terms["batch/latents"]
    assert two.peak_allocated_bytes > one.peak_allocated_bytes


def test_vae_slicing_and_tiling_shrink_the_encode():
    def vae_event(e):
        return next(ev.total for ev in e.events if ev.label.startswith("vae forward"))
    plain = _est(height=2048, width=2048)
    assert vae_event(_est(height=2048, width=2048, vae_slicing=True)) < vae_event(plain)
    assert vae_event(_est(height=2048, width=2048, vae_tiling=True)) < vae_event(plain)


@pytest.mark.parametrize("kind", ["flux-tiny", "sd3-tiny", "wan-tiny"])
def test_committed_measurements_within_two_percent(kind):
    rows = {k: v for k, v in json.loads(BENCH.read_text()).items() if kind in k}
    assert rows, kind
    for name, row in rows.items():
        measured = row["measured"]["peak_allocated_bytes"]
        assert abs(vramplan.estimate(row["job"]).peak_allocated_bytes / measured - 1) < 0.02, name

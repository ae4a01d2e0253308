"""Video diffusion from flags, its header, and `vramplan models` with every kind."""
import json
from pathlib import Path

from vramplan.cli import main

EXAMPLE = Path(__file__).parents[1] / "examples" / "cogvideox-5b-unlearning" / "job.yaml"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_flags_equal_the_yaml_spec(capsys):
    _, yaml_out, _ = run(capsys, "estimate", "--spec", str(EXAMPLE), "--json")
    code, flag_out, _ = run(capsys, "estimate", "cogvideox-5b", "--gpu", "l40s", "--precision", "bf16",
                            "--gradient-checkpointing", "full", "--num-frames", "49", "--height", "480",
                            "--width", "720", "--frozen-copy", "--vae", "precomputed", "--json")
    a, b = json.loads(yaml_out), json.loads(flag_out)
    assert a["spec"] == b["spec"] and a["device_bytes"] == b["device_bytes"]


def test_more_frames_need_more_memory(capsys):
    base = ["estimate", "cogvideox-2b", "--height", "480", "--width", "720", "--vae", "precomputed", "--json"]
    small = json.loads(run(capsys, *base, "--num-frames", "9")[1])["peak_allocated_bytes"]
    large = json.loads(run(capsys, *base, "--num-frames", "49")[1])["peak_allocated_bytes"]
    assert large > small


def test_pipeline_defaults_fill_what_is_not_given(capsys):
    code, out, err = run(capsys, "estimate", "cogvideox-5b", "--height", "240", "--json")
    spec = json.loads(out)["spec"]
    assert code == 0 and spec["task"] == "diffusion"
    assert spec["diffusion"]["height"] == 240 and spec["diffusion"]["num_frames"] == 49
    assert "num_frames=49" in err and "height" not in err.split("diffusion:")[1].split("from")[0]


def test_header_shows_frames_not_seq_len(capsys):
    code, out, _ = run(capsys, "estimate", "cogvideox-2b", "--num-frames", "17", "--height", "256",
                       "--width", "384")
    text = " ".join(out.split())
    assert code == 0 and "17x256x384 (frames x height x width)" in text and "s=2048" not in text
    assert "denoiser 1.69 B +" in text


def test_models_lists_every_kind_and_filters(capsys):
    rows = json.loads(run(capsys, "models", "--json")[1])
    kinds = {r["kind"] for r in rows}
    assert kinds == {"llm", "vlm", "diffusion"}
    names = {r["name"] for r in rows}
    assert {"cogvideox-5b", "llava-1.5-7b", "llama-3.1-8b"} <= names
    only = json.loads(run(capsys, "models", "--kind", "diffusion", "--json")[1])
    assert only and all(r["kind"] == "diffusion" for r in only)
    cog = json.loads(run(capsys, "models", "CogVideo", "--json")[1])
    assert {r["name"] for r in cog} == {"cogvideox-2b", "cogvideox-5b"}
    five = next(r for r in cog if r["name"] == "cogvideox-5b")
    assert five["trained_params"] == 5_570_479_680 < five["num_params"]


def test_diffusion_flag_with_another_task_is_one_line(capsys):
    code, _, err = run(capsys, "estimate", "llama-3.2-1b", "--task", "sft", "--num-frames", "9")
    assert code == 2 and "diffusion" in err and err.count("\n") == 1


def test_fit_without_a_step_time_model_claims_no_speed(capsys):
    """No FLOPs model covers a diffusion pipeline: fit, fewest GPUs and largest batch report
    no step time (not 0 s/step) and rank no layout as faster than another."""
    base = ["fit", "stable-diffusion-v1-5", "--gpu", "a100-40gb", "--num-gpus", "2"]
    code, out, _ = run(capsys, *base, "--json")
    results = json.loads(out)["results"]
    assert code == 0 and results
    assert all(r["step_time_s"] is None and r["step_time"]["total_s"] is None for r in results)
    assert not any("faster" in w or "fastest" in w for r in results for w in r["why"])
    code, text, _ = run(capsys, *base)
    assert "not ranked by speed" in " ".join(text.split()) and "0.000 s/step" not in text
    code, text, _ = run(capsys, "fit", "stable-diffusion-v1-5", "--gpu", "a100-40gb", "--minimize", "num_gpus")
    assert code == 0 and "step time not modelled" in text and "s/step" not in text
    # a language model keeps its step times
    code, out, _ = run(capsys, "fit", "qwen2.5-0.5b", "--gpu", "a100-40gb", "--json", "--top-k", "2")
    assert all(r["step_time_s"] > 0 for r in json.loads(out)["results"])

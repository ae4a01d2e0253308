"""examples/: each worked scenario runs and its output holds the facts its README claims.

Facts, not numbers: which option saves memory, what fits where, which way a change moves the
estimate. A scenario whose spec needs job types or layouts vramplan cannot load yet is
skipped with the loader's reason.
"""
from __future__ import annotations

import json
import os

import pytest

from vramplan.catalog import find_gpu
from vramplan.cli import main
from vramplan.spec import SpecError, load_spec

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")


def spec_or_skip(example: str, name: str = "job.yaml"):
    path = os.path.join(EXAMPLES, example, name)
    try:
        spec = load_spec(path)
        from vramplan.estimation import estimate
        estimate(spec)                        # every model of the job resolves
        return spec
    except (SpecError, KeyError) as exc:
        pytest.skip(f"{example}/{name} does not load yet: {exc}")


def run_json(capsys, monkeypatch, example: str, *argv):
    monkeypatch.chdir(os.path.join(EXAMPLES, example))
    code = main(list(argv) + ["--json"])
    out, err = capsys.readouterr()
    assert code in (0, 1), err
    return json.loads(out)


def test_every_example_has_a_spec_and_commands():
    for name in sorted(os.listdir(EXAMPLES)):
        folder = os.path.join(EXAMPLES, name)
        if os.path.isdir(folder):
            assert os.path.isfile(os.path.join(folder, "job.yaml")), name
            text = open(os.path.join(folder, "run.sh")).read()
            assert "vramplan " in text and "--spec job.yaml" in text, name


def test_dpo_8b_holds_a_reference_copy_and_zero3_never_costs(capsys, monkeypatch):
    spec = spec_or_skip("dpo-8b-4gpu")
    est = run_json(capsys, monkeypatch, "dpo-8b-4gpu", "estimate", "--spec", "job.yaml")
    sft = run_json(capsys, monkeypatch, "dpo-8b-4gpu", "estimate", "--spec", "job.yaml", "--task", "sft")
    assert est["device_bytes"] > sft["device_bytes"], "a frozen reference and paired rows cost memory"
    assert any(k.startswith("reference") for k in est["components"])
    rows = {r["name"]: r for r in run_json(capsys, monkeypatch, "dpo-8b-4gpu", "compare", "--spec", "job.yaml")["rows"]}
    # compare estimates the whole job (policy and reference), exactly as `estimate` does.
    assert rows["baseline"]["estimate"]["device_bytes"] == est["device_bytes"]
    assert rows["zero-3 + checkpointing"]["estimate"]["device_bytes"] <= rows["baseline"]["estimate"]["device_bytes"]
    fit = run_json(capsys, monkeypatch, "dpo-8b-4gpu", "fit", "--spec", "job.yaml", "--top-k", "3")
    assert all(r["fits"] for r in fit["results"])
    assert fit["results"] or fit["suggestions"]
    assert spec.num_gpus == 4


def test_reward_model_lora_saves_and_all_linear_trains_more(capsys, monkeypatch):
    spec_or_skip("reward-mistral-7b-8x64gb")
    data = run_json(capsys, monkeypatch, "reward-mistral-7b-8x64gb", "compare", "--spec", "job.yaml",
                    "--strategies", "strategies.yaml")
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ["baseline", "full + zero-3", "lora r=16", "lora r=16 all-linear"]
    assert rows["lora r=16"]["saving_bytes"] > 0
    qv = rows["lora r=16"]["estimate"]["model"]["trainable_params"]
    every = rows["lora r=16 all-linear"]["estimate"]["model"]["trainable_params"]
    assert every > qv > 0
    assert rows["full + zero-3"]["saving_bytes"] >= 0
    assert rows["lora r=16"]["relative_step_time"] < 1.0


def test_cogvideox_unlearning_offload_lowers_device_memory(capsys, monkeypatch):
    spec_or_skip("cogvideox-5b-unlearning")
    spec_or_skip("cogvideox-5b-unlearning", "job-offload.yaml")
    plain = run_json(capsys, monkeypatch, "cogvideox-5b-unlearning", "estimate", "--spec", "job.yaml")
    off = run_json(capsys, monkeypatch, "cogvideox-5b-unlearning", "estimate", "--spec", "job-offload.yaml")
    assert off["device_bytes"] < plain["device_bytes"]
    rows = run_json(capsys, monkeypatch, "cogvideox-5b-unlearning", "compare", "--spec", "job.yaml",
                    "--strategy", "offload frozen diffusion.offload_frozen=true")["rows"]
    assert [r["name"] for r in rows] == ["baseline", "offload frozen"]
    assert rows[1]["estimate"]["device_bytes"] == off["device_bytes"]       # the same job either way


def test_deepseek_long_context_flash_and_fused_loss(capsys, monkeypatch, tmp_path):
    spec_or_skip("deepseek-1.5b-long-context")
    ex, long = "deepseek-1.5b-long-context", ["--seq-len", "131072", "--gradient-checkpointing", "full"]
    short = run_json(capsys, monkeypatch, ex, "estimate", "--spec", "job.yaml")
    assert short["fits"]
    eager = run_json(capsys, monkeypatch, ex, "estimate", "--spec", "job.yaml", *long, "--attention", "eager")
    flash = run_json(capsys, monkeypatch, ex, "estimate", "--spec", "job.yaml", *long, "--attention", "flash")
    fused = run_json(capsys, monkeypatch, ex, "estimate", "--spec", "job.yaml", *long,
                     "--loss-impl", "fused-linear-cross-entropy")
    assert eager["device_bytes"] > flash["device_bytes"] > fused["device_bytes"]
    assert not eager["fits"]
    groups = {}
    for k, v in flash["components"].items():
        groups[k.split("/")[0]] = groups.get(k.split("/")[0], 0) + v
    assert max(groups, key=groups.get) == "logits"        # at 128K the vocabulary dominates
    plot = tmp_path / "longest.html"
    solved = run_json(capsys, monkeypatch, ex, "fit", "--spec", "job.yaml", "--maximize", "seq_len",
                      "--plot", str(plot))
    assert solved["value"] >= 512 and solved["estimate"]["fits"] and plot.exists()


def test_qwq_32b_lora_trains_a_sliver_and_qlora_halves_it(capsys, monkeypatch):
    spec_or_skip("qwq-32b-lora")
    est = run_json(capsys, monkeypatch, "qwq-32b-lora", "estimate", "--spec", "job.yaml")
    assert est["model"]["trainable_params"] < 0.01 * est["model"]["num_params"]
    rows = {r["name"]: r for r in run_json(capsys, monkeypatch, "qwq-32b-lora", "compare", "--spec", "job.yaml")["rows"]}
    assert "lora" not in rows                      # already LoRA: that row would be the baseline
    assert rows["qlora"]["saving_pct"] > 0.4
    solved = run_json(capsys, monkeypatch, "qwq-32b-lora", "fit", "--spec", "job.yaml", "--maximize",
                      "micro_batch_size")
    if est["verdict"] == "fits":                   # fit keeps the upper bound on the card by default
        assert solved["value"] >= 1
    bare = run_json(capsys, monkeypatch, "qwq-32b-lora", "fit", "--spec", "job.yaml", "--maximize",
                    "micro_batch_size", "--headroom", "0")
    if est["fits"]:
        assert bare["value"] >= 1


def test_what_fits_on_24gb(capsys, monkeypatch):
    spec_or_skip("fits-on-24gb")
    tiers = run_json(capsys, monkeypatch, "fits-on-24gb", "compare", "--spec", "job.yaml", "--tiers")
    by = {g["gpu"]: g for g in tiers["gpus"]}
    assert by["rtx-4090"]["strategy"] not in (None, "baseline")      # full 8B does not fit 24 GB
    assert by["h200-141gb"]["strategy"] == "baseline"
    assert "rtx-4090" in [f["gpu"] for f in tiers["tiers"]["24-40 GB"]["fits"]]
    assert not run_json(capsys, monkeypatch, "fits-on-24gb", "estimate", "--spec", "job.yaml")["fits"]
    fit = run_json(capsys, monkeypatch, "fits-on-24gb", "fit", "--spec", "job.yaml")
    # Full fine-tuning of 8B on 24 GB only fits with the optimizer on the CPU (ZeRO-Offload).
    assert all(r["fits"] and r["changes"]["parallel.offload_optimizer"] == "cpu" for r in fit["results"])
    assert fit["results"] or fit["suggestions"]
    limit = find_gpu("rtx-4090").memory_bytes
    assert all(s["device_bytes"] <= (find_gpu(s["gpu"]).memory_bytes if s["gpu"] else limit)
               for s in fit["suggestions"])
    solved = run_json(capsys, monkeypatch, "fits-on-24gb", "fit", "--spec", "job.yaml", "--method", "qlora",
                      "--maximize", "seq_len")
    assert solved["value"] >= 2048

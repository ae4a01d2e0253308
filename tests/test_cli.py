"""CLI behaviour: answers, JSON schema, and every error path as one line with exit code 2."""
import json

import pytest

from vramplan.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_json(capsys):
    code, out, _ = run(capsys, "estimate", "qwen2.5-0.5b", "--method", "lora", "--seq-len", "512", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["schema_version"] == 1 and data["peak_allocated_bytes"] > 0
    assert set(data["phases"]) == {"forward", "backward", "optimizer"}


def test_estimate_table(capsys):
    code, out, _ = run(capsys, "estimate", "llama-3.2-1b", "--gpu", "rtx-4090", "--seq-len", "1024")
    assert code == 0 and "peak allocated" in out and "rtx-4090" in out


def test_hub_id_resolves_offline(capsys):
    code, out, _ = run(capsys, "estimate", "meta-llama/Llama-3.1-8B", "--json")
    assert code == 0 and json.loads(out)["model"]["num_params"] == 8_030_261_248


def test_config_path_and_spec_file(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
                               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}))
    spec = tmp_path / "job.yaml"
    spec.write_text(f"model: {cfg}\nprecision: bf16\nseq_len: 64\n")
    saved = tmp_path / "saved.json"
    code, out, _ = run(capsys, "estimate", "--spec", str(spec), "--micro-batch-size", "3",
                       "--save-spec", str(saved), "--json")
    assert code == 0
    assert json.loads(saved.read_text())["micro_batch_size"] == 3


def test_models_and_gpus(capsys):
    code, out, _ = run(capsys, "models", "--json")
    assert code == 0 and len(json.loads(out)) >= 30
    code, out, _ = run(capsys, "gpus", "--json")
    assert code == 0 and any(g["name"] == "h100-80gb" for g in json.loads(out))


@pytest.mark.parametrize("argv, needle", [
    (["estimate", "llama-3.1-8bb"], "did you mean 'llama-3.1-8b'"),
    (["estimate", "llama-3.1-8b", "--precision", "bf17"], "precision"),
    (["estimate", "llama-3.1-8b", "--micro-batch-size", "0"], "micro_batch_size"),
    (["estimate", "llama-3.1-8b", "--seq-len", "abc"], "seq-len"),
    (["estimate", "./missing/config.json"], "no such file"),
    (["estimate", "--spec", "/nonexistent.yaml"], "not found"),
    (["estimate", "llama-3.1-8b", "--gpu", "a100-90gb"], "a100"),
    (["estimate", "llama-3.1-8b", "--method", "full", "--optimizer", "adamw"], None),
    (["estimate"], "model"),
    (["nonsense"], "invalid choice"),
])
def test_errors_are_one_line_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    if needle is None:
        assert code == 0
        return
    assert code == 2
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_malformed_config_file(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text("{not json")
    code, _, err = run(capsys, "estimate", str(cfg))
    assert code == 2 and "not valid JSON" in err


def test_unknown_hub_id_offline(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run(capsys, "estimate", "someorg/not-a-model")
    assert code == 2 and "not in the catalog or the local Hugging Face cache" in err and "--online" in err


def test_parallel_flags_and_deepspeed_import(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                              "train_micro_batch_size_per_gpu": 2}))
    code, out, err = run(capsys, "estimate", "llama-3.2-1b", "--num-gpus", "4", "--deepspeed", str(ds), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["spec"]["parallel"]["zero_stage"] == 3 and data["spec"]["micro_batch_size"] == 2
    assert "zero_optimization.stage" in err
    code, out, _ = run(capsys, "estimate", "llama-3.2-1b", "--num-gpus", "4", "--zero-stage", "3", "--json")
    single = json.loads(run(capsys, "estimate", "llama-3.2-1b", "--json")[1])
    assert json.loads(out)["components"].get("optimizer/exp_avg", 0) < single["components"].get("optimizer/exp_avg", 1)


def test_missing_engine_config_is_one_line(capsys):
    code, _, err = run(capsys, "estimate", "llama-3.2-1b", "--deepspeed", "/nonexistent/ds.json")
    assert code == 2 and err.count("\n") == 1 and "not found" in err


def test_loose_names_match_one_catalog_entry():
    from vramplan.catalog import find_gpu, find_model
    assert find_gpu("rtx4090").name == find_gpu("RTX 4090").name == "rtx-4090"
    assert find_model("Llama 3.1 8B").name == "llama-3.1-8b"


def test_measure_puts_the_estimate_beside_the_measurement(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    spec = tmp_path / "job.yaml"
    spec.write_text("model: {model_type: llama, vocab_size: 500, hidden_size: 64, intermediate_size: 128, "
                    "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2}\n"
                    "precision: fp32\nmicro_batch_size: 2\nseq_len: 32\nbackend: cpu\n")
    code, out, _ = run(capsys, "measure", "--spec", str(spec), "--device", "cpu", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["measured"]["peak_allocated_bytes"] > 0 and data["failure"] is None
    err = data["error"]
    assert set(err["phases"]) == {"forward", "backward", "optimizer"}
    assert err["params"] == 0 and err["grads"] == 0
    assert abs(err["peak"]) < 0.02


def test_pipeline_names_say_how_to_ask(capsys):
    # a diffusion catalog name alone implies --task diffusion on the command line ...
    code, out, _ = run(capsys, "estimate", "cogvideox-5b", "--json")
    assert code == 0 and json.loads(out)["spec"]["task"] == "diffusion"
    # ... and with another task named, the error says how to ask
    code, _, err = run(capsys, "estimate", "cogvideox-5b", "--task", "sft")
    assert code == 2 and "--task diffusion" in err
    code, _, err = run(capsys, "estimate", "llava-1.5-7b")
    assert code == 2 and "vision" in err


def test_measure_attributes_each_model_of_a_multi_model_job(tmp_path):
    # a DPO job keys its terms 'policy/weights/...', 'reference/weights/...': the per-term
    # errors sum every role's terms (they read -100% when only unprefixed keys were summed)
    pytest.importorskip("trl")
    import subprocess
    import sys
    spec = tmp_path / "dpo.yaml"
    spec.write_text("model: {model_type: llama, vocab_size: 500, hidden_size: 64, intermediate_size: 128, "
                    "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2}\n"
                    "task: dpo\nmethod: full\nprecision: fp32\nmicro_batch_size: 1\nseq_len: 32\nbackend: cpu\n")
    out = subprocess.run([sys.executable, "-m", "vramplan", "measure", "--spec", str(spec), "--device", "cpu",
                          "--json"], capture_output=True, text=True, timeout=600)
    data = json.loads(out.stdout)
    assert data["runner"]["library"] == "trl" and data["failure"] is None
    err = data["error"]
    # both models' weights are alive in the optimizer step, in the meter and in the estimate
    assert abs(err["params"]) < 0.01 and abs(err["grads"]) < 0.01
    assert abs(err["peak"]) < 0.02


def test_measure_runs_trl_for_a_precomputed_reference(tmp_path):
    # reference_model: precomputed is TRL's precompute_ref_log_probs (scored in the trainer's
    # __init__, no reference kept): `vramplan measure` runs KTOTrainer itself, not a written-out step
    pytest.importorskip("trl")
    import subprocess
    import sys
    spec = tmp_path / "kto.yaml"
    spec.write_text("model: {model_type: llama, vocab_size: 500, hidden_size: 64, intermediate_size: 128, "
                    "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2}\n"
                    "task: kto\nreference_model: precomputed\nmethod: full\nprecision: fp32\nmicro_batch_size: 2\n"
                    "seq_len: 32\nbackend: cpu\n")
    out = subprocess.run([sys.executable, "-m", "vramplan", "measure", "--spec", str(spec), "--device", "cpu",
                          "--json"], capture_output=True, text=True, timeout=600)
    data = json.loads(out.stdout)
    assert data["runner"]["library"] == "trl" and data["runner"]["entry"] == "KTOTrainer" and data["failure"] is None
    assert abs(data["error"]["peak"]) < 0.02

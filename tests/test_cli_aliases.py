"""Flag names users already type in TRL / TrainingArguments, pairs vs rows, params per model."""
import json

import pytest

from vramplan.cli import dashed, main


def spec_of(capsys, *argv):
    code = main(["estimate", "qwen2.5-0.5b", *argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("alias, key, value", [
    ("--max-length", "seq_len", 384), ("--max_seq_length", "seq_len", 640), ("--cutoff-len", "seq_len", 96),
    ("--per-device-train-batch-size", "micro_batch_size", 3), ("--per_device_train_batch_size", "micro_batch_size", 5),
    ("--batch", "micro_batch_size", 4), ("--batch-size", "micro_batch_size", 6),
    ("--gradient-accumulation-steps", "grad_accum_steps", 7), ("--gradient_accumulation_steps", "grad_accum_steps", 2)])
def test_aliases_set_the_spec_key(capsys, alias, key, value):
    assert spec_of(capsys, alias, str(value))["spec"][key] == value


def test_alias_changes_the_answer(capsys):
    short = spec_of(capsys, "--max-length", "128")["peak_allocated_bytes"]
    long = spec_of(capsys, "--max-length", "2048")["peak_allocated_bytes"]
    assert long > short


def test_trainer_flags_go_through_the_training_args_importer(capsys):
    spec = spec_of(capsys, "--optim", "adamw_torch_fused", "--bf16", "--gradient_checkpointing", "true",
                   "--attn_implementation", "flash_attention_2")["spec"]
    # --bf16 is the HF Trainer's flag: its stack's bf16 (autocast over the weights as loaded)
    assert (spec["optimizer"], spec["optimizer_impl"], spec["precision"]) == ("adamw", "fused", "bf16")
    assert spec["gradient_checkpointing"] == "full" and spec["attention"] == "flash"
    # an explicit spec flag wins over the trainer's
    assert spec_of(capsys, "--bf16", "--precision", "bf16")["spec"]["precision"] == "bf16"


def test_unknown_optim_is_one_line(capsys):
    assert main(["estimate", "qwen2.5-0.5b", "--optim", "adamw_nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vramplan: error: ") and "optim: optimizer 'adamw_nosuch'" in err and err.count("\n") == 1


def test_dashed_leaves_values_alone():
    assert dashed(["--max_length", "a_b", "--lora_target_modules=q_proj,v_proj", "--x"]) == \
        ["--max-length", "a_b", "--lora-target-modules=q_proj,v_proj", "--x"]


def test_help_says_pairs(capsys):
    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--per-device-train-batch-size" in out and "--max-length" in out
    assert "dpo/ipo/orpo/simpo/reward-model: PAIRS" in out


def test_header_says_pairs_and_params_per_model(capsys):
    code = main(["estimate", "qwen2.5-0.5b", "--task", "dpo", "--micro-batch-size", "2", "--seq-len", "128"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert "b=2 pairs (4 rows" in out
    assert "policy 0.49 B + reference 0.49 B params" in out


def test_per_model_params_in_json_sum_to_the_total(capsys):
    data = spec_of(capsys, "--task", "distill", "--teacher", "qwen2.5-1.5b", "--seq-len", "64")["model"]
    assert set(data["per_model"]) == {"student", "teacher"}
    assert sum(data["per_model"].values()) == data["num_params"]
    assert data["per_model"]["teacher"] > 2 * data["per_model"]["student"]

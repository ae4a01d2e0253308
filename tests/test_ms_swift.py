"""ms-swift: the committed measurements of its own `swift sft` / `swift pt` (bench/stack/ms_swift.py,
results-ms-swift.json) against what the importer and the estimator make of the same command
line today; the importer's reading of ms-swift's defaults, files and shell scripts; and the
kept positions of its `logits_to_keep`. Needs no ms-swift: the measurements are committed;
rerun the bench (bench/stack/README.md) to renew them."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import vramplan
from vramplan.cli import main
from vramplan.components.kept_logits import kept_positions
from vramplan.importers import ImportError_, import_config_files
from vramplan.importers.ms_swift import from_swift
from vramplan.importers.shell import parse_command
from vramplan.spec import SpecError

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "stack" / "ms_swift.py"
RESULTS = json.loads((ROOT / "bench" / "stack" / "results-ms-swift.json").read_text())
ROWS = RESULTS["rows"]
PEAK_TARGET, PHASE_TARGET = 0.02, 0.05


def _bench():
    spec = importlib.util.spec_from_file_location("bench_ms_swift", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BENCH_MOD = _bench()


def test_every_case_was_run_by_ms_swift():
    assert [r["name"] for r in ROWS] == [c[0] for c in BENCH_MOD.CASES]
    for row in ROWS:
        assert "failed" not in row, row["name"]
        assert row["measured"]["runner"]["library"] == "ms-swift"
    assert RESULTS["versions"]["ms-swift"] == "4.6.0"


@pytest.mark.parametrize("row", ROWS, ids=[r["name"] for r in ROWS])
def test_committed_job_is_what_the_command_imports_to(row):
    command, argv, _, prompt_len = BENCH_MOD.case(row["name"])
    assert (row["command"], row["argv"], row["prompt_len"]) == (command, argv, prompt_len)
    assert BENCH_MOD.import_case(row["name"]) == row["job"]


@pytest.mark.parametrize("row", ROWS, ids=[r["name"] for r in ROWS])
def test_estimate_is_current_and_within_targets(row):
    est = BENCH_MOD.estimate(row["job"])
    assert est == row["estimated"], "estimator changed: rerun bench/stack/ms_swift.py --reestimate"
    err = BENCH_MOD.errors(row["measured"], est)
    within = abs(err["peak"]) <= PEAK_TARGET and all(
        abs(err[phase]) <= PHASE_TARGET for phase in ("forward", "backward", "optimizer"))
    assert within != (row["name"] in BENCH_MOD.OPEN), err


def test_the_run_used_the_defaults_the_importer_assumes():
    # ms-swift resolved these itself (its Seq2SeqTrainingArguments, read back after the run)
    by_name = {r["name"]: r for r in ROWS}
    args = by_name["sft/lora/b8/gc/accum-default"]["measured"]["args"]
    assert args["gradient_accumulation_steps"] == "2"  # ceil(16 / 8 / 1)
    assert by_name["sft/lora/b8/gc/accum-default"]["job"]["grad_accum_steps"] == 2
    base = by_name["sft/lora/b2/gc"]["measured"]["args"]
    assert base["optim"] == "OptimizerNames.ADAMW_TORCH_FUSED" and base["weight_decay"] == "0.1"
    assert base["gradient_checkpointing"] == "True" and base["use_logits_to_keep"] == "True"
    assert base["bf16"] == "True"
    for name in ("dpo/lora/b1/gc", "rm/lora/b1/gc"):  # TRL's config default, which ms-swift's trainers run
        assert by_name[name]["measured"]["args"]["disable_dropout"] == "True"
    job = by_name["sft/lora/b2/gc"]["job"]
    assert (job["optimizer"], job["optimizer_impl"], job["weight_decay"]) == ("adamw", "fused", 0.1)
    assert job["lora"] == {"r": 8, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"}


def _swift(**fields) -> dict:
    return from_swift({"model": "Qwen/Qwen2.5-7B-Instruct", "max_length": 2048, **fields})[0]


def test_defaults_of_a_bare_command():
    out = _swift()
    assert out["stack"] == "ms-swift" and out["method"] == "lora"
    assert out["micro_batch_size"] == 1 and out["grad_accum_steps"] == 16
    assert out["gradient_checkpointing"] == "full" and out["precision"] == "bf16"
    assert "load_dtype" not in out  # the checkpoint's own dtype


def test_world_size_divides_the_default_accumulation():
    cfg, command, env = parse_command("NPROC_PER_NODE=4 CUDA_VISIBLE_DEVICES=0,1,2,3 swift sft --model m "
                                      "--max_length 1024 --per_device_train_batch_size 2")
    out, _ = from_swift(cfg, command=command, env=env)
    assert out["num_gpus"] == 4 and out["grad_accum_steps"] == 2  # ceil(16 / 2 / 4)


def test_torch_dtype_decides_the_autocast():
    # model_args.py _init_mixed_precision: bf16 loads under bf16, fp16 and fp32 under fp16
    assert _swift(torch_dtype="bfloat16")["precision"] == "bf16"
    fp32 = _swift(torch_dtype="float32")
    assert (fp32["load_dtype"], fp32["precision"]) == ("fp32", "fp16")
    assert _swift(torch_dtype="float32", bf16=True, fp16=False)["precision"] == "bf16"
    with pytest.raises(ImportError_, match="sets fp16 from torch_dtype float32"):
        _swift(torch_dtype="float32", bf16=True)  # swift fills fp16, then TrainingArguments refuses both
    assert _swift(torch_dtype="bfloat16", bf16=False, fp16=False)["precision"] == "fp32"


def test_quantization_needs_a_quant_method():
    # quant_args.py get_quantization_config returns None without quant_method
    out, rep = from_swift({"model": "m", "quant_bits": 4})
    assert out["method"] == "lora" and "quantization" not in out and "quant_bits" in rep.unresolved
    q = _swift(quant_method="bnb", quant_bits=4)
    assert q["method"] == "qlora" and q["quantization"] == {"bits": 4, "type": "nf4", "double_quant": True}
    assert _swift(quant_method="bnb", quant_bits=8)["quantization"]["type"] == "int8"


def test_deepspeed_presets_and_sequence_parallel():
    assert _swift(deepspeed="zero3_offload")["parallel"] == {"zero_stage": 3, "offload_optimizer": "cpu",
                                                              "offload_params": "cpu"}
    assert _swift(deepspeed="zero2")["parallel"] == {"zero_stage": 2}
    assert _swift(sequence_parallel_size=2)["parallel"] == {"ulysses": 2}


def test_the_3x_name_of_the_tuner_and_full_training():
    assert _swift(train_type="full")["method"] == "full"
    assert _swift(tuner_type="full")["method"] == "full"


@pytest.mark.parametrize("fields, field", [
    ({"tuner_type": "adalora"}, "tuner_type"),
    ({"tuner_type": "full", "quant_method": "bnb", "quant_bits": 4}, "quant_bits"),
    ({"quant_method": "bnb", "quant_bits": 3}, "quant_bits"),
    ({"torch_dtype": "int8"}, "torch_dtype"),
    ({"bf16": True, "fp16": True}, "bf16"),
    ({"optim": "adamw_weird"}, "optim"),
    ({"attn_impl": "xformers"}, "attn_impl"),
    ({"task_type": "embedding"}, "task_type"),
    ({"per_device_train_batch_size": 0}, "per_device_train_batch_size"),
])
def test_bad_arguments_name_their_field(fields, field):
    with pytest.raises(ImportError_) as err:
        _swift(**fields)
    assert err.value.field == field


def test_rlhf_dpo_and_rm_are_imported_and_the_unmeasured_trainers_refused():
    cfg, command, env = parse_command("swift rlhf --rlhf_type dpo --model m --max_length 512 --loss_type ipo")
    assert from_swift(cfg, command=command, env=env)[0]["task"] == "ipo"
    cfg, command, env = parse_command("swift rlhf --model m --max_length 512 --tuner_type full")
    out = from_swift(cfg, command=command, env=env)[0]
    assert (out["task"], out["method"]) == ("dpo", "full")  # rlhf_type's default; a reference copy
    cfg, command, env = parse_command("swift rlhf --rlhf_type rm --model m --max_length 512")
    assert from_swift(cfg, command=command, env=env)[0]["task"] == "reward-model"
    for kind in ("kto", "grpo", "orpo", "gkd", "ppo"):
        cfg, command, env = parse_command(f"swift rlhf --rlhf_type {kind} --model m --max_length 512")
        with pytest.raises(ImportError_, match="was not measured") as err:
            from_swift(cfg, command=command, env=env)
        assert err.value.field == "rlhf_type"


def test_a_shell_script_with_continuations_and_a_config_file(tmp_path):
    (tmp_path / "base.yaml").write_text("model: Qwen/Qwen2.5-0.5B-Instruct\nmax_length: 1024\nlora_rank: 4\n")
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/bash\nexport NPROC_PER_NODE=2\n# the run\nswift sft base.yaml \\\n"
                      "    --lora_rank 16 \\\n    --target_modules q_proj v_proj  # two targets\n")
    overrides, lines = import_config_files(recipe=str(script))
    assert overrides["lora"]["r"] == 16  # the command line after the file wins
    assert overrides["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert overrides["num_gpus"] == 2 and overrides["seq_len"] == 1024
    assert any("ms-swift" in str(line) for line in lines)


def test_a_yaml_config_is_read_as_ms_swift(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("model: Qwen/Qwen2.5-0.5B-Instruct\ntuner_type: lora\nmax_length: 512\n")
    overrides, _ = import_config_files(recipe=str(path))
    assert overrides["stack"] == "ms-swift" and overrides["seq_len"] == 512


def test_cli_estimates_a_swift_script(tmp_path, capsys):
    script = tmp_path / "train.sh"
    script.write_text("CUDA_VISIBLE_DEVICES=0 swift sft --model qwen2.5-0.5b --max_length 1024 --torch_dtype bfloat16\n")
    assert main(["estimate", "--recipe", str(script), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec"]["stack"]["framework"] == "ms-swift" and out["spec"]["seq_len"] == 1024


def test_cli_refuses_a_script_without_a_swift_command(tmp_path, capsys):
    script = tmp_path / "train.sh"
    script.write_text("python train.py --lr 1e-4\n")
    assert main(["estimate", "--recipe", str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.sh" in err[0]


# ------------------------------------------------------------------ logits_to_keep

def _job(**over) -> dict:
    return {"model": "qwen2.5-0.5b", "stack": "ms-swift", "method": "lora", "micro_batch_size": 2,
            "seq_len": 1024, **over}


def test_kept_positions_follow_the_prompt_and_the_batch():
    many = kept_positions(vramplan.load_spec(_job(prompt_len=400)))
    assert (many.positions, many.gathered) == (625, False)  # 1024 - 400 + 1, a slice
    one = kept_positions(vramplan.load_spec(_job(prompt_len=400, micro_batch_size=1)))
    assert (one.positions, one.gathered) == (625, True)  # a boolean-mask gather
    assert kept_positions(vramplan.load_spec(_job())).positions == 1024  # labels from the second token
    assert kept_positions(vramplan.load_spec(_job(stack="hf-trainer"))) is None


def test_a_longer_prompt_shrinks_the_logits_under_ms_swift_only():
    short = vramplan.estimate(vramplan.load_spec(_job(prompt_len=10))).peak_allocated_bytes
    long = vramplan.estimate(vramplan.load_spec(_job(prompt_len=900))).peak_allocated_bytes
    assert long < short
    hf = [vramplan.estimate(vramplan.load_spec(_job(stack="hf-trainer", prompt_len=p))).peak_allocated_bytes
          for p in (10, 900)]
    assert hf[0] == hf[1]


@pytest.mark.parametrize("over, says", [
    ({"prompt_len": 1024}, "leaves no labelled token"),
    ({"prompt_len": 0}, "integer >= 1"),
    ({"prompt_len": 10, "task": "kto"}, "does not read it"),
    ({"prompt_len": 10, "task": "reward-model"}, "does not read it"),
    ({"prompt_len": 10, "packing": True}, "packed rows"),
])
def test_bad_prompt_len(over, says):
    with pytest.raises(SpecError) as err:
        vramplan.load_spec(_job(**over))
    assert err.value.field == "prompt_len" and says in str(err.value)


def test_all_linear_beside_names_is_every_linear_and_those():
    # ms-swift's get_target_modules puts every linear's name in all-linear's place
    # (swift/pipelines/train/tuner.py; examples/train/base_to_chat/lora2.sh: all-linear embed_tokens lm_head)
    def trainable(targets):
        spec = vramplan.load_spec({"model": "llama-3.1-8b", "method": "lora", "lora": {"r": 8, "target_modules": targets},
                                   "seq_len": 512})
        return vramplan.estimate(spec).trainable_params
    head = 8 * (4096 + 128256)  # lm_head's A (8 x 4096) and B (128256 x 8)
    assert trainable(["all-linear", "lm_head"]) == trainable("all-linear") + head


def test_example_scripts_of_ms_swift_shapes(tmp_path):
    # shapes from ms-swift's examples/train: a launcher running swift/cli/sft.py, shell
    # variables and $(expr ...) arithmetic, a multi-line quoted value, a non-training script
    script = tmp_path / "train.sh"
    script.write_text('nproc_per_node=4\nSYSTEM="You are\n a helper."\n'
                      "NNODES=2 torchrun --nproc_per_node=$nproc_per_node --nnodes=2 swift/cli/sft.py \\\n"
                      "  --model m --max_length 512 --system \"$SYSTEM\" \\\n"
                      "  --gradient_accumulation_steps $(expr 16 / $nproc_per_node)\n")
    overrides, _ = import_config_files(recipe=str(script))
    assert overrides["num_gpus"] == 8 and overrides["grad_accum_steps"] == 4
    infer = tmp_path / "infer.sh"
    infer.write_text("CUDA_VISIBLE_DEVICES=0 swift infer --model m\n")
    with pytest.raises(ImportError_, match="it runs swift infer, no training"):
        import_config_files(recipe=str(infer))
    mega = tmp_path / "mcore.sh"
    mega.write_text("megatron sft --model m\n")
    with pytest.raises(ImportError_, match="Megatron-SWIFT"):
        import_config_files(recipe=str(mega))

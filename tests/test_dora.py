"""DoRA and rsLoRA (PEFT `use_dora`, `use_rslora`): the spec switches, the trained magnitude
vectors against PEFT's own model, the importers, and the estimate against the real PEFT step
measured under the meter (bench/accuracy grid rows named `-dora` / `-rslora`)."""
from __future__ import annotations

import json
import pathlib

import pytest

import vramplan
from vramplan.components.trainable import param_set
from vramplan.importers.recipes import from_recipe
from vramplan.sources import resolve_model
from vramplan.spec import SpecError

ROOT = pathlib.Path(__file__).parents[1]
GRID = ROOT / "bench/accuracy/results-cpu.json"
_LLAMA = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 160,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
_GPT2 = {"model_type": "gpt2", "vocab_size": 1000, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}
_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _rows(word: str) -> list[dict]:
    rows = [r for r in json.loads(GRID.read_text())["cases"] if word in r["name"] and "failed" not in r]
    assert rows, f"no measured {word} case in {GRID}"
    return rows


@pytest.mark.parametrize("word", ["-dora", "-rslora"])
def test_estimate_within_2_percent_of_the_measured_peft_step(word):
    for row in _rows(word):
        measured = row["measured"]["peak_allocated_bytes"]
        got = vramplan.estimate(vramplan.load_spec(row["job"])).peak_allocated_bytes
        assert abs(got - measured) / measured < 0.02, (row["name"], got, measured)


def test_dora_measured_costs_more_than_lora_and_the_estimate_follows():
    # the same job measured with and without DoRA: base_result and the LoRA output are kept
    # per adapted linear, and the estimate moves with the measurement
    for row in _rows("-dora"):
        lora = {k: v for k, v in row["job"]["lora"].items() if k != "use_dora"}
        plain = vramplan.estimate(vramplan.load_spec({**row["job"], "lora": lora})).peak_allocated_bytes
        assert row["measured"]["peak_allocated_bytes"] > plain
        assert vramplan.estimate(vramplan.load_spec(row["job"])).peak_allocated_bytes > plain


def test_rslora_changes_no_byte():
    row = _rows("-rslora")[0]
    lora = {k: v for k, v in row["job"]["lora"].items() if k != "use_rslora"}
    assert (vramplan.estimate(vramplan.load_spec(row["job"])).peak_allocated_bytes
            == vramplan.estimate(vramplan.load_spec({**row["job"], "lora": lora})).peak_allocated_bytes)


def _peft_trainable(config: dict, dtype: str, targets) -> dict[str, tuple[int, str]]:
    """Suffix after the layer's module path -> (elements, dtype) of PEFT's trained tensors."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = dict(config)
    hf_config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, _DTYPES[dtype]))
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, use_dora=True))
    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            n = n.removeprefix("base_model.model.").replace(".default", "")
            out[n] = (p.numel(), str(p.dtype).removeprefix("torch."))
    return out


@pytest.mark.parametrize("config,dtype,targets", [(_LLAMA, "fp32", "all-linear"), (_LLAMA, "bf16", "all-linear"),
                                                  (_GPT2, "fp32", ["c_attn", "c_fc"])])
def test_magnitude_vectors_are_peft_s_own(config, dtype, targets):
    real = _peft_trainable(config, dtype, targets)
    spec = vramplan.load_spec({"model": config, "method": "lora", "precision": dtype, "seq_len": 64,
                               "lora": {"r": 4, "target_modules": targets, "use_dora": True}})
    vramplan.estimate(spec)
    mine = {p.name.replace(".lora_A", ".lora_A.weight").replace(".lora_B", ".lora_B.weight")
            .replace(".lora_magnitude_vector", ".lora_magnitude_vector.weight"): (p.numel, _DTYPES[p.dtype])
            for p in param_set(resolve_model(spec), spec).trainable()}
    assert any(".lora_magnitude_vector" in n for n in real)
    assert mine == real


def test_spec_round_trip_and_words():
    job = {"model": _LLAMA, "method": "lora", "seq_len": 64, "lora": {"use_dora": True, "use_rslora": True}}
    spec = vramplan.load_spec(job)
    assert spec.lora.use_dora and spec.lora.use_rslora
    assert vramplan.load_spec(spec.to_dict()).lora == spec.lora
    with pytest.raises(SpecError, match="^lora.use_dora: "):
        vramplan.load_spec({**job, "lora": {"use_dora": "false"}})
    with pytest.raises(SpecError, match="^lora.use_dora: .*awq"):
        vramplan.load_spec({"model": "llama-3.2-1b", "seq_len": 64, "method": "qlora",
                            "quantization": {"type": "awq"}, "lora": {"use_dora": True}})


def test_recipes_carry_the_switches():
    lf, _ = from_recipe({"model_name_or_path": "llama-3.2-1b", "finetuning_type": "lora", "use_dora": True,
                         "use_rslora": True, "cutoff_len": 512}, source="lf.yaml")
    assert lf["lora"]["use_dora"] is True and lf["lora"]["use_rslora"] is True
    ax, _ = from_recipe({"base_model": "llama-3.2-1b", "adapter": "lora", "peft_use_dora": True,
                         "sequence_len": 512}, source="axolotl.yaml")
    assert ax["lora"]["use_dora"] is True

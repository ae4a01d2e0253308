"""Quantized bases: each layout's bytes against the real library's layer, the spec's
validation, and a checkpoint's quantization_config read through the library's own config."""
from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import measure_fresh

import vramplan
from vramplan.components.quant import storage
from vramplan.spec import QuantConfig, SpecError

SHAPES = ((384, 512), (688, 256))


def _unique(tensors) -> int:
    from vramplan.measure.quantized import storage_bytes
    return storage_bytes(tensors)


def _bytes(quant: dict, m: int, n: int) -> int:
    return sum(storage(QuantConfig(**quant), m, n))


@pytest.mark.parametrize("m,n", SHAPES)
@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [True, False])
def test_bitsandbytes_4bit_bytes(m, n, kind, double_quant):
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes (test extra) is not installed")
    p = bnb.nn.Params4bit(torch.randn(m, n, dtype=torch.bfloat16), requires_grad=False,
                          compress_statistics=double_quant, quant_type=kind)._quantize("cpu")
    qs = p.quant_state
    state = [qs.absmax, qs.code] + ([qs.offset, qs.state2.absmax, qs.state2.code] if qs.nested else [])
    assert _unique([p.data] + state) == _bytes({"type": kind, "double_quant": double_quant}, m, n)


@pytest.mark.parametrize("m,n", SHAPES)
def test_bitsandbytes_int8_bytes(m, n):
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes (test extra) is not installed")
    p = bnb.nn.Int8Params(torch.randn(m, n, dtype=torch.float16), requires_grad=False, has_fp16_weights=False)
    p = p.to("cpu")
    assert _unique([p.data, p.SCB]) == _bytes({"type": "int8"}, m, n)


@pytest.mark.parametrize("m,n", SHAPES)
@pytest.mark.parametrize("kind", ["torchao-int8", "torchao-fp8"])
def test_torchao_weight_only_bytes(m, n, kind):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao", reason="torchao (test extra) is not installed")
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    lin = torch.nn.Sequential(torch.nn.Linear(n, m, bias=False)).to(torch.bfloat16)
    quantize_(lin, Int8WeightOnlyConfig() if kind == "torchao-int8" else Float8WeightOnlyConfig())
    assert _unique([lin[0].weight]) == _bytes({"type": kind}, m, n)


_GPTQMODEL = importlib.util.find_spec("gptqmodel") is not None
_NO_GPTQMODEL = ("gptqmodel is not installed: it asks for torch>=2.14.1, so it is not in the test extra; "
                 "`pip install --no-deps gptqmodel==7.7.0` plus its small imports (bench/quant/README.md)")


@pytest.mark.skipif(not _GPTQMODEL, reason=_NO_GPTQMODEL)
@pytest.mark.parametrize("m,n", SHAPES)
@pytest.mark.parametrize("bits,group,desc_act", [(4, 128, False), (4, 128, True), (4, -1, False), (8, 32, False),
                                                 (2, 64, False)])
def test_gptq_torch_linear_bytes(m, n, bits, group, desc_act):
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear

    ql = TorchLinear(bits=bits, group_size=group, sym=True, desc_act=desc_act, in_features=n, out_features=m,
                     bias=False, register_buffers=True)
    ql.post_init()
    quant = {"type": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act}
    assert _unique(ql.buffers()) == _bytes(quant, m, n)


@pytest.mark.skipif(not _GPTQMODEL, reason=_NO_GPTQMODEL)
@pytest.mark.parametrize("m,n", SHAPES)
def test_awq_bytes(m, n):
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear

    ql = AwqTorchLinear(bits=4, group_size=128, sym=False, desc_act=False, in_features=n, out_features=m,
                        bias=False, register_buffers=True)
    assert _unique(ql.buffers()) == _bytes({"type": "awq", "group_size": 128}, m, n)


@pytest.mark.skipif(not _GPTQMODEL, reason=_NO_GPTQMODEL)
@pytest.mark.parametrize("m,n", ((384, 512), (256, 768)))
def test_awq_torch_dequantization_peak(m, n):
    """AwqTorchLinear's per-call dequantization (packing_utils.py dequantize_gemm) under the
    meter: its peak above the packed buffers against components.quant.dequant_peak."""
    torch = pytest.importorskip("torch")
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear

    from vramplan.components.quant import dequant_peak
    from vramplan.measure.meter import MemoryMeter

    ql = AwqTorchLinear(bits=4, group_size=128, sym=False, desc_act=False, in_features=n, out_features=m,
                        bias=False, register_buffers=True)
    ql.post_init()
    x = torch.randn(1, n, dtype=torch.float16)
    with MemoryMeter() as meter:
        start = meter.current
        weight = ql._dequantize_weight_for_inference(x, dtype=torch.float16)
        buffers = _unique(ql.buffers())  # first seen (and counted) inside the call
        assert meter.current - start == buffers + weight.numel() * 2
        peak = meter.peak - start - buffers
    assert peak == dequant_peak(QuantConfig(type="awq", kernel="torch", compute_dtype="fp16"), m * n)


_HQQ = importlib.util.find_spec("hqq") is not None


@pytest.mark.skipif(not _HQQ, reason="hqq (the measure extra) is not installed")
@pytest.mark.parametrize("m,n", SHAPES)
@pytest.mark.parametrize("bits,group", [(8, 64), (4, 64), (3, 64), (2, 16), (1, 8)])
def test_hqq_linear_bytes(m, n, bits, group):
    torch = pytest.importorskip("torch")
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    q = HQQLinear(torch.nn.Linear(n, m, bias=False), BaseQuantizeConfig(nbits=bits, group_size=group, axis=1),
                  compute_dtype=torch.bfloat16, device="cpu", initialize=True)
    held = [q.W_q] + [v for v in q.meta.values() if isinstance(v, torch.Tensor)]
    assert _unique(held) == _bytes({"type": "hqq", "bits": bits, "group_size": group}, m, n)


def test_committed_storage_measurements_are_estimated_exactly():
    """bench/quant/results.json: each library's quantized linear, measured (GPTQModel and hqq
    included, which CI does not install), against today's storage model."""
    import json
    from pathlib import Path

    rows = json.loads((Path(__file__).resolve().parents[1] / "bench" / "quant" / "results.json").read_text())["storage"]
    assert {r["quantization"]["type"] for r in rows} >= {"nf4", "fp4", "int8", "gptq", "awq", "hqq", "torchao-int8"}
    for r in rows:
        assert _bytes(r["quantization"], r["out_features"], r["in_features"]) == r["measured_bytes"], r


# -- spec validation --------------------------------------------------------------------
_TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 2048}


@pytest.mark.parametrize("quant,field", [
    ({"type": "gptq", "bits": 5}, "quantization.bits"),
    ({"type": "awq", "bits": 8}, "quantization.bits"),
    ({"type": "nf4", "bits": 8}, "quantization.type"),
    ({"type": "int8", "group_size": 64}, "quantization.group_size"),
    ({"type": "gptq", "group_size": 0}, "quantization.group_size"),
    ({"type": "torchao-int4", "group_size": 100}, "quantization.group_size"),
    ({"type": "awq", "desc_act": True}, "quantization.desc_act"),
    ({"type": "gptq", "kernel": "gemm"}, "quantization.kernel"),
    ({"type": "gptq", "kernel": "marlin"}, "quantization.kernel"),
    ({"type": "torchao-int4"}, "quantization.type"),
    ({"type": "gptq", "modules_to_not_convert": 3}, "quantization.modules_to_not_convert"),
])
def test_bad_quantization_names_the_field(quant, field):
    with pytest.raises(SpecError) as err:
        vramplan.load_spec({"model": _TINY, "method": "qlora", "quantization": quant})
    assert err.value.field == field


def test_awq_on_cpu_needs_the_torch_kernel():
    job = {"model": _TINY, "method": "qlora", "backend": "cpu", "quantization": {"type": "awq"}}
    with pytest.raises(SpecError) as err:
        vramplan.load_spec(job)
    assert err.value.field == "quantization.kernel" and "kernel: torch" in str(err.value)
    spec = vramplan.load_spec({**job, "quantization": {"type": "awq", "kernel": "torch", "group_size": 16}})
    assert spec.quantization.kernel == "torch"


def test_group_size_must_divide_awq_in_features():
    spec = vramplan.load_spec({"model": _TINY, "method": "qlora", "quantization": {"type": "awq", "group_size": 32},
                               "seq_len": 64})
    with pytest.raises(SpecError) as err:
        vramplan.estimate(spec)
    assert err.value.field == "quantization.group_size"


def test_inference_takes_inference_only_kernels():
    spec = vramplan.load_spec({"model": _TINY, "task": "inference",
                               "quantization": {"type": "gptq", "kernel": "marlin"}})
    assert spec.quantization.kernel == "marlin"


def test_gptq_keeps_head_and_other_params_unquantized_and_unupcast():
    """GPTQ quantizes the decoder blocks' linears only; peft does not upcast a GPTQ model."""
    from vramplan.components.trainable import param_set
    from vramplan.sources import resolve_model

    spec = vramplan.load_spec({"model": _TINY, "method": "qlora", "precision": "fp16",
                               "quantization": {"type": "gptq", "modules_to_not_convert": ["down_proj"]}})
    held = {p.name: p.dtype for p in param_set(resolve_model(spec), spec).params if p.kind == "base"}
    assert held["lm_head.weight"] == held["model.norm.weight"] == "fp16"
    assert held["model.layers.0.mlp.down_proj.weight"] == "fp16"
    assert held["model.layers.0.mlp.up_proj.weight"] == "int4"


# -- a checkpoint's quantization_config ----------------------------------------------------
def _from_config(qc: dict):
    qc = json.loads(json.dumps(qc))  # as config.json stores it
    model = dict(_TINY, torch_dtype="float16", quantization_config=qc)
    return vramplan.estimate(vramplan.load_spec({"model": model, "method": "lora", "seq_len": 64})).spec


def test_bitsandbytes_config_as_transformers_writes_it():
    pytest.importorskip("transformers")
    import torch
    from transformers import BitsAndBytesConfig

    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False,
                            bnb_4bit_compute_dtype=torch.float16).to_dict()
    spec = _from_config(qc)
    assert spec.method.value == "qlora"
    q = spec.quantization
    assert (q.type.value, q.double_quant, q.compute_dtype) == ("fp4", False, "fp16")


def test_gptq_config_as_transformers_writes_it():
    pytest.importorskip("transformers")
    from transformers import GPTQConfig

    try:
        qc = GPTQConfig(bits=3, group_size=64, desc_act=True).to_dict()
    except (ImportError, ValueError) as exc:  # GPTQConfig.post_init asks for optimum / gptqmodel
        pytest.skip(f"GPTQConfig cannot be built here: {exc}")
    q = _from_config(qc).quantization
    # GPTQ computes in its input's dtype: the job's (bf16 here: plain stack, default precision),
    # not the fp16 the checkpoint was saved in (catalog/quant_config.py input_dtype_compute)
    assert (q.type.value, q.bits, q.group_size, q.desc_act, q.compute_dtype) == ("gptq", 3, 64, True, "bf16")


def test_unmodelled_quant_method_is_refused():
    with pytest.raises(SpecError) as err:
        _from_config({"quant_method": "fp8"})
    assert err.value.field == "model"


# -- a whole QLoRA step on a real quantized base, under the exact CPU meter ------------------
_STEP_MODEL = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 1,
               "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 128}


@pytest.mark.parametrize("quant,library", [({"type": "nf4"}, "bitsandbytes"),
                                           ({"type": "torchao-int8"}, "torchao"),
                                           ({"type": "hqq", "bits": 4, "group_size": 64}, "hqq")])
def test_qlora_step_peak_within_2_percent(quant, library):
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    pytest.importorskip(library, reason=f"{library} ({'measure' if library == 'hqq' else 'test'} extra) is not installed")
    _step_within_2_percent(quant, "bf16", "none")


@pytest.mark.skipif(not _GPTQMODEL, reason=_NO_GPTQMODEL)
def test_awq_checkpointed_step_holds_the_recomputed_dequantization():
    """Under checkpointing the layer's recomputed forward dequantizes every AwqTorchLinear again
    in backward: its int64 temporaries set the step's peak."""
    pytest.importorskip("peft")
    quant = {"type": "awq", "kernel": "torch", "group_size": 32, "compute_dtype": "fp16"}
    est = _step_within_2_percent(quant, "fp16", "full")
    assert est.components.total("quant/recomputed_dequantize") > 0


def _step_within_2_percent(quant: dict, precision: str, gc: str):
    job = {"model": _STEP_MODEL, "task": "sft", "method": "qlora", "quantization": quant, "precision": precision,
           "lora": {"r": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"]},
           "micro_batch_size": 1, "seq_len": 64, "backend": "cpu", "gradient_checkpointing": gc}
    measured = measure_fresh(job, device="cpu")["peak_allocated_bytes"]  # the layer tests leave tensors
    est = vramplan.estimate(vramplan.load_spec(job))
    assert abs(est.peak_allocated_bytes / measured - 1) < 0.02, (est.peak_allocated_bytes, measured)
    return est


def test_committed_step_measurements_are_estimated_within_2_percent():
    """bench/quant/results.json: each QLoRA step measured on a real quantized base (GPTQModel
    and hqq included, which CI does not install) against today's estimate of the same job."""
    from pathlib import Path

    rows = json.loads((Path(__file__).resolve().parents[1] / "bench" / "quant" / "results.json").read_text())["steps"]
    assert {r["job"]["quantization"]["type"] for r in rows} >= {"nf4", "int8", "gptq", "awq", "hqq", "torchao-int8"}
    for r in rows:
        estimated = vramplan.estimate(vramplan.load_spec(r["job"])).peak_allocated_bytes
        assert abs(estimated / r["measured_peak_bytes"] - 1) < 0.02, r["name"]


def test_moe_experts_quantize_only_as_transformers_4_linears():
    # transformers 5 keeps each MoE projection as one 3-D parameter, which no quantizer
    # replaces; 4.x built every expert as its own nn.Linear, which bitsandbytes quantizes.
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes (test extra) is not installed")
    cfg = {"model_type": "mixtral", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_local_experts": 4, "num_experts_per_tok": 2}
    job = {"model": cfg, "method": "qlora", "precision": "bf16", "micro_batch_size": 1, "seq_len": 16,
           "quantization": {"type": "nf4", "double_quant": True}}
    v5 = vramplan.estimate({**job, "stack": {"framework": "hf-trainer", "transformers": "5.24"}})
    v4 = vramplan.estimate({**job, "stack": {"framework": "hf-trainer", "transformers": "4.46"}})
    # the real library's bytes of each expert's w1, w3 (128 x 64) and w2 (64 x 128)
    one = {}
    for m, n in ((128, 64), (64, 128)):
        p = bnb.nn.Params4bit(torch.randn(m, n, dtype=torch.bfloat16), requires_grad=False,
                              compress_statistics=True, quant_type="nf4")._quantize("cpu")
        qs = p.quant_state
        one[(m, n)] = _unique([p.data, qs.absmax, qs.code, qs.offset, qs.state2.absmax, qs.state2.code])
    experts = 4 * (2 * one[(128, 64)] + one[(64, 128)])
    q = lambda e: e.components.total("weights/quantized") + e.components.total("weights/quant_state")  # noqa: E731
    assert q(v4) - q(v5) == experts
    # in 5.x the unquantized experts are upcast to fp32 by prepare_model_for_kbit_training
    assert v5.components.total("weights/frozen") - v4.components.total("weights/frozen") == 4 * 3 * 128 * 64 * 4


def test_input_dtype_kernels_compute_in_the_models_dtype():
    # GPTQModel's TorchLinear multiplies in its input's dtype (`weights.to(x.dtype)`), so a
    # GPTQ base under fp16 computes in fp16 whatever compute_dtype says; a mismatch would add
    # fp16 and bf16 in the residual stream, which torch promotes to fp32
    cfg = {"model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    job = {"model": cfg, "method": "qlora", "precision": "mixed-fp16", "micro_batch_size": 1, "seq_len": 64,
           "gradient_checkpointing": "full", "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}}
    said = vramplan.estimate({**job, "quantization": {"type": "gptq", "bits": 4, "compute_dtype": "bf16"}})
    fp16 = vramplan.estimate({**job, "quantization": {"type": "gptq", "bits": 4, "compute_dtype": "fp16"}})
    assert said.spec.quantization.compute_dtype == "fp16"
    assert said.peak_allocated_bytes == fp16.peak_allocated_bytes
    layer_input = [v for k, v in fp16.components.terms.items() if "checkpoint" in k]
    assert layer_input and sum(layer_input) == 2 * 64 * 128 * 2  # two layers' fp16 inputs
    # bitsandbytes keeps its own compute dtype (bnb_4bit_compute_dtype)
    nf4 = vramplan.estimate({**job, "quantization": {"type": "nf4", "compute_dtype": "bf16"}})
    assert nf4.spec.quantization.compute_dtype == "bf16"

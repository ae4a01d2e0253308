"""A checkpoint's Hugging Face `quantization_config` (config.json) read into the fields of
the spec's `quantization` section, and the job resolved against it.

Keys as transformers' quantizer configs serialize them (transformers/utils/quantization_config.py):
GPTQConfig (bits, group_size, desc_act, modules_to_not_convert), AwqConfig (bits, group_size,
version gemm/gemv; AutoAWQ's own w_bit, q_group_size), BitsAndBytesConfig (load_in_4bit,
load_in_8bit, bnb_4bit_quant_type, bnb_4bit_use_double_quant, bnb_4bit_compute_dtype,
llm_int8_skip_modules), HqqConfig (quant_config.weight_quant_params nbits, group_size) and
TorchAoConfig (quant_type: a config class name, or the older strings).
"""
from __future__ import annotations

from dataclasses import replace

from vramplan.spec import JobSpec, Method, QuantConfig, QuantType, SpecError, Task

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_TORCHAO = {"Int8WeightOnlyConfig": "torchao-int8", "int8_weight_only": "torchao-int8",
            "Int4WeightOnlyConfig": "torchao-int4", "int4_weight_only": "torchao-int4",
            "Float8WeightOnlyConfig": "torchao-fp8", "float8_weight_only": "torchao-fp8"}


def checkpoint_quantization(config: dict) -> tuple[tuple[str, object], ...]:
    """Sorted (field, value) items of the quantization section; () when unquantized. An
    unknown `quant_method` is kept as ("unsupported", name) for resolve() to refuse."""
    qc = config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        # transformers' AutoHfQuantizer.supports_quant_method calls `.get("quant_method")` on it
        raise ValueError(f"quantization_config must be a mapping with quant_method (as transformers saves it), "
                         f"got {qc!r}")
    if not isinstance(qc, dict):
        return ()
    method = qc.get("quant_method", "")
    method = str(getattr(method, "value", method)).lower()  # a QuantizationMethod enum in memory
    reader = _READERS.get(method)
    fields = reader(qc) if reader else {"unsupported": method or "?"}
    skip = qc.get("modules_to_not_convert") or qc.get("llm_int8_skip_modules")
    if isinstance(skip, list) and "unsupported" not in fields:
        fields["modules_to_not_convert"] = tuple(str(m) for m in skip if m != "lm_head")
    return tuple(sorted(fields.items()))


def _count(qc: dict, key: str, default) -> int:
    """An integer field of quantization_config (bits, group_size); a one-line ValueError else
    (group_size -1, GPTQ's "one group per row", is kept as written)."""
    value = qc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"quantization_config field {key!r} must be an integer, got {value!r}")
    return value


def _gptq(qc: dict) -> dict:
    return {"type": "gptq", "bits": _count(qc, "bits", 4), "group_size": _count(qc, "group_size", 128),
            "desc_act": bool(qc.get("desc_act", False))}


def _awq(qc: dict) -> dict:
    version = str(qc.get("version", "gemm")).lower()
    return {"type": "awq", "bits": _count(qc, "bits", qc.get("w_bit", 4)),
            "group_size": _count(qc, "group_size", qc.get("q_group_size", 128)),
            "kernel": version if version in ("gemm", "gemv") else "gemm"}


def _bnb(qc: dict) -> dict:
    if qc.get("load_in_8bit"):
        return {"type": "int8"}
    out = {"type": str(qc.get("bnb_4bit_quant_type", "nf4")),
           "double_quant": bool(qc.get("bnb_4bit_use_double_quant", False))}
    compute = _DTYPES.get(str(qc.get("bnb_4bit_compute_dtype", "")).replace("torch.", ""))
    return out | ({"compute_dtype": compute} if compute else {})


def _hqq(qc: dict) -> dict:
    outer = qc.get("quant_config") if isinstance(qc.get("quant_config"), dict) else {}
    inner = outer.get("weight_quant_params") if isinstance(outer.get("weight_quant_params"), dict) else qc
    return {"type": "hqq", "bits": _count(inner, "nbits", 4), "group_size": _count(inner, "group_size", 64)}


def _torchao(qc: dict) -> dict:
    qt = qc.get("quant_type")
    if isinstance(qt, dict):  # TorchAoConfig.to_dict: {"default": {"_type": name, "_data": {...}}}
        qt = qt.get("default", qt)
        name, data = qt.get("_type"), qt.get("_data") or {}
    else:
        name, data = qt, qc.get("quant_type_kwargs") or {}
    kind = _TORCHAO.get(str(name))
    if kind is None:
        return {"unsupported": f"torchao {name}"}
    group = data.get("group_size")
    return {"type": kind} | ({"group_size": _count(data, "group_size", group)} if kind == "torchao-int4" and group else {})


_READERS = {"gptq": _gptq, "awq": _awq, "bitsandbytes": _bnb, "hqq": _hqq, "torchao": _torchao}


# Kernels that compute in their input's dtype, the model's (GPTQModel TorchLinear:
# `torch.matmul(x, weights.to(x.dtype))`; AutoAWQ WQLinear; HQQLinear's compute_dtype, set to
# the model's dtype by transformers' HqqHfQuantizer; torchao's weight-only tensors dequantize
# to their original dtype): a compute dtype other than the precision's does not exist for them.
_INPUT_DTYPE_KERNELS = (QuantType.GPTQ, QuantType.AWQ, QuantType.HQQ, QuantType.TORCHAO_INT8,
                        QuantType.TORCHAO_INT4, QuantType.TORCHAO_FP8)


def input_dtype_compute(spec: JobSpec) -> JobSpec:
    """The spec with such a kernel's compute dtype set to the precision's compute dtype."""
    q = spec.quantization
    if q is None or q.type not in _INPUT_DTYPE_KERNELS or q.compute_dtype == spec.precision.compute_dtype:
        return spec
    return replace(spec, quantization=replace(q, compute_dtype=spec.precision.compute_dtype))


def resolve(spec: JobSpec, checkpoint: tuple[tuple[str, object], ...], dtype: str | None = None) -> JobSpec:
    """The spec on a quantized checkpoint: its quantization (unless the spec names another
    than the qlora default), LoRA on it trained as QLoRA; full or freeze refused. GPTQ, AWQ,
    HQQ and torchao compute in the dtype the model is loaded in (`dtype`)."""
    if not checkpoint:
        return spec
    fields = dict(checkpoint)
    if "unsupported" in fields:
        raise SpecError("model", f"the checkpoint is quantized with {fields['unsupported']}, which vramplan "
                        "does not model (gptq, awq, bitsandbytes, hqq, torchao)")
    if spec.method in (Method.FULL, Method.FREEZE) and spec.task is not Task.INFERENCE:
        raise SpecError("method", f"the checkpoint's weights are {fields['type']}-quantized and cannot be "
                        f"trained with {spec.method.value}; use method qlora (LoRA on the quantized base)")
    if spec.quantization is not None and spec.quantization != QuantConfig():
        return spec  # the spec says how (e.g. another kernel): it wins
    if dtype and "compute_dtype" not in fields and fields["type"] not in ("nf4", "fp4", "int8"):
        fields["compute_dtype"] = dtype
    quant = QuantConfig(**fields)
    method = Method.QLORA if spec.method is Method.LORA else spec.method
    return replace(spec, quantization=quant, method=method)

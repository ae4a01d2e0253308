"""A quantized base the way users load one: the random model saved, then loaded back
through transformers with the library's quantization config, then PEFT's
``prepare_model_for_kbit_training`` and LoRA.

bitsandbytes (>= 0.49 runs Linear4bit and Linear8bitLt on CPU) goes through
``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))``
(transformers/quantizers/quantizer_bnb_4bit.py); torchao int8/fp8 weight-only through
``torchao.quantization.quantize_`` with its filter of ``nn.Linear`` modules but the
output head (what transformers' TorchAoHfQuantizer converts); hqq through its own
``AutoHQQHFModel.quantize_model`` (transformers 5.24 cannot load an HqqConfig:
quantizers/base.py get_quantize_ops "QuantizationMethod.HQQ is not available yet").
"""
from __future__ import annotations

import tempfile

import torch

from .build import DTYPES


def quantize_base(model: torch.nn.Module, job: dict, device: str) -> torch.nn.Module:
    """The job's quantized base (before LoRA); raises ValueError for a type not runnable here."""
    q = job.get("quantization") or {}
    qtype = q.get("type", "nf4")
    if qtype in ("nf4", "fp4", "int8"):
        return _bitsandbytes(model, q, device)
    if qtype in ("torchao-int8", "torchao-fp8"):
        return _torchao(model, qtype)
    if qtype == "gptq" and q.get("kernel", "torch") == "torch":
        return _gptq(model, q)
    if qtype == "awq" and q.get("kernel") == "torch":
        return _awq(model, q)
    if qtype == "hqq":
        return _hqq(model, q)
    raise ValueError(f"quantization.type: measuring {qtype} is not implemented (measured: nf4, fp4, int8, "
                     "torchao-int8, torchao-fp8, gptq and awq with the torch kernel, hqq)")


def _bitsandbytes(model, q: dict, device: str):
    from transformers import BitsAndBytesConfig

    compute = DTYPES[q.get("compute_dtype", "bf16")]
    if q.get("type") == "int8":
        cfg = BitsAndBytesConfig(load_in_8bit=True)
    else:
        cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.get("type", "nf4"),
                                 bnb_4bit_use_double_quant=bool(q.get("double_quant", True)),
                                 bnb_4bit_compute_dtype=compute)
    dtype, cls = next(model.parameters()).dtype, type(model)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        del model
        # the model's own class (a causal LM, or the classifier of a reward model)
        loaded = cls.from_pretrained(folder, quantization_config=cfg, dtype=dtype, device_map=device)
    loaded.config.use_cache = False
    return loaded


def _torchao(model, qtype: str):
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    head = model.get_output_embeddings()
    config = Int8WeightOnlyConfig() if qtype == "torchao-int8" else Float8WeightOnlyConfig()
    quantize_(model, config, filter_fn=lambda m, _: isinstance(m, torch.nn.Linear) and m is not head)
    model.quantization_method = "torchao"  # what peft's prepare_model_for_kbit_training reads
    return model


def _gptq(model, q: dict):
    """GPTQModel 7.7 TorchLinear (symmetric, GPTQ's layout)."""
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear

    return _gptqmodel(model, q, "gptq", TorchLinear, sym=True)


def _awq(model, q: dict):
    """GPTQModel 7.7 AwqTorchLinear (qlinear/torch_awq.py: the AutoAWQ GEMM layout, asymmetric
    with a zero point, dequantized by `dequantize_gemm` then `torch.matmul` in torch), what
    GPTQModel's AWQ_TORCH backend builds for an AWQ GEMM checkpoint."""
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear

    return _gptqmodel(model, q, "awq", AwqTorchLinear, sym=False)


def _gptqmodel(model, q: dict, method: str, cls, sym: bool):
    """`cls` in place of every decoder-layer linear, as GPTQModel's `make_quant` builds them
    when loading a checkpoint (lm_head and embeddings stay), with random codes and scales
    (memory does not depend on the values). What peft's prepare_model_for_kbit_training and
    its dispatchers read is set as a loaded model has it: transformers/quantizers/base.py
    sets `quantization_method` to the config's quant_method (for "awq" PEFT casts the other
    parameters to fp32, for "gptq" it does not)."""
    head = model.get_output_embeddings()
    g = torch.Generator().manual_seed(0)
    bits, group = int(q.get("bits", 4)), int(q.get("group_size", 128))
    names = [name for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and m is not head and ".layers." in name]
    for name in names:
        lin = model.get_submodule(name)
        ql = cls(bits=bits, group_size=group, sym=sym, desc_act=bool(q.get("desc_act", False)),
                 in_features=lin.in_features, out_features=lin.out_features, bias=lin.bias is not None,
                 register_buffers=True)
        ql.qweight.copy_(torch.randint(-2**31, 2**31 - 1, ql.qweight.shape, generator=g, dtype=torch.int64))
        ql.qzeros.copy_(torch.randint(-2**31, 2**31 - 1, ql.qzeros.shape, generator=g, dtype=torch.int64))
        ql.scales.copy_(torch.rand(ql.scales.shape, generator=g) * 1e-2)
        ql.post_init()
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, ql)
        del lin  # the float weight goes, as it never exists when loading a checkpoint
    model.quantization_method = method
    model.config.quantization_config = {"quant_method": method, "bits": bits, "group_size": group,
                                        "desc_act": bool(q.get("desc_act", False))}
    return model


def _hqq(model, q: dict):
    """hqq 0.2.8 `AutoHQQHFModel.quantize_model` (hqq/models/base.py): every decoder linear
    (the linear tags: lm_head stays) becomes an HQQLinear with hqq's BaseQuantizeConfig (axis
    1, transformers' HqqConfig default), on the default backend HQQBackend.PYTORCH
    (`forward_pytorch_backprop`, the one with a backward; ATEN needs CUDA); it sets
    `hqq_quantized`, which peft's prepare_model_for_kbit_training reads (no fp32 upcast)."""
    from hqq.core.quantize import BaseQuantizeConfig, HQQBackend, HQQLinear
    from hqq.models.hf.base import AutoHQQHFModel

    HQQLinear.set_backend(HQQBackend.PYTORCH)
    compute = DTYPES[q.get("compute_dtype", "bf16")]
    config = BaseQuantizeConfig(nbits=int(q.get("bits", 4)), group_size=int(q.get("group_size", 64)), axis=1)
    AutoHQQHFModel.quantize_model(model, quant_config=config, compute_dtype=compute, device="cpu")
    return model


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    """peft/utils/other.py prepare_model_for_kbit_training, gradient checkpointing left to the
    job (apply_checkpointing), as Trainer users call it."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def storage_bytes(tensors) -> int:
    """Bytes of the unique storages behind `tensors`, a wrapper subclass (torchao's quantized
    tensors) counted by its inner tensors (`__tensor_flatten__`), as the meter counts them."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    seen: dict[int, int] = {}

    def add(t):
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                add(getattr(t, name))
        elif isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for t in tensors:
        add(t)
    return sum(seen.values())

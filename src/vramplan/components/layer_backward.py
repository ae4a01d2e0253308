"""What a decoder layer's backward holds beside the saved activations: the gradients alive at
its peak, and a quantized kernel's dequantized weight.

Legend: T tokens, h hidden, f MLP width (top_k expert widths for MoE), c compute dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.dtypes import dtypes_of
from vramplan.components.quant import TRANSIENT, dequant_copies, dequant_modes, dequant_numel, kernel_saves_input
from vramplan.components.trainable import is_quantized, param_set
from vramplan.model import MlpKind, ModelDesc, ParamEntry
from vramplan.spec import JobSpec
from vramplan.units import nbytes


def _linear_numel(p: ParamEntry) -> int:
    """Elements of one linear's weight; a fused expert tensor (E, m, n) stands for E linears of
    (m, n), a fused gate_up_proj for two per expert (components/weights.py)."""
    if len(p.shape) == 3:
        return p.shape[1] * p.shape[2] // (2 if p.name.endswith("gate_up_proj") else 1)
    return p.shape[0] * p.shape[-1]


# The tanh GELU written in Python ops (transformers/activations.py NewGELUActivation:
# `0.5 * input * (1.0 + torch.tanh(...))`; components/arch.py gelu_new)
PYTHON_GELUS = ("gelu_new", "gelu_pytorch_tanh_python")


def mlp_grad_tensors(desc: ModelDesc) -> int:
    """How many tensors `backward/grad_mlp` is: the gradients of gate, up and act * up
    (gated), or of fc1's output and the activation (plain). A Python-op GELU's first backward
    node is the last product's MulBackward0: it makes the gradients of `0.5 * input` and of
    `1 + tanh(...)` while the activation's output gradient is still its input (seen with the
    exact CPU meter: a GPT-2 reward model's peak holds the (T, f) mm output and two
    MulBackward0 outputs)."""
    if desc.mlp is MlpKind.GATED or desc.hidden_act in PYTHON_GELUS:
        return 3
    return 2


def layer_backward(desc: ModelDesc, spec: JobSpec) -> Breakdown:
    """Gradients of activations alive at a layer's backward peak (the MLP's backward, seen with
    the exact CPU meter at act * up's MulBackward): the incoming hidden-state gradient, the
    gradient of the down-projection input and those of both gate and up outputs (gated) or
    of fc1's output (plain), in the compute dtype."""
    tokens = spec.micro_batch_size * spec.seq_len
    c = dtypes_of(spec).compute if spec.method.value != "qlora" else spec.quantization.compute_dtype
    res = dtypes_of(spec).weights if spec.method.value != "qlora" else c
    width = desc.moe.expert_intermediate_size * desc.moe.top_k if desc.moe else desc.intermediate_size
    n_mlp = mlp_grad_tensors(desc)
    if desc.moe is not None and not desc.model_type.startswith("llama4") and spec.method.value != "qlora":
        # the experts' grouped matmuls run outside autocast in the weights' dtype (moe.py
        # without_autocast; Llama-4's experts are bmm, which autocast casts)
        c = dtypes_of(spec).weights
    out = (Breakdown().add("backward/grad_hidden", nbytes(tokens * desc.hidden_size, res))
           .add("backward/grad_mlp", n_mlp * nbytes(tokens * width, c)))
    q = spec.quantization
    if q is not None and spec.method.value == "qlora" and dequant_modes(q)[1] == TRANSIENT:
        # A kernel that dequantizes in backward (bitsandbytes MatMul4Bit.backward:
        # `torch.matmul(grad_output, F.dequantize_4bit(B, ctx.state).to(grad_output.dtype))`)
        # holds one full weight in the compute dtype (and, double-quantized, its fp32 absmax)
        # during each linear's backward. The first of the layer, the MLP output projection,
        # then holds it with its input gradient (T x f) where the moment modelled above holds
        # n_mlp such gradients; the weight lifts the layer's peak only by what it exceeds
        # them by (the layer's largest weight stands for the projection's).
        largest = max((_linear_numel(p) for p in desc.params if p.layer == 0 and is_quantized(spec, p)), default=0)
        dq = dequant_copies(q) * nbytes(dequant_numel(q, largest), c)
        if q.type.value in ("nf4", "fp4") and q.double_quant:
            dq += 4 * -(-largest // q.block_size)
        extra = dq + nbytes(tokens * width, c) - n_mlp * nbytes(tokens * width, c)
        if kernel_saves_input(q) and desc.moe is None:
            extra += _kept_input_at_out_projection(desc, spec, tokens * width, c)
        if extra > 0:
            out.add("backward/dequantized_weight", extra)
    return out


def _kept_input_at_out_projection(desc: ModelDesc, spec: JobSpec, numel: int, c: str) -> int:
    """A kernel that saves its input (hqq HQQMatmulNoCacheMul) still holds the MLP output
    projection's input (act * up, freed at the modelled moment) while it dequantizes in
    backward; the LoRA branch of that projection, created after the base call (a higher
    sequence number, run first by the autograd engine), has by then freed the copy of the
    input cast to the adapters' dtype (peft/tuners/lora/hqq.py `_cast_input_dtype`)."""
    params = param_set(desc, spec).params
    out_proj = next((p for p in desc.params if p.layer == 0 and is_quantized(spec, p) and len(p.shape) == 2
                     and p.shape[-1] == desc.intermediate_size), None)
    lora_a = next((p for p in params if out_proj is not None and p.name == out_proj.module + ".lora_A"), None)
    cast = nbytes(numel, lora_a.dtype) if lora_a is not None and lora_a.dtype != c else 0
    return nbytes(numel, c) - cast

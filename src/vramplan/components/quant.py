"""Quantized base weights: what each library stores per linear layer, and what its kernel
dequantizes in forward and backward.

Legend: n in_features, m out_features (an nn.Linear weight is (m, n)), g group size,
b bits, N = m * n. Each layout below is the set of tensors the library's module holds,
checked byte for byte against the real classes on CPU (bench/quant, tests/test_quant.py).
"""
from __future__ import annotations

from vramplan.spec import QuantConfig, QuantType
from vramplan.units import nbytes

QUANT_DTYPES = frozenset({"nf4", "fp4", "int8", "int1", "int2", "int3", "int4", "fp8"})
"""HeldParam dtypes of quantized weights (the code width; components/trainable.py)."""
BNB_4BIT = frozenset({"nf4", "fp4"})
"""bitsandbytes Linear4bit weights, whose forward returns its input's dtype."""


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def code_dtype(q: QuantConfig) -> str:
    """The dtype a quantized weight is listed with: its code width."""
    t = q.type
    if t in (QuantType.NF4, QuantType.FP4, QuantType.INT8):
        return t.value
    if t is QuantType.TORCHAO_FP8:
        return "fp8"
    return f"int{q.bits}"


def storage(q: QuantConfig, m: int, n: int) -> tuple[int, int]:
    """(codes, state) bytes one quantized (m, n) linear weight holds."""
    return _LAYOUTS[q.type](q, m, n)


def _bnb_4bit(q: QuantConfig, m: int, n: int) -> tuple[int, int]:
    # bitsandbytes/functional.py quantize_4bit: packed uint8 ((N + 1) // 2, 1), one fp32
    # absmax per blocksize elements and its own 16-entry fp32 code (get_4bit_type). Double
    # quantization (compress_statistics) turns the absmax into uint8 codes of a nested
    # blockwise quantization (blocksize 256): fp32 state2.absmax per 256 blocks, a 256-entry
    # fp32 dynamic code and a 0-d fp32 offset, all per layer.
    numel = m * n
    blocks = _ceil(numel, q.block_size)
    state = 16 * 4
    if q.double_quant:
        state += blocks + 4 * _ceil(blocks, 256) + 256 * 4 + 4
    else:
        state += 4 * blocks
    return _ceil(numel, 2), state


def _bnb_int8(q: QuantConfig, m: int, n: int) -> tuple[int, int]:
    # bitsandbytes Int8Params (LLM.int8, Dettmers et al. 2022): CB int8 (m, n) and SCB,
    # one fp32 absmax per output row (functional.py int8_vectorwise_quant).
    return m * n, 4 * m


def _groups(q: QuantConfig, n: int) -> int:
    return 1 if q.group_size == -1 else _ceil(n, q.group_size)


def _gptq(q: QuantConfig, m: int, n: int) -> tuple[int, int]:
    # GPTQModel nn_modules/qlinear/__init__.py `_register_gptq_buffers` (AutoGPTQ's QuantLinear
    # the same): qweight int32 (ceil(n*b/32), m), qzeros int32 (groups, ceil(m*b/32)), scales
    # fp16 (groups, m), g_idx int32 (n,). TorchLinear.post_init adds the shift table, 32/b
    # int32 (3 x 12 for 3 bits), as two views (wf_unsqueeze_zero / wf_unsqueeze_neg_one).
    b, groups = q.bits, _groups(q, n)
    codes = 4 * _ceil(n * b, 32) * m
    state = 4 * groups * _ceil(m * b, 32) + 2 * groups * m + 4 * n
    if q.kernel == "torch":
        state += 4 * (36 if b == 3 else 32 // b)
    return codes, state


def _awq(q: QuantConfig, m: int, n: int) -> tuple[int, int]:
    # AutoAWQ WQLinear_GEMM (GPTQModel gemm_awq.py AwqGEMMLinear): qweight int32
    # (n, m*b/32), qzeros int32 (groups, m*b/32), scales fp16 (groups, m).
    b, groups = q.bits, _groups(q, n)
    return 4 * n * _ceil(m * b, 32), 4 * groups * _ceil(m * b, 32) + 2 * groups * m


def _hqq(q: QuantConfig, m: int, n: int) -> tuple[int, int]:
    # hqq 0.2.7 / 0.2.8.post1 hqq/core/quantize.py Quantizer.quantize (axis 1: the weight as (numel/g, g)
    # rows) then Quantizer.pack: 8/4/2/1 bits pack 1/2/4/8 codes per uint8; 3 bits pack 10
    # rows into one int32 row (pack_3bit_32, rows padded to a multiple of 10). meta: scale
    # and zero, one each per group, in the compute dtype (16-bit) when not quantized.
    numel, b, g = m * n, q.bits, q.group_size
    codes = 4 * g * _ceil(_ceil(numel, g), 10) if b == 3 else _ceil(numel * b, 8)
    return codes, 2 * 2 * _ceil(numel, g)


def _torchao_int8(q: QuantConfig, m: int, n: int) -> tuple[int, int]:
    # torchao 0.18 Int8WeightOnlyConfig -> Int8Tensor: qdata int8 (m, n), scale fp32 (m, 1),
    # zero_point int8 (m, 1).
    return m * n, 5 * m


def _torchao_fp8(q: QuantConfig, m: int, n: int) -> tuple[int, int]:
    # torchao 0.18 Float8WeightOnlyConfig -> Float8Tensor: qdata float8_e4m3fn (m, n), scale
    # fp32 (m, 1).
    return m * n, 4 * m


def _torchao_int4(q: QuantConfig, m: int, n: int) -> tuple[int, int]:
    # torchao 0.18 Int4WeightOnlyConfig(int4_packing_format="tile_packed_to_4d"), tinygemm:
    # int4_tile_packed_to_4d_tensor.py pads in_features to a multiple of 1024 and
    # out_features to one of 8, packs two codes per byte (aten._convert_weight_to_int4pack,
    # int32 [m/8][n/(8*16)][32][4]) and keeps scale and zero together in bf16
    # (n/g, m, 2) (utils.py pack_tinygemm_scales_and_zeros). Needs CUDA; not measured on CPU.
    # (The CPU format, prototype Int4OpaqueTensor, packs (m, n/2) uint8 without padding, but
    # its `_weight_int4pack_mm_for_cpu` has no derivative, so no LoRA step runs on it: vramplan
    # keeps torchao-int4 on cuda, bench/quant/README.md.)
    n_pad, m_pad = _ceil(n, 1024) * 1024, _ceil(m, 8) * 8
    return n_pad * m_pad // 2, 2 * 2 * m_pad * (n_pad // q.group_size)


def torchao_nf4(numel: int, wdtype: str) -> tuple[int, int]:
    """torchao NF4Tensor (torchao/dtypes/nf4tensor.py NF4Tensor.from_tensor and
    double_quantize_scalers; block 64, scaler block 256), as torchtune's QLoRA builders make it:
    two 4-bit codes per byte, int8 scalers per block, and in the weight's dtype one
    quantization factor per 256 scalers, the scalers' mean and the 16-entry NF4 table."""
    blocks = -(-numel // 64)
    return -(-numel // 2), blocks + nbytes(-(-blocks // 256) + 1 + 16, wdtype)


_LAYOUTS = {QuantType.NF4: _bnb_4bit, QuantType.FP4: _bnb_4bit, QuantType.INT8: _bnb_int8,
            QuantType.GPTQ: _gptq, QuantType.AWQ: _awq, QuantType.HQQ: _hqq,
            QuantType.TORCHAO_INT8: _torchao_int8, QuantType.TORCHAO_FP8: _torchao_fp8,
            QuantType.TORCHAO_INT4: _torchao_int4}


# -- dequantization in forward and backward ----------------------------------------------
SAVED, TRANSIENT, NONE = "saved", "transient", "none"


def dequant_modes(q: QuantConfig) -> tuple[str, str]:
    """(forward, backward): whether a kernel makes a full (m, n) weight in the compute dtype
    and whether autograd keeps it for backward (SAVED), frees it after the call (TRANSIENT),
    or never makes it (NONE, fused kernels)."""
    return _MODES[(q.type, q.kernel)]


_MODES = {
    # bitsandbytes autograd/_functions.py MatMul4Bit: forward gemm_4bit (on CPU and, above
    # the M thresholds of backends/cuda/ops.py `_gemm_4bit_use_custom_cuda`, on CUDA:
    # dequantize_4bit then F.linear); backward `torch.matmul(grad_output,
    # F.dequantize_4bit(B, ctx.state).to(grad_output.dtype))`. ctx keeps only the packed B.
    (QuantType.NF4, "bitsandbytes"): (TRANSIENT, TRANSIENT),
    (QuantType.FP4, "bitsandbytes"): (TRANSIENT, TRANSIENT),
    # MatMul8bitLt (CUDA) / MatMul8bitFp (CPU): backward dequantizes CB * SCB to the input dtype.
    (QuantType.INT8, "bitsandbytes"): (TRANSIENT, TRANSIENT),
    # GPTQModel qlinear/torch.py TorchLinear._forward_eager: `weights = self.dequantize_weight()`
    # then `torch.matmul(x, weights)` outside any autograd.Function, so MmBackward saves the
    # dequantized weight when x needs a gradient (TritonV2 falls back to it in training, and
    # AutoGPTQ's qlinear_cuda_old takes the same path for inputs of 128 rows or more).
    (QuantType.GPTQ, "torch"): (SAVED, NONE),
    # AutoGPTQ / GPTQModel triton_utils/kernels.py QuantLinearFunction: quant_matmul_248 and
    # transpose_quant_matmul_248, saving the packed buffers only.
    (QuantType.GPTQ, "triton"): (NONE, NONE),
    # GPTQModel gemm_awq.py AwqGemmFn: above 1024 rows awq_dequantize_weights + matmul inside
    # the Function (not saved); backward dequantizes again.
    (QuantType.AWQ, "gemm"): (TRANSIENT, TRANSIENT),
    # GPTQModel 7.7 qlinear/torch_awq.py AwqTorchLinear.forward: `weight =
    # self._dequantize_weight_for_inference(...)` (packing_utils.py dequantize_gemm) then
    # `torch.matmul(x_flat, weight)` outside any autograd.Function, so MmBackward keeps the
    # dequantized (n, m) weight for the input gradient, as GPTQ's TorchLinear does.
    (QuantType.AWQ, "torch"): (SAVED, NONE),
    # hqq/core/quantize.py HQQLinear.forward_pytorch_backprop -> HQQMatmulNoCacheMul: dequantize
    # in forward and again in backward, no weight saved (its input is: kernel_saves_input).
    (QuantType.HQQ, "hqq"): (TRANSIENT, TRANSIENT),
    # torchao 0.18 weight-only tensors implement F.linear at the torch-function level, so
    # autograd sees their inside: Int8Tensor (int8_tensor.py) `torch.mm(x, qdata.t().to(x.dtype))`
    # and Float8Tensor (float8_tensor.py) `torch.matmul(x, weight.dequantize())` keep the
    # full-width weight for backward.
    (QuantType.TORCHAO_INT8, "torchao"): (SAVED, NONE),
    (QuantType.TORCHAO_FP8, "torchao"): (SAVED, NONE),
    # Int4 (tinygemm `_weight_int4pack_mm`) serves inference only (PEFT refuses Int4Tensor; the
    # CPU Int4OpaqueTensor's `_weight_int4pack_mm_for_cpu` has no derivative in torch 2.13).
    (QuantType.TORCHAO_INT4, "torchao"): (NONE, NONE),
    # Inference-only kernels: fused, no full weight.
    (QuantType.GPTQ, "exllama"): (NONE, NONE),
    (QuantType.GPTQ, "exllamav2"): (NONE, NONE),
    (QuantType.GPTQ, "marlin"): (NONE, NONE),
    (QuantType.AWQ, "gemv"): (NONE, NONE),
    (QuantType.AWQ, "marlin"): (NONE, NONE),
}


def dequant_peak(q: QuantConfig, numel: int) -> int:
    """Bytes alive at the peak of one per-call dequantization of a weight of `numel` elements,
    the dequantized weight included; 0 where not modelled (fused kernels make none; GPTQ's
    TorchLinear, bitsandbytes and hqq count only their dequantized weight, in dequant_modes).
    GPTQModel 7.7 packing_utils.py dequantize_gemm (AwqTorchLinear), 4 bits: `_unpack_columnwise`
    shifts the int32 qweight by `torch.arange(0, 32, bits)` (int64), so every unpacked code is
    int64; at `iweight = (iweight - izeros) * scales` alive are the masked codes (int64), the
    zeros and scales `repeat_interleave`d to (n, m) (int64 and the compute dtype), their
    difference (int64) and the product (the weight, compute dtype): 3 x 8 + 2 x c bytes per
    element (the earlier steps hold two int64 copies at most)."""
    if q.type is QuantType.AWQ and q.kernel == "torch":
        return 3 * nbytes(numel, "int64") + 2 * nbytes(numel, q.compute_dtype)
    return 0


def kernel_saves_input(q: QuantConfig | None) -> bool:
    """Whether the kernel's autograd.Function keeps the layer's input for backward although
    the frozen weight's backward never reads it: hqq 0.2.8 HQQMatmulNoCacheMul.setup_context
    `ctx.save_for_backward(x, bias)` (HQQMatmulNoCacheDeq the same), while its backward
    computes only `ctx.matmul(grad_output, transpose=False)`. bitsandbytes MatMul4Bit keeps
    `(None, B)`, GPTQ's and torchao's matmuls save the input only for a weight gradient."""
    return q is not None and q.type is QuantType.HQQ


def dequant_copies(q: QuantConfig) -> int:
    """Full-width compute-dtype tensors alive at the peak of one dequantization: hqq
    Quantizer.dequantize `((W_r - meta["zero"]) * meta["scale"])` holds the unpacked codes
    W_r (bitpack.py unpack_*: `torch.empty([k * _step, ...], dtype=compute_dtype)`), the
    difference and the product (hqq's default HQQBackend.PYTORCH; the optional CUDA ATEN
    backend's fused `hqq_aten.dequantize` makes one); bitsandbytes dequantize_4bit writes its
    output directly."""
    return 3 if q.type is QuantType.HQQ else 1


def dequant_numel(q: QuantConfig, numel: int) -> int:
    """Elements of the unpacked codes of a weight of `numel` elements: hqq's 3-bit layout
    unpacks its rows padded to a multiple of 10 (bitpack.py unpack_3bit_32, then sliced)."""
    if q.type is QuantType.HQQ and q.bits == 3:
        return q.group_size * 10 * _ceil(_ceil(numel, q.group_size), 10)
    return numel

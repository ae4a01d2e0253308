"""Block-quantized optimizer states: torchao.optim AdamW8bit / AdamW4bit.

torchao/optim/adam.py `_AdamBase._new_buffer`: a parameter with at least 4096 elements and
a multiple of `block_size` gets quantized states (subclass_8bit.py / subclass_4bit.py
`zeros`: `codes` uint8, n bytes for 8-bit or n/2 for 4-bit packed two to a byte; `scale`
fp32, one per block; `qmap`, the fp32 code table, one per state tensor: 256 entries for
8-bit, 16 for 4-bit); any other parameter gets plain `zeros_like(p)` states. Each
parameter also holds `state["step"]`, a 0-d fp32 tensor, and each group its lr as a 0-d
fp32 tensor (`add_param_group`).
"""
from __future__ import annotations

from vramplan.components.trainable import HeldParam
from vramplan.spec import Optimizer
from vramplan.units import nbytes

_MIN_QUANTIZED = 4096
# (block_size default, code bits) per optimizer (torchao/optim/adam.py AdamW8bit/AdamW4bit)
_LAYOUT = {Optimizer.TORCHAO_ADAMW_8BIT: (256, 8), Optimizer.TORCHAO_ADAMW_4BIT: (128, 4)}


def is_quantized(opt: Optimizer, p: HeldParam) -> bool:
    block, _ = _LAYOUT[opt]
    return p.numel >= _MIN_QUANTIZED and p.numel % block == 0


def torchao_state(opt: Optimizer, p: HeldParam, dtype: str) -> dict[str, int]:
    n = p.numel
    if not is_quantized(opt, p):
        return {"exp_avg": nbytes(n, dtype), "exp_avg_sq": nbytes(n, dtype), "step": 4}
    block, bits = _LAYOUT[opt]
    one = n * bits // 8 + 4 * (n // block) + 4 * 2**bits
    return {"exp_avg": one, "exp_avg_sq": one, "step": 4}


# Bytes per element alive inside the state's `copy_` when it quantizes an fp32 moment
# (subclass_8bit.py / subclass_4bit.py `aten.copy_`: `scale_tensor`, then
# quant_utils.py `quantize_8bit_with_qmap` / `quantize_4bit_with_qmap`): at the rounding
# `torch.where(residual >= (val_up - val_down) * 0.5, codes_up, codes)` the scaled input
# (fp32), `codes` and `codes_up` (int64: `torch.where(..., 128, 0)` makes int64), val_down,
# val_up and residual (fp32), the comparison (bool) and the where's int64 output:
# 4 + 8 + 8 + 4 + 4 + 4 + 1 + 8. The H100 trace of AdamW8bit (bench/allocator/traces)
# holds exactly these blocks at its optimizer peak.
_REQUANTIZE = 41


def torchao_step_temporary(opt: Optimizer, p: HeldParam, dtype: str) -> int:
    """torchao/optim/adam.py `single_param_adam`, one parameter at a time, run eagerly (the
    measured path; torch.compile fuses it where it runs). The larger of two moments:
    - at `p_f32 - lr * (exp_avg_f32 / bias_correction1) / denom` the decayed fp32 parameter
      (`p_f32 - lr * weight_decay * p_f32`), exp_avg_f32 and exp_avg_sq_f32 (the `lerp`s of
      the dequantized moments), `denom`, the quotient and its product with lr: six fp32
      tensors of n; a 16-bit gradient adds its fp32 copy (`grad.float()`);
    - for a quantized state, at `exp_avg.copy_(exp_avg_f32)` (and again for exp_avg_sq) the
      decayed parameter, both fp32 moments (and the gradient's fp32 copy) beside what the
      requantization holds (_REQUANTIZE bytes per element)."""
    n = p.numel
    update = (6 + (dtype != "fp32")) * nbytes(n, "fp32")
    if not is_quantized(opt, p):
        return update
    return max(update, (3 + (dtype != "fp32")) * nbytes(n, "fp32") + _REQUANTIZE * n)

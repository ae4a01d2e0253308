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


def torchao_step_temporary(opt: Optimizer, p: HeldParam, dtype: str) -> int:
    """torchao/optim/adam.py `single_param_adam`, one parameter at a time, run eagerly (the
    meter's CPU path; torch.compile fuses it on CUDA, so this is an upper bound there): at
    `p_f32 - lr * (exp_avg_f32 / bias_correction1) / denom` the decayed fp32 parameter
    (`p_f32 - lr * weight_decay * p_f32`), exp_avg_f32 and exp_avg_sq_f32 (the `lerp`s of
    the dequantized moments), `denom`, the quotient and its product with lr are alive: six
    fp32 tensors of n; a 16-bit gradient adds its fp32 copy (`grad.float()`)."""
    n = p.numel
    return (6 + (dtype != "fp32")) * nbytes(n, "fp32")

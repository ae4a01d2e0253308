"""Optimizer states, master weights and the optimizer step's temporaries.

Each rule names the torch / transformers / bitsandbytes code whose allocations it models.
`n` is a trainable tensor's element count, `w` its storage width in bytes.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.dtypes import dtypes_of
from vramplan.components.trainable import HeldParam, ParamSet, grad_dtype
from vramplan.spec import Backend, JobSpec, Optimizer, OptimizerImpl
from vramplan.units import nbytes

# bitsandbytes Optimizer8bit: parameters with fewer than `min_8bit_size` elements keep
# 32-bit states (bitsandbytes/optim/optimizer.py, Optimizer8bit.__init__ default 4096);
# blockwise quantization uses 256-element blocks with one fp32 absmax each
# (`init_state`: blocksize 256 for dynamic blockwise 8-bit states).
_BNB_MIN_8BIT = 4096
_BNB_BLOCK = 256

_ADAM_LIKE = (Optimizer.ADAMW, Optimizer.ADAM)


def _step_scalar_bytes(spec: JobSpec) -> int:
    """torch Adam/AdamW keep `state['step']` as a 0-d fp32 tensor per parameter
    (torch/optim/adamw.py `_init_group`); it lives on the device only for fused or
    capturable steps, otherwise on the host when parameters are on CUDA."""
    if spec.backend is Backend.CPU or spec.optimizer_impl is OptimizerImpl.FUSED:
        return 4
    return 0


def _state_dtype(spec: JobSpec, p: HeldParam) -> str:
    """Optimizer states live in the dtype of the tensors the optimizer updates: the fp32
    master copies under a master policy, else the parameters (and their gradients)."""
    return dtypes_of(spec).optimizer_states if dtypes_of(spec).master_weights else grad_dtype(spec, p)


def state_tensors(spec: JobSpec, p: HeldParam) -> dict[str, int]:
    """Persistent optimizer state bytes for one trainable parameter, by state name."""
    n = p.numel
    sdtype = _state_dtype(spec, p)
    opt = spec.optimizer
    if opt in _ADAM_LIKE:
        return {"exp_avg": nbytes(n, sdtype), "exp_avg_sq": nbytes(n, sdtype), "step": _step_scalar_bytes(spec)}
    if opt is Optimizer.SGD:
        # torch/optim/sgd.py: a momentum_buffer (clone of the gradient) only when momentum != 0.
        return {"momentum_buffer": nbytes(n, sdtype)} if spec.momentum else {}
    if opt is Optimizer.LION:
        return {"exp_avg": nbytes(n, sdtype)}
    if opt is Optimizer.ADAFACTOR:
        return _adafactor_state(p)
    if opt in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT):
        if n < _BNB_MIN_8BIT:
            return {"state1": nbytes(n, "fp32"), "state2": nbytes(n, "fp32")}
        blocks = -(-n // _BNB_BLOCK)
        return {"state1": n, "state2": n, "absmax": 2 * blocks * 4}
    if opt is Optimizer.PAGED_ADAMW_32BIT:
        return {"state1": nbytes(n, "fp32"), "state2": nbytes(n, "fp32")}
    raise AssertionError(opt)


def _adafactor_state(p: HeldParam) -> dict[str, int]:
    """transformers.optimization.Adafactor (what HF Trainer uses for optim="adafactor"):
    factored second moment for matrices (a row vector and a column vector, fp32), a full
    fp32 exp_avg_sq for vectors; no first moment with the default beta1=None."""
    if len(p.shape) >= 2:
        rows, cols = p.shape[0], p.shape[1]
        return {"exp_avg_sq_row": 4 * rows, "exp_avg_sq_col": 4 * cols}
    return {"exp_avg_sq": 4 * p.numel}


def is_paged(spec: JobSpec) -> bool:
    """Paged optimizers keep state in CUDA managed memory, which the caching allocator (and
    so max_memory_allocated) does not count (bitsandbytes/optim/optimizer.py, paged=True)."""
    return spec.optimizer in (Optimizer.PAGED_ADAMW_8BIT, Optimizer.PAGED_ADAMW_32BIT)


def optimizer_states(spec: JobSpec, params: ParamSet) -> Breakdown:
    out = Breakdown()
    group = "optimizer_paged" if is_paged(spec) else "optimizer"
    for p in params.trainable():
        for name, size in state_tensors(spec, p).items():
            out.add(f"{group}/{name}", size)
    if dtypes_of(spec).master_weights:
        out.add("master_weights/fp32", sum(nbytes(p.numel, "fp32") for p in params.trainable()))
    return out


def step_temporaries(spec: JobSpec, params: ParamSet) -> Breakdown:
    """Extra bytes alive at the peak of `optimizer.step()` beyond params, grads and states."""
    train = params.trainable()
    if not train:
        return Breakdown()
    impl, opt = spec.optimizer_impl, spec.optimizer
    out = Breakdown()
    sizes = [nbytes(p.numel, _state_dtype(spec, p)) for p in train]
    if opt in _ADAM_LIKE:
        if impl is OptimizerImpl.FOREACH:
            # torch/optim/adamw.py `_multi_tensor_adamw`: exp_avg_sq_sqrt = _foreach_sqrt(...)
            # allocates one tensor per parameter; the rest of the update is in place.
            out.add("temporaries/optimizer/foreach_sqrt", sum(sizes))
        elif impl is OptimizerImpl.FORLOOP:
            # `_single_tensor_adamw`: denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps): the
            # sqrt and the quotient of the largest parameter are alive together.
            out.add("temporaries/optimizer/forloop_denom", 2 * max(sizes))
    elif opt is Optimizer.SGD and spec.weight_decay:
        # torch/optim/sgd.py: grads = _foreach_add(grads, params, alpha=weight_decay) (or
        # grad.add(param) per tensor in the for-loop form).
        out.add("temporaries/optimizer/weight_decay_grads",
                sum(sizes) if impl is OptimizerImpl.FOREACH else max(sizes))
    elif opt is Optimizer.LION:
        # lion-pytorch update: sign(exp_avg.lerp(grad, 1-beta1)) -> two parameter-sized temps.
        out.add("temporaries/optimizer/lion_update", 2 * max(sizes))
    elif opt is Optimizer.ADAFACTOR:
        out.merge(_adafactor_temporaries(spec, train))
    if dtypes_of(spec).master_weights:
        # The 16-bit gradient is copied to fp32 for the master update (DeepSpeed
        # runtime/bf16_optimizer.py keeps fp32_groups_gradients for every parameter).
        out.add("temporaries/optimizer/fp32_grads", sum(nbytes(p.numel, "fp32") for p in train))
    return out


def _adafactor_temporaries(spec: JobSpec, train: tuple[HeldParam, ...]) -> Breakdown:
    """transformers Adafactor.step works one parameter at a time: a 16-bit gradient and
    parameter are copied to fp32 (`grad.float()`, `p.float()`), and `update = grad**2 + eps`
    is a full fp32 tensor; the largest parameter sets the peak."""
    largest = max(train, key=lambda p: p.numel)
    n = largest.numel
    copies = 2 if largest.dtype != "fp32" else 0
    return Breakdown().add("temporaries/optimizer/adafactor_update", nbytes(n, "fp32") * (2 + copies))

"""Optimizer states, master weights and the optimizer step's temporaries.

Each rule names the torch / transformers / bitsandbytes code whose allocations it models.
`n` is a trainable tensor's element count, `w` its storage width in bytes.
"""
from __future__ import annotations

from itertools import count

from vramplan.breakdown import Breakdown
from vramplan.components import optimizer_projected as projected
from vramplan.components import optimizer_quantized as quantized
from vramplan.components.cuda_reduce import column_reduce_buffer
from vramplan.components.dtypes import dtypes_of
from vramplan.components.trainable import HeldParam, ParamSet, grad_dtype
from vramplan.spec import Backend, JobSpec, Optimizer, OptimizerImpl, SpecError
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


def state_tensors(spec: JobSpec, p: HeldParam, heads: tuple[int, int] | None = None) -> dict[str, int]:
    """Persistent optimizer state bytes for one trainable parameter, by state name.
    `heads`: (hidden_size, num_attention_heads) of the model, for Adam-mini's head blocks."""
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
    return _recent_state(spec, p, sdtype, heads)


def _recent_state(spec: JobSpec, p: HeldParam, sdtype: str, heads: tuple[int, int] | None) -> dict[str, int]:
    n, opt = p.numel, spec.optimizer
    if opt in (Optimizer.GALORE_ADAMW, Optimizer.APOLLO_ADAMW):
        return projected.state_tensors(spec, p, sdtype)
    if opt is Optimizer.MUON:
        if is_muon_matrix(p):
            # torch/optim/_muon.py `_init_group`: momentum_buffer = zeros_like(grad)
            return {"momentum_buffer": nbytes(n, sdtype)}
        return {"exp_avg": nbytes(n, sdtype), "exp_avg_sq": nbytes(n, sdtype), "step": _step_scalar_bytes(spec)}
    if opt is Optimizer.ADAM_MINI:
        return _adam_mini_state(p, sdtype, heads)
    if opt is Optimizer.SCHEDULE_FREE_ADAMW:
        # schedulefree/adamw_schedulefree.py `step`: z = clone(p), exp_avg_sq = zeros_like(p)
        return {"z": nbytes(n, sdtype), "exp_avg_sq": nbytes(n, sdtype)}
    if opt in (Optimizer.TORCHAO_ADAMW_8BIT, Optimizer.TORCHAO_ADAMW_4BIT):
        return quantized.torchao_state(opt, p, sdtype)
    if opt is Optimizer.LOMO:
        return {}  # lomo_optim/lomo.py: plain SGD inside the gradient hook, no state
    if opt is Optimizer.ADALOMO:
        # lomo_optim/adalomo.py __init__: fp32 exp_avg_sq_row (m) and _col (n) for matrices,
        # an fp32 exp_avg_sq (shape[0]) for vectors
        if len(p.shape) >= 2:
            return {"exp_avg_sq_row": 4 * p.shape[0], "exp_avg_sq_col": 4 * p.shape[1]}
        return {"exp_avg_sq": 4 * p.shape[0]}
    raise AssertionError(opt)


def is_muon_matrix(p: HeldParam) -> bool:
    """The usual Muon recipe (Keller Jordan's muon.py; torch.optim.Muon takes only 2-D
    parameters): the hidden layers' matrices go to Muon; embeddings, the head and 1-D
    parameters to AdamW."""
    return len(p.shape) == 2 and p.layer is not None


_ADAM_MINI_QK = ("k_proj", "q_proj", "wq", "wk", "query", "key")
_ADAM_MINI_ROWS = ("embed", "embd", "wte", "lm_head", "output", "final_layer", "v_proj", "wv", "value", "o_proj",
                   "wo", "attn.proj", "feed_forward", "linear", "mlp")


def _adam_mini_state(p: HeldParam, sdtype: str, heads: tuple[int, int] | None) -> dict[str, int]:
    """adam_mini/adam_mini.py (1.1.1) `step`, partition by lower-cased name: `bias` -> Adam
    (m, v full); q/k (`q_proj`, `k_proj`, `query`, `key`, ...) -> m full and one v per
    head block of dim*dim/n_heads elements (`m.view(-1, head_numel)`); embeddings, output,
    v, attention output and MLP -> m full and one v per output row; anything else (norms)
    -> m full and one 0-d v. Without `heads` q/k get one v per row (an upper bound)."""
    n, name = p.numel, p.name.lower()
    full = nbytes(n, sdtype)
    if "bias" in name:
        return {"m": full, "v": full}
    if any(word in name for word in _ADAM_MINI_QK) and heads is not None:
        dim, n_heads = heads
        head_numel = dim * dim // n_heads
        if n % head_numel:
            raise SpecError("optimizer", f"adam-mini views {p.name} as blocks of hidden_size**2 / "
                            f"num_attention_heads = {head_numel} elements, which do not divide its {n}; "
                            "the library would fail (use adamw)")
        return {"m": full, "vmean": nbytes(n // head_numel, sdtype)}
    if any(word in name for word in _ADAM_MINI_QK + _ADAM_MINI_ROWS):
        return {"m": full, "vmean": nbytes(p.shape[0], sdtype)}
    return {"m": full, "vmean": nbytes(1, sdtype)}


def _adafactor_state(p: HeldParam) -> dict[str, int]:
    """transformers.optimization.Adafactor (what HF Trainer uses for optim="adafactor"):
    factored second moment for matrices (a row vector and a column vector, fp32), a full
    fp32 exp_avg_sq for vectors; no first moment with the default beta1=None."""
    if len(p.shape) >= 2:
        rows, cols = p.shape[0], p.shape[1]
        return {"exp_avg_sq_row": 4 * rows, "exp_avg_sq_col": 4 * cols}
    return {"exp_avg_sq": 4 * p.numel}


def heads_of(desc) -> tuple[int, int] | None:
    """(hidden_size, num_attention_heads) of a transformer description, for Adam-mini."""
    hidden, heads = getattr(desc, "hidden_size", 0), getattr(desc, "num_heads", 0)
    return (hidden, heads) if hidden and heads else None


def state_key(spec: JobSpec) -> tuple:
    """Everything of the spec the optimizer's states and temporaries depend on (memo key)."""
    return (spec.optimizer, spec.optimizer_impl, dtypes_of(spec), spec.backend, spec.momentum,
            spec.weight_decay, spec.low_rank)


def is_paged(spec: JobSpec) -> bool:
    """Paged optimizers keep state in CUDA managed memory, which the caching allocator (and
    so max_memory_allocated) does not count (bitsandbytes/optim/optimizer.py, paged=True).
    On CPU, Optimizer8bit.get_state_buffer warns "Paged optimizers are not supported on CPU"
    and makes plain zeros_like states (bitsandbytes 0.50), so nothing is paged there."""
    return spec.backend is not Backend.CPU and spec.optimizer in (Optimizer.PAGED_ADAMW_8BIT, Optimizer.PAGED_ADAMW_32BIT)


# Optimizers whose per-parameter state reads only the parameter's size and dtype (state_tensors)
_SIZE_ONLY = _ADAM_LIKE + (Optimizer.SGD, Optimizer.LION, Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT,
                           Optimizer.PAGED_ADAMW_32BIT)


def optimizer_states(spec: JobSpec, params: ParamSet, heads: tuple[int, int] | None = None) -> Breakdown:
    out = Breakdown()
    group = "optimizer_paged" if is_paged(spec) else "optimizer"
    if spec.optimizer in _SIZE_ONLY:
        # one state_tensors per distinct (numel, dtype), times its count, in order of first
        # place: the same terms in the same order as adding every parameter's (identical
        # layers repeat a few shapes; a search asks for many parameter sets)
        counts: dict[tuple[int, str], list] = {}
        for p in params.trainable():
            hit = counts.get((p.numel, p.dtype))
            if hit is None:
                counts[(p.numel, p.dtype)] = [p, 1]
            else:
                hit[1] += 1
        for p, n in counts.values():
            for name, size in state_tensors(spec, p, heads).items():
                out.add(f"{group}/{name}", size * n)
    else:
        for p in params.trainable():
            for name, size in state_tensors(spec, p, heads).items():
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
    else:
        out.merge(_recent_temporaries(spec, train))
    if dtypes_of(spec).master_weights:
        # The 16-bit gradient is copied to fp32 for the master update (DeepSpeed
        # runtime/bf16_optimizer.py keeps fp32_groups_gradients for every parameter).
        out.add("temporaries/optimizer/fp32_grads", sum(nbytes(p.numel, "fp32") for p in train))
    return out


def _recent_temporaries(spec: JobSpec, train: tuple[HeldParam, ...]) -> Breakdown:
    opt, impl = spec.optimizer, spec.optimizer_impl
    out = Breakdown()
    widths = [(p, _state_dtype(spec, p)) for p in train]
    if opt is Optimizer.GALORE_ADAMW:
        out.add("temporaries/optimizer/low_rank_step", projected.galore_step_peak(spec, widths))
    elif opt is Optimizer.APOLLO_ADAMW:
        # one parameter at a time: the largest step sets the peak
        out.add("temporaries/optimizer/low_rank_step", max(projected.step_temporary(spec, p, w) for p, w in widths))
    elif opt is Optimizer.MUON:
        muon = [muon_step_temporary(p, w) for p, w in widths if is_muon_matrix(p)]
        rest = [(p, w) for p, w in widths if not is_muon_matrix(p)]
        adamw = _adamw_temporary(impl, [nbytes(p.numel, w) for p, w in rest]) if rest else 0
        # Muon steps its matrices first, then AdamW the rest: the larger of the two
        out.add("temporaries/optimizer/muon_newton_schulz" if max(muon, default=0) >= adamw
                else "temporaries/optimizer/adamw_rest", max(max(muon, default=0), adamw))
    elif opt is Optimizer.ADAM_MINI:
        # adam_mini.py: `update = m * stepsize` and `p.add_(-update)`: two full tensors
        out.add("temporaries/optimizer/adam_mini_update", 2 * max(nbytes(p.numel, w) for p, w in widths))
    elif opt is Optimizer.SCHEDULE_FREE_ADAMW:
        # adamw_schedulefree.py: denom = _foreach_div(exp_avg_sq, bias_correction2) (one per
        # parameter) or exp_avg_sq.div(...) per parameter in the for-loop form
        sizes = [nbytes(p.numel, w) for p, w in widths]
        out.add("temporaries/optimizer/denom", sum(sizes) if impl is OptimizerImpl.FOREACH else max(sizes))
    elif opt in (Optimizer.TORCHAO_ADAMW_8BIT, Optimizer.TORCHAO_ADAMW_4BIT):
        out.add("temporaries/optimizer/dequantized_step", max(quantized.torchao_step_temporary(opt, p, w)
                                                               for p, w in widths))
    elif opt in (Optimizer.LOMO, Optimizer.ADALOMO):
        from vramplan.components.optimizer_in_backward import lomo_step_temporary
        out.add("temporaries/optimizer/lomo_update", max(lomo_step_temporary(spec, p) for p in train))
    return out


def _adamw_temporary(impl: OptimizerImpl, sizes: list[int]) -> int:
    """torch AdamW's step temporaries over parameters of `sizes` bytes (see step_temporaries)."""
    if impl is OptimizerImpl.FOREACH:
        return sum(sizes)
    return 2 * max(sizes) if impl is OptimizerImpl.FORLOOP else 0


def muon_step_temporary(p: HeldParam, dtype: str) -> int:
    """torch/optim/_muon.py `_single_tensor_muon` for an (m, n) matrix, k = min(m, n):
    `update = grad.lerp(buf, momentum)` (m*n in the gradient's dtype) stays alive through
    `_zeropower_via_newtonschulz`, which works in bf16: at each iteration's
    `addmm(ortho, gram_update, ortho)` the previous and the new ortho (m*n each) and the
    (k, k) gram matrix and its update are alive (for a bf16 gradient the first ortho is
    `update` itself, and the count is the same from the second iteration on)."""
    m, n = p.shape
    k = min(m, n)
    return nbytes(m * n, dtype) + 2 * nbytes(m * n, "bf16") + 2 * nbytes(k * k, "bf16")


ADAFACTOR_TERMS = ("temporaries/optimizer/adafactor_update", "temporaries/optimizer/adafactor_column_mean_buffer")


def _column_mean_buffers(spec: JobSpec):
    """p -> the bytes `update.mean(dim=-2)` takes as a CUDA reduction buffer for a factored
    (2-D) parameter p on the job's GPU (components/cuda_reduce.py); 0 off CUDA."""
    if spec.backend is not Backend.CUDA:
        return lambda p: 0
    gpu = None
    if spec.gpu:
        from vramplan.catalog import find_gpu
        gpu = find_gpu(spec.gpu).name
    return lambda p: column_reduce_buffer(p.shape[0], p.shape[1], gpu) if len(p.shape) == 2 else 0


def adafactor_sequence(spec: JobSpec, params: ParamSet) -> tuple[tuple[int, int], ...] | None:
    """transformers Adafactor.step's allocations one parameter after another (optimization.py
    `step`), as (tensor, bytes) ops, bytes 0 for a free: the fp32 copies of a 16-bit gradient
    and parameter, `grad**2` and `+ eps` (the power freed), on CUDA the column mean's reduction
    buffer (components/cuda_reduce.py), the factored update `torch.mul(r_factor, c_factor)`
    (or `exp_avg_sq.rsqrt()` unfactored) replacing the first, `-update` for `add_`; then all
    freed. Its largest moment is _adafactor_temporaries'. For the event list (one GPU): the
    allocator sees the loop's block sizes, not one block of the largest moment. None for other
    optimizers, and off CUDA (nothing replays the allocator there)."""
    if spec.optimizer is not Optimizer.ADAFACTOR or spec.backend is not Backend.CUDA or not params.trainable():
        return None
    buffer_of = _column_mean_buffers(spec)
    ops: list[tuple[int, int]] = []
    key = count()
    for p in params.trainable():
        n = nbytes(p.numel, "fp32")
        copies = [next(key), next(key)] if p.dtype != "fp32" else []
        ops += [(c, n) for c in copies]
        power, update = next(key), next(key)
        ops += [(power, n), (update, n), (power, 0)]
        buffer = buffer_of(p)
        if buffer:
            b = next(key)
            ops += [(b, buffer), (b, 0)]
        new, neg = next(key), next(key)
        ops += [(new, n), (update, 0), (neg, n), (neg, 0), (new, 0)] + [(c, 0) for c in reversed(copies)]
    return tuple(ops)


def _adafactor_temporaries(spec: JobSpec, train: tuple[HeldParam, ...]) -> Breakdown:
    """transformers Adafactor.step works one parameter at a time: a 16-bit gradient and
    parameter are copied to fp32 (`grad.float()`, `p.float()`), and `update = grad**2 + eps`
    is a full fp32 tensor (the power and the sum alive together); the largest parameter sets
    the peak. On CUDA a factored (2-D) parameter's column mean, `update.mean(dim=-2)`, also
    takes the reduction's staging buffer while `update` lives (components/cuda_reduce.py; up
    to twice the parameter's fp32 bytes), so there the parameter with the largest sum sets it."""
    buffer_of = _column_mean_buffers(spec)
    best, best_buffer = 0, 0
    for p in train:
        n = nbytes(p.numel, "fp32")
        buffer = buffer_of(p)
        buffer = buffer if n + buffer > 2 * n else 0     # else the power and the sum set it
        total = (2 * n if p.dtype != "fp32" else 0) + max(2 * n, n + buffer)
        if total > best:
            best, best_buffer = total, buffer
    out = Breakdown().add("temporaries/optimizer/adafactor_update", best - best_buffer)
    if best_buffer:
        out.add("temporaries/optimizer/adafactor_column_mean_buffer", best_buffer)
    return out

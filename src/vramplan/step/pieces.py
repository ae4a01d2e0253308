"""Which tensors a term's bytes are made of, from the parameter list.

The caching allocator sees tensors, not terms: AdamW's exp_avg is one tensor per parameter
(torch/optim/adamw.py, `_init_group`: `torch.zeros_like(p)` per parameter), a foreach
optimizer's temporaries are lists of per-parameter tensors (`torch._foreach_sqrt` returns
one tensor per input), and each parameter's .grad is its own tensor (AccumulateGrad).
So persistent terms and gradients are split in proportion to the parameter sizes.
"""
from __future__ import annotations

from vramplan.components.layer_backward import mlp_grad_tensors
from vramplan.components.quant import QUANT_DTYPES
from vramplan.components.trainable import ParamSet
from vramplan.components.weights import num_stages, stage_of
from vramplan.model import ModelDesc
from vramplan.step.events import Pieces
from vramplan.timeline import StepPlan

_MEMO: dict[int, tuple[ParamSet, dict, list]] = {}
BLAS_WORKSPACES = ("runtime/cublas_workspace", "runtime/cublaslt_workspace")
HANDLES = ("forward", "backward")
"""A step's two cuBLAS handles, each with its workspaces from the caching allocator, made at
the handle's first matmul (aten/src/ATen/cuda/CublasHandlePool.cpp getNewWorkspace; handles
are per thread: forward on the Python thread, backward on the autograd engine's device
thread; catalog/cuda_runtime.json "cublas"). The traces show them: two 32 MiB blocks on
sm90, one at the first forward linear, one at the first backward matmul."""


def _groups(params: ParamSet) -> dict[str, tuple[int, ...]]:
    """Parameter numels per kind of term (the keys weights.weight_terms writes)."""
    g: dict[str, list[int]] = {"trainable": [], "frozen": [], "lora": [], "saved_copy": [], "quantized": [],
                               "all_trainable": []}
    for p in params.params:
        if p.kind == "base" and p.dtype in QUANT_DTYPES:
            g["quantized"].append(p.numel)
        elif p.kind in ("lora", "saved_copy"):
            g[p.kind].append(p.numel)
        else:
            g["trainable" if p.trainable else "frozen"].append(p.numel)
        if p.trainable:
            g["all_trainable"].append(p.numel)
    return {k: tuple(v) for k, v in g.items()}


def _group_of(term: str) -> str | None:
    if term.startswith(("optimizer/", "master", "temporaries/optimizer/")):
        return "all_trainable"
    for word, group in (("lora", "lora"), ("modules_to_save", "saved_copy"), ("quant", "quantized"),
                        ("weights/trainable", "trainable"), ("weights/frozen", "frozen")):
        if word in term:
            return group
    return None


def _per_stage(desc: ModelDesc, params: ParamSet) -> list[tuple[int, ...]]:
    stages: list[list[int]] = [[] for _ in range(num_stages(desc))]
    for p in params.trainable():
        stages[stage_of(desc, p)].append(p.numel)
    return [tuple(s) for s in stages]


def tensor_pieces(desc: ModelDesc, params: ParamSet, plan: StepPlan) -> Pieces:
    """Pieces for a single-GPU plan (sharded plans keep one flat tensor per term). On one GPU
    without an engine the optimizer's states are made by its first step (torch/optim/adamw.py
    `_init_group`; transformers' Adafactor, bitsandbytes' and torchao's optimizers alike),
    as every CUDA trace in bench/allocator/traces shows (the reserve before the first
    forward holds the weights alone); ZeRO engines make theirs at initialization and are
    sharded plans."""
    transient = {"backward/grad_mlp": (1,) * mlp_grad_tensors(desc)}
    lazy = {t: ("optimizer",) for t, _ in plan.static if t.startswith("optimizer/")}
    if "temporaries/optimizer/weight_decay_grads" in plan.optimizer_temporaries.terms:
        # SGD makes its momentum buffers in the update, from the weight-decayed gradients it
        # has just allocated (torch/optim/sgd.py `_multi_tensor_sgd`: grads = _foreach_add(
        # grads, params), then buf = clone(grad) where the state has none), not in _init_group
        lazy["optimizer/momentum_buffer"] = ("optimizer_update",)
    # DoRA computes each weight's norm through the base and LoRA weights when PEFT wraps the
    # model (peft/tuners/lora/dora.py update_layer -> get_weight_norm): the Python thread's
    # handle is made then, before the first step (the DoRA trace's first 32 MiB block is in
    # its backward).
    handles = ("setup", "backward") if any(p.name.endswith("lora_magnitude_vector") for p in params.params) \
        else HANDLES
    lazy.update((t, handles) for t, _ in plan.static if t in BLAS_WORKSPACES)
    hit = _MEMO.get(id(params))
    if hit is None or hit[0] is not params:
        if len(_MEMO) >= 64:
            _MEMO.pop(next(iter(_MEMO)))
        hit = _MEMO[id(params)] = (params, _groups(params), _per_stage(desc, params))
    groups, stages = hit[1], hit[2]
    static = {}
    for term, _ in list(plan.static) + list(plan.optimizer_temporaries):
        group = _group_of(term)
        if group and len(groups[group]) > 1:
            static[term] = groups[group]
    if len(stages) != len(plan.grads_by_stage):
        return Pieces(static=static, transient=transient, lazy=lazy)
    rest = [_without_peak(stages[i], g.total(), plan.stage_grads_at_peak[i].total() if plan.stage_grads_at_peak else 0)
            for i, g in enumerate(plan.grads_by_stage)]
    return Pieces(static=static, grads_rest=rest, transient=transient, lazy=lazy, trained=stages)


def _without_peak(numels: tuple[int, ...], total: int, at_peak: int) -> tuple[int, ...]:
    """The stage's parameters less the one whose gradient exists at the stage's peak (the
    MLP's output projection, weights.gradient_stages_at_peak), found by its size."""
    if not numels or not at_peak or not total:
        return numels
    per = total / sum(numels)
    target = round(at_peak / per)
    out = list(numels)
    if target in out:
        out.remove(target)
    return tuple(out)

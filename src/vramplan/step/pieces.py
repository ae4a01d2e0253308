"""Which tensors a term's bytes are made of, from the parameter list.

The caching allocator sees tensors, not terms: AdamW's exp_avg is one tensor per parameter
(torch/optim/adamw.py, `_init_group`: `torch.zeros_like(p)` per parameter), a foreach
optimizer's temporaries are lists of per-parameter tensors (`torch._foreach_sqrt` returns
one tensor per input), and each parameter's .grad is its own tensor (AccumulateGrad).
So persistent terms and gradients are split in proportion to the parameter sizes.
"""
from __future__ import annotations

from vramplan.components.quant import QUANT_DTYPES
from vramplan.components.trainable import ParamSet
from vramplan.components.weights import num_stages, stage_of
from vramplan.model import ModelDesc
from vramplan.step.events import Pieces
from vramplan.timeline import StepPlan

_MEMO: dict[int, tuple[ParamSet, dict, list]] = {}


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
    """Pieces for a single-GPU plan (sharded plans keep one flat tensor per term)."""
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
        return Pieces(static=static)
    rest = [_without_peak(stages[i], g.total(), plan.stage_grads_at_peak[i].total() if plan.stage_grads_at_peak else 0)
            for i, g in enumerate(plan.grads_by_stage)]
    return Pieces(static=static, grads_rest=rest)


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

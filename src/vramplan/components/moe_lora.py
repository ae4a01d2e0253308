"""LoRA on transformers 5's fused MoE experts, as PEFT 0.21 puts it there.

transformers 5 stores each MoE layer's experts as 3-D parameters (`experts.gate_up_proj`
(E, 2f, h), `experts.down_proj` (E, h, f)) where 4.x had an nn.Linear per expert. PEFT
keeps old adapter configs working by rewriting them (peft/utils/transformers_weight_conversion.py
`_convert_peft_config_moe`, for the model types of catalog/peft_moe_targets.json):
- `all-linear` is first resolved to the leaf names of every nn.Linear but the output head,
  plus the 4.x expert and router names (`_resolve_string_target_modules`);
- every target named like a 4.x expert projection or the router (`gate_proj`, `up_proj`,
  `down_proj`, `gate`; Mixtral's `w1`, `w3`, `w2`, `gate`) leaves `target_modules` and becomes a
  `target_parameters` entry (`gate_up_proj`, `down_proj`, `gate.weight`), so a dense layer's or
  a shared expert's nn.Linear of that name is no longer wrapped;
- the fused gate_up_proj takes rank and alpha times the number of names fused into it
  (`rank_pattern`, `alpha_pattern`); naming only some of them is an error.
Each targeted parameter gets a lora.ParamWrapper (peft/tuners/lora/layer.py): lora_A
nn.Linear(in, r * E), lora_B nn.Linear(r * E, out) (E = 1 for the 2-D router). In forward
`_LoraFactorsProxy` folds the update into the weight with one `baddbmm(W, lhs, rhs)`: a
new tensor the size of the whole expert stack, which the experts' matmuls save for backward.
"""
from __future__ import annotations

from vramplan.catalog.runtime import peft_moe_targets
from vramplan.spec import SpecError


def convert_targets(model_type: str, names: set[str]) -> tuple[set[str], dict[str, int]] | None:
    """(the names left to wrap as nn.Linear, {parameter suffix: rank multiplier}) after PEFT's
    rewrite of `names` (leaf names, all-linear already resolved with `expert_names`); None
    when PEFT does not rewrite this model type's targets."""
    table = peft_moe_targets(model_type)
    if table is None:
        return None
    mapping, fused = table
    remaining, params, matched = set(), {}, {}
    for t in names:
        old = next((o for o in mapping if t == o or t.endswith("." + o)), None)
        if old is None:
            remaining.add(t)
            continue
        params[mapping[old]] = 1
        matched.setdefault(mapping[old], set()).add(old)
    for new, olds in fused.items():
        got = matched.get(new, set())
        if 0 < len(got) < len(olds):
            raise SpecError("lora.target_modules",
                            f"PEFT fuses {', '.join(olds)} into the experts' {new} for {model_type} (transformers 5): "
                            f"name all of them or none (missing {', '.join(sorted(set(olds) - got))})")
        if len(got) == len(olds) and len(olds) > 1:
            params[new] = len(olds)
    return remaining, params


def check_wrapper_options(lora) -> None:
    """lora.ParamWrapper refuses what it cannot fold into the weight (peft/tuners/lora/layer.py
    ParamWrapper.__init__ raises ValueError): a lora_dropout (x is not factored out of
    lora_B(lora_A(dropout(x)))) and DoRA; get_peft_model fails before training starts."""
    leave = "or leave the experts and the router out of lora.target_modules"
    if lora.dropout:
        raise SpecError("lora.dropout", f"PEFT's LoRA on fused MoE experts (lora.ParamWrapper) does not work with "
                                        f"lora_dropout != 0 (got {lora.dropout}): set it to 0, {leave}")
    if lora.use_dora:
        raise SpecError("lora.use_dora", f"PEFT's LoRA on fused MoE experts (lora.ParamWrapper) does not work with "
                                         f"use_dora: set it to false, {leave}")


def expert_names(model_type: str) -> set[str]:
    """The 4.x names `all-linear` adds for this model type (the mapping's keys)."""
    table = peft_moe_targets(model_type)
    return set(table[0]) if table else set()


def wrapped(name: str, params: dict[str, int]) -> int:
    """The rank multiplier of a parameter PEFT targets by suffix (0: not targeted)."""
    return next((m for suffix, m in params.items() if name.endswith("." + suffix)), 0)


def in_out_experts(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(in, out, experts) of a targeted parameter: transformers 5 stores experts as (E, out, in)
    (ParamWrapper swaps in and out for them), the router's weight as (out, in)."""
    if len(shape) == 3:
        return shape[2], shape[1], shape[0]
    return shape[1], shape[0], 1

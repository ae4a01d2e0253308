"""Data-parallel sharding of a multi-model step (ZeRO 1-3, FSDP), term by term.

Multi-model trainers hand every model to the same engine: TRL prepares the frozen
reference (and reward) model with DeepSpeed too, so under ZeRO-3 its weights are
partitioned like the policy's (trl/trainer/dpo_trainer.py `_prepare_deepspeed`; with FSDP,
accelerate wraps it the same way). Per rank, with n data-parallel ranks:
- optimizer states, master weights and optimizer temporaries / n from ZeRO-1 / any FSDP
  (DeepSpeed runtime/zero/stage_1_and_2.py partitions the fp32 groups; FSDP shards states
  with the flat/DTensor parameters); on the host with optimizer offload;
- gradients / n from ZeRO-2 / FSDP full-, hybrid- and shard-grad-op sharding;
- weights / n under ZeRO-3 / FSDP full- and hybrid-shard, plus one gathered layer of the
  trained model (the unit being computed: stage3.py fetch_sub_module, FSDP's all-gather).
Tensor, pipeline and context parallelism of multi-model jobs are not modelled.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.model import ModelDesc
from vramplan.spec import JobSpec, SpecError


def _rules(spec: JobSpec) -> dict[str, bool]:
    par = spec.parallel
    fsdp = par.fsdp
    return {
        "states": par.zero_stage >= 1 or fsdp != "none",
        "grads": par.zero_stage >= 2 or fsdp in ("full-shard", "hybrid-shard", "shard-grad-op"),
        "weights": par.zero_stage == 3 or fsdp in ("full-shard", "hybrid-shard"),
        "offload_states": par.offload_optimizer != "none",
        "offload_weights": par.offload_params != "none",
    }


def _kind(key: str) -> str | None:
    parts = key.split("/")
    for i, part in enumerate(parts):
        if part in ("optimizer", "optimizer_paged", "master_weights"):
            return "states"
        if part == "temporaries" and i + 1 < len(parts) and parts[i + 1] == "optimizer":
            return "states"
        if part == "gradients":
            return "grads"
        if part == "weights":
            return "weights"
    return None


def _shard(bd: Breakdown, n: int, rules: dict[str, bool]) -> Breakdown:
    out = Breakdown()
    for key, value in bd:
        kind = _kind(key)
        if kind == "states" and rules["offload_states"]:
            continue
        if kind == "weights" and rules["offload_weights"] and rules["weights"]:
            continue
        if kind and rules[kind]:
            value = -(-value // n)
        out.add(key, value)
    return out


def _one_layer(static: Breakdown, desc: ModelDesc) -> int:
    """Bytes of one gathered layer of the largest model (weights per model / layers)."""
    per_model: dict[str, int] = {}
    for key, value in static:
        if _kind(key) == "weights":
            model = key.split("/", 1)[0]
            per_model[model] = per_model.get(model, 0) + value
    return -(-max(per_model.values(), default=0) // max(1, desc.num_layers))


def shard_step(plan, spec: JobSpec, desc: ModelDesc) -> None:
    """Rewrite a multi-model StepPlan in place for one data-parallel rank."""
    par = spec.parallel
    if par.model_parallel > 1 or par.ep > 1:
        raise SpecError("parallel", "tensor, pipeline, context and expert parallelism are not modelled "
                        "for multi-model jobs yet; use zero_stage or fsdp")
    n = spec.num_gpus
    if n <= 1 and par.is_trivial:
        return
    rules = _rules(spec)
    gathered = _one_layer(plan.static, desc) if rules["weights"] else 0
    plan.static = _shard(plan.static, n, rules)
    if gathered:
        plan.static.add("engine/gathered_layer", gathered)
    plan.grads_by_stage = [_shard(b, n, rules) for b in plan.grads_by_stage]
    if plan.stage_grads_at_peak is not None:
        plan.stage_grads_at_peak = [_shard(b, n, rules) for b in plan.stage_grads_at_peak]
    plan.optimizer_temporaries = _shard(plan.optimizer_temporaries, n, rules)

"""The roles of a multi-model step that the parallel layer has not cut yet, per rank.

Every trained role built from a ModelDesc (DPO's policy, a reward model, PPO's actor and
critic, a VLM's language model, a trained role of a models list) goes through
step.build.rank_step, i.e. parallel.rank_plan, the same code as a single-model job: its
states are sharded, its activations divided and the engine's buffers (ZeRO-3's gathered
parameters, FSDP's unsharded units) added there, and its terms are listed in
`StepPlan.sharded_prefixes`. What is left here is everything else: the frozen models'
weights and forwards, and a trained model that is not a ModelDesc (a diffusion denoiser).

Multi-model trainers hand every model to the same engine: TRL prepares the frozen
reference (and reward) model with DeepSpeed too, so under ZeRO-3 its weights are
partitioned like the policy's (trl/trainer/dpo_trainer.py `_prepare_deepspeed`; with FSDP,
accelerate wraps it the same way). Per rank, with n = the layout's shard group:
- optimizer states, master weights and optimizer temporaries / n from ZeRO-1 / any FSDP
  (DeepSpeed runtime/zero/stage_1_and_2.py partitions the fp32 groups); on the host with
  optimizer offload;
- gradients / n from ZeRO-2 / FSDP full-, hybrid- and shard-grad-op sharding;
- weights / n under ZeRO-3 / FSDP full- and hybrid-shard; a frozen model's no-grad
  forward gathers its layers one module at a time with the same prefetch as the policy
  (parallel.engines.zero3_live on its layer size);
- tensor and pipeline parallelism cut every model's layers the same way (Megatron builds
  the reference with the policy's parallel state): its weights / (tp * pp), its forward's
  activations as parallel.activations.scale divides them.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.parallel import activations as acts
from vramplan.parallel import engines
from vramplan.parallel.layout import Layout
from vramplan.components.dtypes import dtypes_of
from vramplan.spec import JobSpec
from vramplan.units import nbytes


def _rules(lay: Layout) -> dict[str, bool]:
    fsdp = lay.fsdp
    return {
        "states": lay.zero_stage >= 1 or fsdp != "none",
        "grads": lay.zero_stage >= 2 or fsdp in ("full-shard", "hybrid-shard", "shard-grad-op"),
        "weights": lay.zero_stage == 3 or fsdp in ("full-shard", "hybrid-shard"),
        "offload_states": lay.offload_optimizer != "none",
        "offload_weights": lay.offload_params != "none",
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


def _ceil(value: int, k: int) -> int:
    return -(-value // k)


def _shard(bd: Breakdown, lay: Layout, rules: dict[str, bool], done: tuple[str, ...]) -> Breakdown:
    """`bd` on one rank; terms under a prefix in `done` are already per rank."""
    out = Breakdown()
    n, mp = lay.shard_group, lay.tp * lay.pp
    for key, value in bd:
        if not (done and key.startswith(done)):
            kind = _kind(key)
            if kind == "states" and rules["offload_states"]:
                continue
            if kind == "weights" and rules["offload_weights"] and rules["weights"]:
                continue
            if kind:
                value = _ceil(value, mp)
            if kind and rules[kind]:
                value = _ceil(value, n)
        out.add(key, value)
    return out


def _unsharded_weights(static: Breakdown, done: tuple[str, ...]) -> dict[str, int]:
    """Weight bytes per role (the key's first part) of the roles not yet cut."""
    per: dict[str, int] = {}
    for key, value in static:
        if _kind(key) == "weights" and not (done and key.startswith(done)):
            role = key.split("/", 1)[0]
            per[role] = per.get(role, 0) + value
    return per


def shard_step(step, spec: JobSpec, desc, stages: int):
    """Cut the roles of `step` (jobs.compose.Step) that rank_plan did not to one rank, in
    place. `stages` is the trained model's layer count (a ZeRO-3 unit is one layer).
    Returns the trained role's ParallelReport (None for a single GPU or a non-LLM role)."""
    plan = step.plan
    if spec.num_gpus <= 1 and spec.parallel.is_trivial:
        return plan.parallel
    lay = Layout.of(spec, getattr(desc, "hidden_size", None))
    rules, done = _rules(lay), plan.sharded_prefixes
    per_role = _unsharded_weights(plan.static, done)
    plan.static = _shard(plan.static, lay, rules, done)
    plan.grads_by_stage = [_shard(b, lay, rules, done) for b in plan.grads_by_stage]
    if plan.stage_grads_at_peak is not None:
        plan.stage_grads_at_peak = [_shard(b, lay, rules, done) for b in plan.stage_grads_at_peak]
    plan.optimizer_temporaries = _shard(plan.optimizer_temporaries, lay, rules, done)
    if plan.step_grads is not None:
        plan.step_grads = _shard(plan.step_grads, lay, rules, done)
    if lay.tp > 1 or lay.seq_shards > 1:
        step.before = [(ph, label, acts.scale(x, lay)) for ph, label, x in step.before]
        step.after_forward = [(ph, label, acts.scale(x, lay), keep) for ph, label, x, keep in step.after_forward]
    if rules["weights"] and per_role and not rules["offload_weights"]:
        _gather(step, lay, spec, per_role, max(1, stages))
    return plan.parallel


def _gather(step, lay: Layout, spec: JobSpec, per_role: dict[str, int], layers: int) -> None:
    """ZeRO-3 / FSDP gathers of the roles cut here: a frozen role's layer during its own
    forward; a trained role not cut by rank_plan (diffusion) for the whole step, as the
    unit being computed (stage3.py fetch_sub_module, FSDP's all-gather)."""
    plan, dtype = step.plan, dtypes_of(spec).weights
    elem = nbytes(1, dtype)

    def live(role: str) -> int:
        whole = _ceil(per_role[role], lay.tp * lay.pp)
        unit = _ceil(whole, layers)
        if lay.engine != "zero":
            return unit
        return engines.zero3_live(lay, dtype, unit // elem, whole // elem).total()

    grads = {k.split("/", 1)[0] for b in plan.grads_by_stage for k, _ in b}
    trained = [r for r in per_role if r in grads]
    if trained:
        plan.static.add("engine/gathered_layer", max(map(live, trained)))
    frozen = [r for r in per_role if r not in grads]

    def with_gather(x: Breakdown) -> Breakdown:
        roles = [r for r in frozen if x.total(r + "/")]
        return Breakdown().merge(x).add("engine/gathered_layer", max(map(live, roles))) if roles else x

    step.before = [(ph, label, with_gather(x)) for ph, label, x in step.before]
    step.after_forward = [(ph, label, with_gather(x), keep) for ph, label, x, keep in step.after_forward]

"""DeepSpeed ZeRO-3's buffers in a rank's step plan (parallel/engines.py has each term's
source in DeepSpeed 0.19's runtime/zero): the reduce buffers, the gathered parameters with
the prefetch's flat buffer, the persistent parameters' partitions, and ZeRO++ hpZ's
secondary partitions with the moments they are alive. Checked against the real engine on
CPU (bench/parallel/deepspeed_cpu.py; `--set hpz` for hpZ and the 4-rank rows)."""
from __future__ import annotations

from vramplan.breakdown import Breakdown, own, shared
from vramplan.components.dtypes import dtypes_of
from vramplan.components.memo import cached
from vramplan.components.optimizer import optimizer_states, state_key
from vramplan.components.weights import is_token_embedding, stage_of
from vramplan.parallel import engines
from vramplan.parallel.layout import DS_PARAM_PERSISTENCE_THRESHOLD, Layout
from vramplan.parallel.sets import RankSets, memo, numel
from vramplan.spec import JobSpec
from vramplan.spec.enums import Checkpointing
from vramplan.timeline import StepPlan


def zero3_buffers(desc, spec: JobSpec, lay: Layout, sets: RankSets, out: StepPlan, unit: dict, root: list,
                  gdt: str, gb: int) -> None:
    full = sets.full
    biggest = memo(sets, ("biggest", tuple(unit)),
                   lambda: max([numel(u) for u in unit.values()] + [max((p.numel for p in root), default=0)]))
    grad_part = memo(sets, "grads_numel", lambda: sum(p.numel for p in sets.grads.trainable()))
    reduce = engines.zero3_reduce(lay, gdt, biggest, grad_part)
    out.static.add("zero/ipg_bucket_flat_buffer", reduce.total("zero/ipg"))
    # The gradient partitions live in the persistent flat buffer (engines.zero3_reduce):
    # it replaces the per-stage sharded gradients.
    out.static.add("zero/grad_partitions_flat_buffer", reduce.total("zero/grad_partitions"))
    # one empty Breakdown for every stage, as components/memo.cached hands out equal stages'
    # gradients (the timeline then sums it once)
    out.grads_by_stage = [Breakdown()] * len(out.grads_by_stage)
    if lay.offload_optimizer == "none":
        out.optimizer_temporaries.merge(engines.zero3_step_grad(
            lay, memo(sets, "states_numel", lambda: numel(sets.states.trainable()))))
    # ZeRO-3 keeps parameters below the persistence threshold whole on every rank (the
    # rank's weights set them whole: parallel/sets.py), so the gathered ones are the others
    wdt = dtypes_of(spec).weights
    persist = int(lay.knob("stage3_param_persistence_threshold", DS_PARAM_PERSISTENCE_THRESHOLD))
    kept, gathered = memo(sets, ("persistence", persist), lambda: (
        tuple(p.numel for p in full.params if p.numel < persist),
        tuple(p.numel for p in full.params if p.numel >= persist)))
    if lay.offload_params == "none":  # offload_param keeps every partition in host memory
        out.static.merge(engines.zero3_persistent_partitions(lay, wdt, kept))
    forward_only = memo(sets, ("forward_only", persist, spec.gradient_checkpointing), lambda: sum(
        p.numel for p in full.params if p.numel >= persist and _forward_only(desc, spec, p)))
    live = engines.zero3_live(lay, wdt, biggest, sum(gathered) - forward_only)
    for t in shared([out.forward_end_transient, out.loss_backward_transient, *out.stage_backward_transient]):
        t.merge(live)
    stages = len(out.stage_acts)
    # one Breakdown for every stage but the head, one for the head: the timeline sums a
    # shared part once (timeline._sum)
    body, head = Breakdown(), Breakdown()
    forward = [body] * (stages - 1) + [head]
    if gathered:
        # a stage's forward: the gathered parameters and the prefetch's flat buffer, before the
        # output head fetches the bucket's last parameter (engines.zero3_prefetch_flat_buffer)
        body.merge(live).merge(engines.zero3_prefetch_flat_buffer(lay, wdt, gathered))
    _hpz(desc, spec, lay, sets, out, forward)
    if body.terms or head.terms:
        before = out.stage_forward_transient
        if before is None:
            out.stage_forward_transient = forward
        else:  # each distinct pair merged once, so shared stages stay shared
            pairs: dict[tuple[int, int], Breakdown] = {}
            for b, f in zip(before, forward):
                if (id(b), id(f)) not in pairs:
                    pairs[id(b), id(f)] = Breakdown().merge(b).merge(f)
            out.stage_forward_transient = [pairs[id(b), id(f)] for b, f in zip(before, forward)]
    for t in shared(out.stage_backward_transient):
        t.add("zero/unsharded_grads", biggest * gb)


def _forward_only(desc, spec: JobSpec, p) -> bool:
    """A parameter no backward module fetches again, so the prefetch's scan never keeps it
    gathered (engines.zero3_live): a frozen, untied input embedding, whose output needs no
    gradient without checkpointing (with it, transformers' enable_input_require_grads makes
    the output require one and DeepSpeed's pre-backward hook fetches the module). Measured:
    bench/parallel/deepspeed_cpu.py --set lora, the 32k-vocabulary LoRA row."""
    return (not p.trainable and p.layer is None and not desc.tie_word_embeddings and is_token_embedding(p)
            and spec.gradient_checkpointing is Checkpointing.NONE)


def _hpz(desc, spec: JobSpec, lay: Layout, sets: RankSets, out: StepPlan, forward: list[Breakdown]) -> None:
    """ZeRO++ hpZ's secondary partitions (engines.zero3_hpz_secondary) when they are alive,
    as measured on the real engine (bench/parallel/deepspeed_cpu.py --set hpz) and read in
    DeepSpeed 0.19: Init partitions every parameter at the engine's init, secondary included,
    so the first step holds all of them through forward and backward, when the optimizer's
    states (torch makes them at that step's optimizer.step()) do not exist yet; each
    optimizer step ends by dropping them (stage3.py _post_step -> invalidate_secondary_tensor);
    every later step makes a module's again when its backward releases its parameters
    (partition_parameters.py Init._partition -> _partition_param_sec, from the module's
    post-backward hook), and the optimizer step holds them all. So a stage's backward holds
    the secondary partitions of the stages after it, or, where larger, the first step's all
    less the states; the forward events the latter."""
    if lay.offload_params != "none":
        return      # the secondary tensors are made on Init's remote_device: the host
    numels = memo(sets, "numels", lambda: tuple(p.numel for p in sets.full.params))
    sec = engines.zero3_hpz_secondary(lay, dtypes_of(spec).weights, numels)
    if not sec.terms:
        return
    out.optimizer_temporaries.merge(sec)
    lazy = 0
    if lay.offload_optimizer == "none":
        lazy = sum(v for k, v in cached(sets.states, ("states", None) + state_key(spec),
                                        lambda: optimizer_states(spec, sets.states)) if k.startswith("optimizer/"))
    first = max(0, sec.total() - lazy)
    # per forward stage, its parameters' secondary partitions (the same rule, stage by stage)
    per_stage = [0] * len(out.stage_acts)
    wdt = dtypes_of(spec).weights
    for p in sets.full.params:
        s = stage_of(desc, p)
        if s < len(per_stage):
            per_stage[s] += engines.zero3_hpz_secondary(lay, wdt, [p.numel]).total()
    if first:
        for t in shared([out.forward_end_transient, out.loss_backward_transient]):
            t.add("zero/hpz_secondary_first_step", first)
        for f in shared(forward):
            f.add("zero/hpz_secondary_first_step", first)
    done = 0
    for i in range(len(per_stage) - 1, -1, -1):
        if done or first:
            t = own(out.stage_backward_transient, i)
            if done:
                t.add("zero/hpz_secondary_partition", done)
            if first > done:
                t.add("zero/hpz_secondary_first_step", first - done)
        done += per_stage[i]


"""The parameter sets one rank holds under a layout (its weights, gradients, optimizer
states, and the unsharded model-parallel set), memoized per layout, with sums over them.

The sets depend on the (memoized, immutable) ParamSet and the layout, not on batch,
sequence or checkpointing, which a search varies most; so do the sums over them, which
`memo` keeps on the sets instead of walking ~700 tensors of a 70B model again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vramplan.components.dtypes import dtypes_of
from vramplan.components.trainable import ParamSet, grad_dtype
from vramplan.parallel.layout import DS_PARAM_PERSISTENCE_THRESHOLD, Layout
from vramplan.parallel.shard import dp_shard, dtensor_embedding_grads, model_parallel_set
from vramplan.spec import JobSpec
from vramplan.units import nbytes


@dataclass(slots=True)
class RankSets:
    weights: ParamSet
    grads: ParamSet
    states: ParamSet
    full: ParamSet
    memo: dict = field(default_factory=dict)
    """Sums over these (immutable) sets, by name: the sets are memoized per layout, so a
    search re-reads each sum instead of walking ~700 tensors again (memo)."""


def memo(sets: RankSets, key, compute):
    hit = sets.memo.get(key)
    if hit is None:
        hit = sets.memo[key] = compute()
    return hit


def grad_bytes(spec: JobSpec, sets: RankSets) -> int:
    """Bytes of every trainable parameter's gradient of the unsharded set (grad_dtype reads
    only the spec's dtypes)."""
    return memo(sets, ("grad_bytes", dtypes_of(spec)),
                lambda: sum(nbytes(p.numel, grad_dtype(spec, p)) for p in sets.full.trainable()))


_SETS: dict[tuple, tuple[ParamSet, RankSets]] = {}


def rank_sets(desc, spec, params, lay: Layout, stage: int, layers: range) -> RankSets:
    """Memoized: the sharded parameter sets depend on the (memoized, immutable) ParamSet and
    the layout, not on batch, sequence or checkpointing, which a search varies most."""
    key = (id(params), lay.tp, lay.ep, lay.pp, lay.dp, lay.shard_group, lay.engine, lay.zero_stage, lay.fsdp,
           lay.fsdp_version, str(sorted(lay.extras.items())), stage, layers.start, layers.stop, lay.dtensor_tp)
    hit = _SETS.get(key)
    if hit is not None and hit[0] is params:
        return hit[1]
    value = _compute_sets(desc, spec, params, lay, stage, layers)
    if len(_SETS) >= 256:
        _SETS.pop(next(iter(_SETS)))
    _SETS[key] = (params, value)
    return value


_SHARDS: dict[tuple, tuple[object, object, ParamSet]] = {}


def _shared(desc, params: ParamSet, key: tuple, compute) -> ParamSet:
    """A sharded set, memoized on its source set (and the model) by identity and the sharding
    that makes it: layouts that differ in ZeRO stage or offload but not in TP/PP/EP share the
    model-parallel set, and those with one shard group its flat shards (and so every term
    memoized on them)."""
    full = (id(desc), id(params)) + key
    hit = _SHARDS.get(full)
    if hit is None or hit[0] is not desc or hit[1] is not params:
        if len(_SHARDS) >= 512:
            _SHARDS.pop(next(iter(_SHARDS)))
        hit = _SHARDS[full] = (desc, params, compute())
    return hit[2]


def _compute_sets(desc, spec, params, lay: Layout, stage: int, layers: range) -> RankSets:
    etp = lay.extras.get("expert_tp")
    mp = _shared(desc, params, ("tp", lay.tp, lay.ep, lay.pp, stage, layers.start, layers.stop, etp),
                 lambda: model_parallel_set(desc, params, tp=lay.tp, ep=lay.ep, pp=lay.pp, stage=stage,
                                            layers=layers, expert_tp=etp))
    n = lay.shard_group
    dim0 = lay.engine == "fsdp" and lay.fsdp_version == 2
    zero3 = lay.engine == "zero" and lay.zero_stage == 3
    persist = int(lay.knob("stage3_param_persistence_threshold", DS_PARAM_PERSISTENCE_THRESHOLD)) if zero3 else 0
    expert_n = max(1, n // lay.ep) if lay.ep > 1 else None

    def flat() -> ParamSet:
        return _shared(None, mp, ("dp", n, dim0, 0, expert_n),
                       lambda: dp_shard(mp, n, per_param_dim0=dim0, expert_n=expert_n))
    # Persistent (small) ZeRO-3 parameters stay gathered; their gradients and optimizer
    # states are still partitioned (stage3.py treats ds_persist params like any other there).
    def flat_w() -> ParamSet:
        return _shared(None, mp, ("dp", n, dim0, persist, expert_n),
                       lambda: dp_shard(mp, n, per_param_dim0=dim0, persist_below=persist, expert_n=expert_n)
                       ) if persist else flat()
    # Every sharding strategy but no-shard keeps only the shard at rest: SHARD_GRAD_OP
    # (FSDP2 reshard_after_forward=False) keeps the unsharded parameters from forward into
    # backward only, and frees them in the post-backward (FSDP1 torch/distributed/fsdp/
    # _runtime_utils.py _post_backward_hook -> _should_free_in_backward is True whenever
    # gradients are synced; FSDP2 _fsdp_param_group.py post_backward -> reshard). Those
    # unsharded layers are the engine term "fsdp/unsharded_layers" (parallel/plan.py _fsdp).
    fsdp_params = lay.fsdp in ("full-shard", "hybrid-shard", "shard-grad-op")
    fsdp_grads = lay.fsdp in ("full-shard", "hybrid-shard", "shard-grad-op")
    grads_mp = mp if lay.tp == 1 or not lay.dtensor_tp else _shared(
        desc, params, ("dtensor-grads", id(mp)), lambda: dtensor_embedding_grads(params, mp))
    # the partitions are made only where the layout keeps one (DDP and TP-only layouts none)
    return RankSets(weights=flat_w() if (zero3 or fsdp_params) else mp,
                    grads=flat() if (lay.zero_stage >= 2 or fsdp_grads) else grads_mp,
                    states=flat() if (lay.zero_stage >= 1 or lay.engine == "fsdp" or _distributed_optimizer(lay))
                    else mp, full=mp)


def _distributed_optimizer(lay: Layout) -> bool:
    """Megatron's distributed optimizer (--use-distributed-optimizer): the fp32 main
    parameters and the optimizer states are partitioned over the data-parallel group with
    context parallelism, while the gradient buffer stays whole on every rank
    (megatron/core/optimizer/distrib_optimizer.py, DistributedOptimizer: each rank owns a
    contiguous range of the grad buffer and steps only its shard of the main params)."""
    return bool(lay.extras.get("distributed_optimizer"))


def units(full: ParamSet, layers: range) -> tuple[dict[int, list], list]:
    """The set's parameters by decoder layer (those of `layers`) and the root's (no layer);
    read only. One pass: a 70B model has ~700 tensors over 80 layers."""
    unit: dict[int, list] = {i: [] for i in layers}
    root = []
    for p in full.params:
        if p.layer is None:
            root.append(p)
        elif p.layer in unit:
            unit[p.layer].append(p)
    return unit, root


def numel(params) -> int:
    return sum(p.numel for p in params)

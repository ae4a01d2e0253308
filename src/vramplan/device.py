"""The device levels of one step, from its tensor events: max_memory_reserved (the live peak
plus the caching allocator's reserve), what nvidia-smi adds outside the allocator (CUDA
context, NCCL communicators, managed memory), the allocator model's replay, and the events
of a single-model step. Shared by the single-model path (vramplan.estimation) and the
multi-model jobs (vramplan.jobs.compose), below both."""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.activations import plan_activations
from vramplan.components.runtime import (
    blas_workspace_terms, cuda_context_bytes, nccl_terms, process_groups, reserved_from_allocated,
)
from vramplan.components.trainable import ParamSet, param_set
from vramplan.model import ModelDesc
from vramplan.spec import Backend, JobSpec, Task
from vramplan.step.build import build_step
from vramplan.step.pieces import tensor_pieces
from vramplan.timeline import Event, StepPlan


def _group(bd: Breakdown, group: str) -> list[int]:
    """Values of the terms in `group`, with or without a model prefix (multi-model jobs key
    them `policy/logits/...`)."""
    return [v for k, v in bd if k.startswith(group + "/") or f"/{group}/" in k]


def reserve_is_replayed(spec: JobSpec) -> bool:
    """Whether the estimate's reserve is the caching allocator model's replay of the step: a
    CUDA training step on one GPU, whose event list holds a tensor per parameter
    (estimation.estimate_model). Sharded plans and the jobs of several models keep the fitted
    reserve (reserved_bytes). The replay need not grow with the micro-batch or the length."""
    return (spec.backend is Backend.CUDA and spec.task is not Task.INFERENCE
            and spec.parallel.is_trivial and spec.num_gpus <= 1)


def device_levels(spec: JobSpec, gpu, events: list[Event], top: Event, managed: int = 0,
                  conf_delta: int = 0, replayed: int | None = None) -> tuple[int, int]:
    """(max_memory_reserved, nvidia-smi) on the CUDA backend (both equal to the live peak on
    cpu): the allocator model's replay of the step (`replayed`, one GPU) or allocated plus
    the fitted reserve (`reserved_bytes`), then the CUDA context and managed (paged) memory
    resident on the GPU."""
    peak = top.live.total()
    if spec.backend is not Backend.CUDA:
        return peak, peak
    reserved = max(peak, replayed) if replayed is not None else reserved_bytes(events, top, conf_delta)
    return reserved, reserved + outside_allocator(spec, gpu, managed).total()


def reserved_bytes(events: list[Event], top: Event, conf_delta: int = 0) -> int:
    """max_memory_reserved: the live peak plus the allocator's reserve around the largest
    single logits-sized block and the activation bytes churned at the peak and at the start
    of backward (components/runtime.py), plus `conf_delta`, what the spec's alloc_conf
    changes in the allocator model's replay (vramplan.allocator) against PyTorch's defaults.

    Used where the replay is not: sharded and parallel plans (their event lists hold one
    flat tensor per term) and the jobs of several models. On one GPU the estimate takes the
    replay of the per-parameter event list instead (estimation.estimate_model), the closer of
    the two wherever a GPU has measured it (reserved, median |err|, replay against this
    reserve): H100 grid 133 cases 0.79% / 4.49%, H100 catalog-size 6 cases 0.54% / 7.8% and
    4 allocator-option cases 0.35% / 16.3%, H200 published shapes 7 cases 0.55% / 2.45%, H200
    grid 28 cases 1.6% / 6.6% (bench/cuda/README.md); on the published single-model rows
    6.6% / 7.3% (reserved) and 5.1% / 1.8% (nvidia-smi, where this reserve was fitted on the
    2022 BERT-large V100 runs; bench/allocator/score_replay.py)."""
    ends = [e for e in events if e.label.startswith(("end of forward", "loss backward"))]
    # Each event's terms in the three groups, summed from its distinct parts (the peak's
    # from its live set), each part's group terms found once: the values _group(e.live, ...)
    # reads, without merging every part of every event.
    memo: dict[int, tuple] = {}
    seen = {id(e): _reserve_terms(e, memo) for e in [top, *ends]}
    largest = max((v for e in ends for v in seen[id(e)][0].values()), default=0)
    loss_bwd = [e for e in ends if e.label.startswith("loss backward")]
    churn = max(seen[id(e)][1] for e in [top, *loss_bwd])
    # never below the live peak: every allocated byte sits in a reserved segment (a replay
    # delta larger than the reserve itself is a replay that did not model the step)
    return max(top.live.total(), reserved_from_allocated(top.live.total(), largest, churn) + conf_delta)


_GROUP_KEYS: dict[str, set[str]] = {"logits": set(), "activations": set(), "backward": set()}
_CLASSIFIED: set[str] = set()


def _reserve_terms(event: Event, memo: dict[int, tuple]) -> tuple[dict[str, int], int]:
    """(the logits terms alive at `event`, the bytes of its activations and backward terms,
    a term in both counted in both), as _group(event.live, ...) gives them."""
    logits: dict[str, int] = {}
    churn = 0
    distinct, counts = event.distinct_parts()
    for p in distinct:
        hit = memo.get(id(p))
        if hit is None:
            hit = memo[id(p)] = _part_groups(p.terms)
        n = counts[id(p)]
        for k, v in hit[0]:
            logits[k] = logits.get(k, 0) + v * n
        churn += hit[1] * n
    return logits, churn


def _part_groups(terms: dict[str, int]) -> tuple[list[tuple[str, int]], int]:
    """One part's logits terms and its activations-plus-backward bytes (zero terms left out,
    as a merge leaves them)."""
    new = terms.keys() - _CLASSIFIED
    if new:
        if len(_CLASSIFIED) > 65536:  # term names are few; bound the memo all the same
            _CLASSIFIED.clear()
            for keys in _GROUP_KEYS.values():
                keys.clear()
            new = set(terms)
        for key in new:
            for group, keys in _GROUP_KEYS.items():
                if key.startswith(group + "/") or f"/{group}/" in key:
                    keys.add(key)
        _CLASSIFIED.update(new)
    logits = [(k, int(terms[k])) for k in terms.keys() & _GROUP_KEYS["logits"] if terms[k]]
    churn = sum(map(int, map(terms.__getitem__, terms.keys() & _GROUP_KEYS["activations"])))
    churn += sum(map(int, map(terms.__getitem__, terms.keys() & _GROUP_KEYS["backward"])))
    return logits, churn


def step_events(spec: JobSpec):
    """The tensor events (vramplan.step.StepEvents) of one training step of a single-model,
    single-GPU job, tensors split per parameter: what the allocator model replays, and
    what bench/allocator/replay_cuda.py replays on a real GPU."""
    from vramplan.sources import resolve_model
    from vramplan.step import build_events
    desc = resolve_model(spec)
    params = param_set(desc, spec)
    plan = build_step(desc, spec, params, plan_activations(desc, spec, params))
    if spec.backend is Backend.CUDA:
        from vramplan.catalog import find_gpu
        gpu = find_gpu(spec.gpu) if spec.gpu else None
        for key, value in blas_workspace_terms(gpu.name if gpu else None):
            plan.static.add(key, value)
    return build_events(plan, tensor_pieces(desc, params, plan))


def allocator_replayer(spec: JobSpec, gpu, plan: StepPlan, desc: ModelDesc, params: ParamSet | None,
                       outside: int = 0):
    """A function (default=False) -> AllocatorResult: the caching allocator
    (vramplan.allocator) replaying the step's tensor events (vramplan.step) over several
    steps with spec.alloc_conf's options (or PyTorch's defaults). `params`: split the
    persistent terms and gradients into per-parameter tensors (single-GPU plans). With a
    GPU named, the allocator may reserve its memory less the CUDA context and `outside`
    (managed memory): a step that needs more frees its cached blocks and retries, as malloc
    does; one that still does not fit reports its unconstrained reserve."""
    ops: list = []

    def run(default: bool = False):
        # imported when replayed: most estimates (a search's) never replay
        from vramplan.allocator import replay
        from vramplan.spec.alloc_conf import parse_alloc_conf
        from vramplan.step import build_events
        if not ops:
            pieces = tensor_pieces(desc, params, plan) if params is not None else None
            events = build_events(plan, pieces)
            ops.extend(events.compact())
            ops.append(events.first_step() if events.lazy else None)
        conf = parse_alloc_conf(None if default else spec.alloc_conf)
        capacity = replay_capacity(spec, gpu, outside)  # here: most estimates never replay
        result = replay(ops[0], ops[1], conf, capacity, first=ops[2])
        return replay(ops[0], ops[1], conf, None, first=ops[2]) if result.out_of_memory else result
    return run


def replay_capacity(spec: JobSpec, gpu, outside: int = 0) -> int | None:
    """What the caching allocator may reserve on the named GPU: its memory less what
    nvidia-smi counts outside the allocator and `outside` (managed memory); None without one."""
    return None if gpu is None else gpu.memory_bytes - outside_allocator(spec, gpu).total() - outside


def outside_allocator(spec: JobSpec, gpu, managed: int = 0) -> Breakdown:
    """What nvidia-smi counts beyond max_memory_reserved, each term from its source
    (components/runtime.py, catalog/cuda_runtime.json): the CUDA context, the NCCL
    communicators of every process group, and CUDA managed (paged) memory resident on the
    GPU. Empty on the cpu backend."""
    out = Breakdown()
    if spec.backend is not Backend.CUDA:
        return out
    out.add("runtime/cuda_context", cuda_context_bytes(gpu.name if gpu else None, spec.cuda_version))
    if spec.num_gpus > 1:
        from vramplan.parallel.layout import Layout
        lay = Layout.of(spec)
        groups = process_groups(spec.num_gpus, dp=lay.dp, tp=lay.tp, cp=lay.cp, pp=lay.pp, ep=lay.ep,
                                shard_group=lay.shard_group if lay.engine in ("fsdp", "zero") else None)
        for key, value in nccl_terms(groups, getattr(gpu, "interconnect", None)):
            out.add(key, value)
    if managed:
        out.add("managed/optimizer_paged", managed)
    return out

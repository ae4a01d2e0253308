"""Per-rank StepPlan: the single-GPU plan with model states sharded, activations divided and
the engines' buffers added. The worst pipeline stage is the rank reported."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from vramplan.breakdown import Breakdown, own, shared
from vramplan.components.dtypes import dtypes_of
from vramplan.components.float8 import gathered_in_float8
from vramplan.components.optimizer import heads_of, optimizer_states, state_key, step_temporaries
from vramplan.components.trainable import ParamSet, grad_dtype
from vramplan.components.memo import cached
from vramplan.components.weights import gradient_stages, gradient_stages_at_peak, stage_of, weight_terms
from vramplan.model import ModelDesc
from vramplan.parallel import activations as acts
from vramplan.parallel import engines
from vramplan.parallel.fsdp import dtensor_embedding_grad, fsdp1_largest_piece, fsdp_buffers
from vramplan.parallel.comm import volumes
from vramplan.parallel.host import host_notes, host_per_node
from vramplan.parallel.layout import Layout
from vramplan.parallel.pipeline import pipeline_buffers
from vramplan.parallel.sets import RankSets, grad_bytes, memo, numel, rank_sets, units
from vramplan.parallel.shard import pp_layers
from vramplan.parallel.zero3 import zero3_buffers
from vramplan.spec import JobSpec
from vramplan.timeline import StepPlan, peak_total
from vramplan.units import nbytes


@dataclass(slots=True)
class ParallelReport:
    layout: Layout
    stage: int
    """Pipeline stage of the reported (worst) rank."""
    stage_peaks: list[int] | None
    """Each pipeline stage's allocated peak; None without a pipeline (pp 1): the one
    stage's peak is then the step's own (result.Estimate reports it), not walked twice."""
    communication: dict[str, dict]
    host: Breakdown
    notes: list[str] = field(default_factory=list)

    @property
    def host_per_node(self) -> int:
        """Host bytes of one node: ranks per node x the reported rank's host bytes."""
        return host_per_node(self.layout, self.host.total())

    def to_dict(self) -> dict:
        return {**self.layout.to_dict(), "reported_pp_stage": self.stage,
                "pp_stage_peaks": None if self.stage_peaks is None else list(self.stage_peaks),
                "notes": list(self.notes)}


def rank_plan(desc: ModelDesc, spec: JobSpec, params: ParamSet, plan: StepPlan) -> tuple[StepPlan, ParallelReport]:
    lay = Layout.of(spec, desc.hidden_size)
    ranges = pp_layers(desc.num_layers, lay.pp, lay.extras.get("pp_layers"))
    plans = [_worst_backward(desc, spec, params, plan, lay, r, ranges[r]) for r in range(lay.pp)]
    peaks = [peak_total(p) for p, _ in plans] if lay.pp > 1 else None
    worst = max(range(lay.pp), key=lambda r: peaks[r]) if peaks else 0
    best_plan, sets = plans[worst]
    comm = _volumes(desc, spec, lay, sets, ranges[worst])
    host = _host(spec, lay, sets)
    report = ParallelReport(lay, worst, peaks, comm, host, notes=host_notes(lay, host.total()))
    best_plan.sharded_prefixes, best_plan.parallel = ("",), report
    return best_plan, report


def _volumes(desc: ModelDesc, spec: JobSpec, lay: Layout, sets: RankSets, layers: range) -> dict[str, dict]:
    """The communication of the rank holding `sets` and `layers` (parallel/comm.py volumes)."""
    return volumes(desc, spec, lay, *_traffic(desc, spec, sets, layers))


def _traffic(desc: ModelDesc, spec: JobSpec, sets: RankSets, layers: range) -> tuple[int, int, int, int]:
    """What parallel/comm.py volumes reads of a rank: its parameter and gradient bytes, its
    layers and MoE layers."""
    w = memo(sets, "weight_bytes", lambda: sum(nbytes(p.numel, p.dtype) for p in sets.full.params))
    moe = len([i for i in layers if i in desc.moe_layers])
    return w, grad_bytes(spec, sets), len(layers), moe


def stage_traffic(desc: ModelDesc, spec: JobSpec, params: ParamSet) -> tuple[Layout, list[tuple]] | None:
    """The layout and, per pipeline stage, what its communication reads (`_traffic`); these
    depend on the layout and the parameter sets, not on batch, sequence or checkpointing,
    so a search keeps them per family of layouts. None where rank_plan is not run (one
    GPU, no sharding)."""
    if spec.parallel.is_trivial and spec.num_gpus <= 1:
        return None
    lay = Layout.of(spec, desc.hidden_size)
    ranges = pp_layers(desc.num_layers, lay.pp, lay.extras.get("pp_layers"))
    return lay, [_traffic(desc, spec, rank_sets(desc, spec, params, lay, r, ranges[r]), ranges[r])
                 for r in range(lay.pp)]


def stage_model_states(desc: ModelDesc, spec: JobSpec, params: ParamSet) -> list[tuple[int, int]]:
    """Per pipeline stage: the bytes of `_model_states` (weights, optimizer states and master
    weights the rank keeps on the GPU) and of the engines' persistent copies `_engine_buffers`
    adds to them (DDP's gradient buckets, ZeRO's fp32 partition), all in the stage's static
    part, which every event of the stage holds; and the gradients the rank's grads_by_stage
    hold after `_engine_buffers` where those are the stage's own gradient list or its total
    (no pipeline; DDP, a single rank, ZeRO-1/2 not offloaded: ZeRO-3, FSDP and offload
    replace them), else 0. plan/floor.py bounds device memory with them. Depends on the
    layout and the parameter sets only."""
    lay = Layout.of(spec, desc.hidden_size)
    ranges = pp_layers(desc.num_layers, lay.pp, lay.extras.get("pp_layers"))
    heads = heads_of(desc)
    own_grads = lay.pp == 1 and not _grads_offloaded(lay) and (
        lay.engine in ("ddp", "single") or (lay.engine == "zero" and lay.zero_stage in (1, 2)))
    out = []
    for r in range(lay.pp):
        sets = rank_sets(desc, spec, params, lay, r, ranges[r])
        held = _model_states(spec, lay, sets, heads).total()
        if lay.engine == "ddp":
            held += engines.ddp_buckets(lay, grad_bytes(spec, sets)).total()
        elif lay.engine == "zero" and lay.offload_optimizer == "none":
            held += engines.zero_fp32_partition(dtypes_of(spec).master_weights is not None, memo(
                sets, "states_numel", lambda: numel(sets.states.trainable()))).total()
        grads = 0
        if own_grads:
            grads = sum(g.total() for g in cached(sets.grads, ("grads", dtypes_of(spec)),
                                                  lambda: gradient_stages(desc, spec, sets.grads)))
        out.append((held, grads))
    return out


def communication_floor(desc: ModelDesc, spec: JobSpec, lay: Layout, stages: list[tuple]) -> dict[str, dict] | None:
    """A lower bound, per collective, on the `communication` rank_plan reports for `spec`,
    known without planning the step: the least volume of any pipeline stage (`stages`:
    stage_traffic's; the reported rank is the stage with the highest memory peak, which
    only the step's plan knows). None where the stages' collectives differ in name (then
    no per-name floor holds) or there are none."""
    per_stage = [volumes(desc, spec, lay, *t) for t in stages]
    names = list(per_stage[0])
    if not names or any(list(v) != names for v in per_stage):
        return None
    return {k: {"bytes": min(v[k]["bytes"] for v in per_stage)} for k in names}


def _select(items: list, stage: int, pp: int, layers: range) -> list:
    """Forward stages (embedding, layers..., head) that live on a pipeline stage."""
    first, last = stage == 0, stage == pp - 1
    out = [items[0]] if first else []
    out += items[layers.start + 1:layers.stop + 1] if layers.step == 1 else [items[i + 1] for i in layers]
    if last:
        out.append(items[-1])
    return out


def _worst_backward(desc, spec, params, plan: StepPlan, lay: Layout, stage: int, layers: range):
    """A pipeline stage holds k = acts.pipeline_in_flight micro-batches. Its first backward
    runs with all k alive and no gradients yet; later ones with the gradients accumulated and
    k alive while the schedule keeps k in flight (M > k, 1F1B's steady state), else one fewer
    (GPipe: all forwards, then the backwards free one micro-batch each). The worse of the two."""
    k, m = acts.pipeline_in_flight(lay, stage, spec.grad_accum_steps), spec.grad_accum_steps
    if lay.pp == 1 or m <= 1:
        return _stage_plan(desc, spec, params, plan, lay, stage, layers, k - 1)
    first, sets = _stage_plan(desc, spec, params, replace(plan, grads_alive_in_forward=False), lay, stage, layers, k - 1)
    if sets.grads is sets.full and not _grads_offloaded(lay):  # a layer's own gradients as its backward makes them
        first.stage_grads_at_peak = _select(cached(sets.grads, ("grads_at_peak", dtypes_of(spec)), lambda: (
            gradient_stages_at_peak(desc, spec, sets.grads))), stage, lay.pp, layers)
    later = _stage_plan(desc, spec, params, plan, lay, stage, layers, k - 1 if m > k else max(k - 2, 0))
    return max((first, sets), later, key=lambda p: peak_total(p[0]))


def _stage_plan(desc, spec, params, plan: StepPlan, lay: Layout, stage: int, layers: range, others_n: float):
    sets = rank_sets(desc, spec, params, lay, stage, layers)
    last = stage == lay.pp - 1
    static = _model_states(spec, lay, sets, heads_of(desc))
    static.add("batch/input_ids", -(-plan.static.total("batch/") // lay.seq_shards))
    if plan.static.terms.get("weights/buffers"):  # non-parameter buffers stay whole on every rank
        static.add("weights/buffers", plan.static.terms["weights/buffers"])
    grads = _select(cached(sets.grads, ("grads", dtypes_of(spec)), lambda: gradient_stages(desc, spec, sets.grads)),
                    stage, lay.pp, layers)
    if _grads_offloaded(lay):
        # The sharded gradient goes to host memory as soon as it is reduced: DeepSpeed's
        # offload_optimizer copies each reduced partition into the pinned fp32 gradient
        # buffer (stage_1_and_2.py async_inplace_copy_grad_to_fp32_buffer_from_gpu;
        # stage3.py partition_grads -> offload); FSDP2's CPUOffloadPolicy moves the sharded
        # gradient to CPU after reduce-scatter (_fsdp_param_group.post_backward). Only the
        # engine's buckets stay on the GPU.
        grads = [Breakdown() for _ in grads]
    # Layers share their breakdowns (build_step): each distinct one is scaled once. The
    # transients get their own scaler (added to below, they must not alias the activations):
    # what every layer gets is added once per distinct transient (breakdown.shared), and
    # what one layer gets goes to its own copy (breakdown.own).
    sc, st = _scaler(lay, desc.num_kv_heads), _scaler(lay, desc.num_kv_heads)
    stage_acts = [sc(b) for b in _select(plan.stage_acts, stage, lay.pp, layers)]
    trans = [st(b) for b in _select(plan.stage_backward_transient, stage, lay.pp, layers)]
    labels = _select(plan.labels or [f"stage {i}" for i in range(len(plan.stage_acts))], stage, lay.pp, layers)
    # The other micro-batches' saved activations live through forward and backward, not into
    # the optimizer step (the schedule has run every backward by then).
    others = Breakdown()
    if others_n > 0:
        # on the last stage each micro-batch's loss is computed after its forward and keeps
        # what the loss saves (torch pipelining schedules.py _maybe_compute_loss)
        one = sum(b.total() for b in stage_acts) + (acts.scale(plan.loss_saved, lay).total() if last else 0)
        others.add("activations/pipeline_in_flight", int(others_n * one))
    fwd_end = (acts.scale(plan.forward_end_transient, lay) if last else Breakdown()).merge(others)
    loss_bwd = (acts.scale(plan.loss_backward_transient, lay) if last else Breakdown()).merge(others)
    for t in shared(trans):
        t.merge(others)
    out = StepPlan(static=static, grads_by_stage=grads, stage_acts=stage_acts,
                   loss_saved=acts.scale(plan.loss_saved, lay) if last else Breakdown(),
                   forward_end_transient=fwd_end, loss_backward_transient=loss_bwd,
                   stage_backward_transient=trans,
                   stage_acts_at_peak=[sc(b) for b in
                                       _select(plan.stage_acts_at_peak or plan.stage_acts, stage, lay.pp, layers)],
                   optimizer_temporaries=Breakdown() if lay.offload_optimizer != "none"
                   else cached(sets.states, ("temporaries",) + state_key(spec),
                               lambda: step_temporaries(spec, sets.states)),
                   grads_alive_in_forward=plan.grads_alive_in_forward, labels=labels,
                   in_backward=None if plan.in_backward is None
                   else _select(plan.in_backward, stage, lay.pp, layers),
                   stage_forward_transient=None if plan.stage_forward_transient is None
                   else [sc(b) for b in _select(plan.stage_forward_transient, stage, lay.pp, layers)])
    _engine_buffers(desc, spec, lay, sets, out, stage, layers, params)
    return out, sets


def _scaler(lay: Layout, kv_heads: int):
    """acts.scale, once per distinct Breakdown object it is handed."""
    scaled: dict[int, Breakdown] = {}

    def sc(b: Breakdown) -> Breakdown:
        if id(b) not in scaled:
            scaled[id(b)] = acts.scale(b, lay, kv_heads)
        return scaled[id(b)]
    return sc


def _grads_offloaded(lay: Layout) -> bool:
    if lay.engine == "fsdp":
        return lay.offload_params != "none"
    return lay.offload_optimizer != "none"


def _model_states(spec: JobSpec, lay: Layout, sets: RankSets, heads: tuple[int, int] | None = None) -> Breakdown:
    """Weights, optimizer states and master weights one GPU keeps. Offloaded ones live in
    host memory instead (DeepSpeed offload_optimizer / offload_param, FSDP CPUOffload)."""
    out = Breakdown()
    if lay.offload_params == "none":
        out.merge(cached(sets.weights, ("weights", spec.quantization), lambda: weight_terms(spec, sets.weights)))
    if lay.offload_optimizer == "none":
        key = ("states",) + state_key(spec)
        states = cached(sets.states, key, lambda: optimizer_states(spec, sets.states, heads))
        for name, value in states:  # paged state is managed memory, outside the allocator
            if not name.startswith("optimizer_paged"):
                out.add(name, value)
    return out


def _host(spec: JobSpec, lay: Layout, sets: RankSets) -> Breakdown:
    """Host RAM per rank: DeepSpeed CPU offload keeps the fp32 master partition, the
    optimizer states and an fp32 gradient partition on the host (runtime/zero/
    stage_1_and_2.py: single_partition_of_fp32_groups and its .grad in pinned memory when
    cpu_offload; DeepSpeedCPUAdam steps there); offload_param keeps the 16-bit partition
    (runtime/zero/partition_parameters.py, ds_tensor on cpu). NVMe moves them to disk,
    keeping swap buffers (aio buffer_count x buffer_size) in pinned host memory."""
    out = Breakdown()
    if lay.offload_optimizer == "cpu":
        out.merge(cached(sets.states, ("states", None) + state_key(spec), lambda: optimizer_states(spec, sets.states)),
                  prefix="host/")
        out.add("host/fp32_grad_partition", nbytes(memo(sets, "states_numel", lambda: numel(sets.states.trainable())),
                                                   "fp32"))
    elif lay.offload_optimizer == "nvme":
        out.add("host/nvme_swap_buffers", int(lay.knob("buffer_count", 4)) * int(lay.knob("buffer_size", 100_000_000)) * 4)
    if lay.offload_params == "cpu":
        out.merge(weight_terms(spec, sets.weights), prefix="host/")
    return out


def _wbytes(spec: JobSpec, params: ParamSet) -> int:
    return nbytes(1, params.params[0].dtype) if params.params else 2


def _engine_buffers(desc, spec, lay: Layout, sets: RankSets, out: StepPlan, stage: int, layers: range,
                    params: ParamSet) -> None:
    full = sets.full
    train = full.trainable()
    gdt = grad_dtype(spec, train[0]) if train else dtypes_of(spec).weights
    wb, gb = _wbytes(spec, full), nbytes(1, gdt)
    n = lay.shard_group
    unit, root = memo(sets, ("units", layers.start, layers.stop), lambda: units(full, layers))
    if lay.engine == "ddp":
        out.static.merge(engines.ddp_buckets(lay, grad_bytes(spec, sets)))
    elif lay.engine == "zero":
        _zero(desc, spec, lay, sets, out, unit, root, gdt, gb)
        if lay.zero_stage == 1 and not _grads_offloaded(lay):
            out.step_grads = engines.zero1_step_grads(_select(cached(
                sets.states, ("grads", dtypes_of(spec)), lambda: gradient_stages(desc, spec, sets.states)),
                stage, lay.pp, layers))
        if (lay.zero_stage == 2 and lay.knob("contiguous_gradients", True) and not _grads_offloaded(lay)
                and not out.grads_alive_in_forward and lay.pp == 1):
            _zero2_first_reduction(desc, spec, sets, out, lay, gb)
    elif lay.engine == "fsdp" and lay.fsdp != "no-shard":
        at_peak = _select(cached(sets.full, ("grads_at_peak", dtypes_of(spec)), lambda: (
            gradient_stages_at_peak(desc, spec, sets.full))), stage, lay.pp, layers)
        whole = dtensor_embedding_grad(spec, params) if lay.tp > 1 and lay.dtensor_tp and lay.fsdp_version == 2 else 0
        fsdp_buffers(lay, out, unit, root, layers, stage, wb, gb, n, at_peak, whole,
                     gathered_in_float8(spec, desc.model_type))
        if lay.fsdp_version == 1 and "temporaries/optimizer/forloop_denom" in out.optimizer_temporaries.terms:
            # AdamW's per-parameter loop steps FSDP1's uneven pieces (fsdp.fsdp1_largest_piece)
            piece = fsdp1_largest_piece(unit, root, n)
            if piece is not None:
                denom = step_temporaries(spec, ParamSet((piece,), ())).terms.get("temporaries/optimizer/forloop_denom", 0)
                out.optimizer_temporaries.terms["temporaries/optimizer/forloop_denom"] = denom
    if lay.cp > 1:
        kv = 4 * nbytes(spec.micro_batch_size * (spec.seq_len // lay.seq_shards) * desc.num_kv_heads * desc.head_dim,
                        dtypes_of(spec).compute)
        for t in shared(out.stage_backward_transient):
            t.add("cp/ring_kv_buffers", kv)
    if lay.pp > 1:
        pipeline_buffers(desc, spec, lay, out, stage)


def _zero2_first_reduction(desc, spec, sets: RankSets, out: StepPlan, lay: Layout, gb: int) -> None:
    """ZeRO-2's gradients on the rank that owns the head: none beyond the ipg bucket until
    the first bucket is reduced, then the whole partition buffer (engines.zero2_first_bucket,
    engines.zero2_first_reduction); with one bucket for the whole model nothing changes."""
    full = cached(sets.full, ("grads", dtypes_of(spec)), lambda: gradient_stages(desc, spec, sets.full))
    if len(full) != len(out.grads_by_stage):
        return
    at = engines.zero2_first_bucket(lay, [g.total() // gb for g in full])
    if at is None:
        return
    part = Breakdown()
    for g in out.grads_by_stage:
        part.merge(g)
    largest = memo(sets, ("largest_trainable", at), lambda: max(
        (p.numel for p in sets.full.trainable() if stage_of(desc, p) == at), default=0))
    own = (out.stage_acts_at_peak or out.stage_acts)[at]
    out.stage_backward_moment = [None] * len(out.grads_by_stage)
    out.stage_backward_moment[at] = engines.zero2_first_reduction(own, out.stage_backward_transient[at],
                                                                  part.total(), largest * gb)
    out.grads_by_stage = [part if i == at else Breakdown() for i in range(len(out.grads_by_stage))]
    out.stage_grads_at_peak = [Breakdown() for _ in out.grads_by_stage]


def _zero(desc, spec, lay: Layout, sets: RankSets, out: StepPlan, unit: dict, root: list, gdt: str, gb: int) -> None:
    """DeepSpeed ZeRO's own buffers on one rank (parallel/engines.py, from DeepSpeed 0.19's
    runtime/zero sources; checked against the real engine in bench/parallel/deepspeed_cpu.py)."""
    full, train = sets.full, sets.full.trainable()
    states_numel = memo(sets, "states_numel", lambda: numel(sets.states.trainable()))
    if lay.offload_optimizer == "none":
        out.static.merge(engines.zero_fp32_partition(dtypes_of(spec).master_weights is not None, states_numel))
        out.optimizer_temporaries = engines.zero_flat_step(out.optimizer_temporaries, states_numel)
    if lay.zero_stage in (1, 2):
        # The ipg buffer appears at the first gradient hook: every layer's backward, not the
        # loss backward (engines.zero12_ipg_buffer).
        ipg = engines.zero12_ipg_buffer(lay, gdt)
        flat = engines.zero12_reduce_flat(lay, gdt, memo(sets, "trained_numel", lambda: numel(train)))
        # ZeRO-2 reduces a bucket whenever it fills during backward; ZeRO-1 (and ZeRO-2 when
        # the whole model fits in one bucket) reduces in the backward epilogue, after the
        # last (embedding) stage: engine.allreduce_gradients -> reduce_gradients /
        # overlapping_partition_gradients_reduce_epilogue. The meter's traces show a bucket
        # flattened during backward never at a layer's peak (it runs in an AccumulateGrad
        # hook, between the layer's backward ops) but the epilogue's at the end-of-backward
        # peak, so the flatten is counted in the epilogue only.
        if lay.offload_optimizer == "none":
            out.optimizer_temporaries.merge(engines.zero12_step_grad(states_numel))
        for t in shared(out.stage_backward_transient):
            t.merge(ipg)
        own(out.stage_backward_transient, 0).merge(flat)
        return
    zero3_buffers(desc, spec, lay, sets, out, unit, root, gdt, gb)

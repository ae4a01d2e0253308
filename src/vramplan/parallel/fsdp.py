"""FSDP's own memory on one rank: the unsharded units, the all-gather and reduce-scatter
buffers and the unsharded gradients, placed at the moments of the step where torch's FSDP2
(torch/distributed/fsdp/_fully_shard) and FSDP1 (torch/distributed/fsdp/_runtime_utils.py)
hold them. Measured with the real wrappers on gloo and on the fake process group
(bench/parallel/fsdp2_cpu.py, fsdp2_fake.py)."""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.trainable import HeldParam, grad_dtype
from vramplan.parallel import engines
from vramplan.parallel.layout import Layout
from vramplan.parallel.sets import numel
from vramplan.timeline import StepPlan
from vramplan.units import nbytes


def padded(params, n: int, dim0: bool) -> int:
    """Elements of `params` once FSDP pads them for n ranks: FSDP2 pads each parameter's dim 0
    (engines.padded), FSDP1 the flat parameter."""
    if dim0:
        total = 0
        for p in params:
            rows = p.shape[0] if p.shape else 1
            total += -(-rows // n) * n * (p.numel // max(rows, 1))
        return total
    count = numel(params)
    return -(-count // n) * n


def gathered_bytes(params, n: int, dim0: bool, wb: int, float8=None) -> int:
    """Bytes of `params` once gathered (FSDP's all-gather output, the unsharded parameters):
    `wb` per padded element, one for a weight FSDP2 gathers in float8 (`float8`, a predicate
    from components/float8.py gathered_in_float8: torchao's fsdp_pre_all_gather hands FSDP the
    shard's float8 `_data`, and fsdp_post_all_gather makes the unsharded weight a
    Float8TrainingTensor over the gathered bytes, torchao/float8/fsdp_utils.py). FSDP2 pads
    each parameter on dim 0 (padded); a group of mixed dtypes is gathered as one uint8 buffer
    of the same total bytes (_fsdp_collectives.py foreach_all_gather)."""
    if float8 is None:
        return padded(params, n, dim0) * wb
    fp8 = [p for p in params if float8(p)]
    return padded(fp8, n, dim0) + padded([p for p in params if not float8(p)], n, dim0) * wb


def fsdp_buffers(lay: Layout, out: StepPlan, unit: dict, root: list, layers: range, stage: int,
                 wb: int, gb: int, n: int, grads_at_peak: list[Breakdown], whole_embedding_grad: int = 0,
                 float8=None) -> None:
    """FSDP with every decoder layer wrapped and the root wrapping the rest (the
    transformer auto-wrap policy of accelerate / torchtitan's per-block fully_shard).
    The root is not resharded after forward (FSDP2 _fsdp_state.py _lazy_init sets the
    root's post_forward_mesh_info to None; FSDP1 _runtime_utils.py skips the root in
    _post_forward_reshard), so its unsharded parameters live from forward to the end of
    backward, and its full gradients until its post-backward reduce-scatter at the end.
    `grads_at_peak`: per forward stage, the unsharded gradients its backward has made by
    its peak (components/weights.py gradient_stages_at_peak over the unsharded set).
    `whole_embedding_grad`: bytes of the whole-vocabulary embedding gradient a DTensor
    tensor-parallel embedding makes (dtensor_embedding_grad), else 0. `float8`: the
    gathered_bytes predicate of FSDP2's float8 all-gather, else None. `sizes` are bytes."""
    dim0 = lay.fsdp_version == 2
    # each layer's transient gets its own terms below: one object per stage
    out.stage_backward_transient = [Breakdown(dict(t.terms)) for t in out.stage_backward_transient]
    sizes = {i: gathered_bytes(unit[i], n, dim0, wb, float8) for i in layers}
    gsizes = {i: padded([p for p in unit[i] if p.trainable], n, dim0) for i in layers}
    root_w = gathered_bytes(root, n, dim0, wb, float8)
    root_g = padded([p for p in root if p.trainable], n, dim0) * gb
    # Backward writes the head's (and final norm's) gradients first, the untied
    # embedding's last (components/weights.py stage_of).
    head_g = padded([p for p in root if p.trainable and not _is_embedding(p)], n, dim0) * gb
    keep_all = lay.fsdp == "shard-grad-op"
    root_terms = Breakdown().add("fsdp/root_unsharded_params", root_w)
    fwd = Breakdown().merge(root_terms)
    if keep_all:
        fwd.add("fsdp/unsharded_layers", sum(sizes.values()))
    out.loss_backward_transient.merge(fwd)
    order = list(layers)
    if order and not keep_all:
        # The root's pre-backward hook fires on the loss's gradient and prefetches the last
        # layer (FSDP2 _fsdp_param_group.py pre_backward -> _backward_prefetch: its
        # all-gather output; FSDP1 BACKWARD_PRE _runtime_utils.py _pre_backward_hook ->
        # _prefetch_handle: its unsharded FlatParameter), alive through the loss backward.
        out.loss_backward_transient.add("fsdp/prefetch_all_gather", sizes[order[-1]])
    if dim0 and order:
        # FSDP2 frees a layer's all-gather output in forward only at the next unit's
        # wait_for_unshard (_fsdp_param_group.py: with a synchronous all-gather in forward
        # the result is kept in comm_ctx.all_gather_state "to overlap the copy-out with the
        # next all-gather"); the last layer's lives until the root's post-forward
        # (_fsdp_state.py FSDPState._post_forward), after the head and the loss.
        fwd.add("fsdp/forward_all_gather_output", sizes[order[-1]])
    out.forward_end_transient.merge(fwd)
    first = 1 if stage == 0 else 0
    if out.stage_forward_transient is not None:
        _forward_stages(out.stage_forward_transient, first, order, sizes, root_terms, dim0, keep_all)
    for j, i in enumerate(order):
        t = out.stage_backward_transient[first + j]
        # The layer's unsharded gradients so far (unsharded_param.grad); its sharded
        # gradient appears only at its post-backward (see engines.fsdp_backward_stage).
        t.add("fsdp/unsharded_grads", grads_at_peak[first + j].total())
        # (other micro-batches in flight on a pipeline stage stay alive past the layer's
        # compute peak: not part of what its post-backward frees)
        compute = (t.total() - t.terms.get("activations/pipeline_in_flight", 0)
                   + (out.stage_acts_at_peak or out.stage_acts)[first + j].total())
        t.merge(engines.fsdp_backward_stage(sizes[i], sizes.get(i - 1, 0), gsizes.get(i + 1, 0), gsizes[i],
                                            1, gb, compute, prefetch=not keep_all, version=lay.fsdp_version,
                                            gloo=_gloo(lay), shards=n))
        t.merge(root_terms).add("fsdp/root_unsharded_grads", head_g)
        if keep_all:
            t.add("fsdp/unsharded_layers", sum(sizes[k] for k in order if k < i))
    if stage == lay.pp - 1:
        out.stage_backward_transient[-1].merge(root_terms).add("fsdp/root_unsharded_grads", head_g)
        if order and not keep_all:
            # the last layer's prefetched all-gather output (above) waits for that layer's
            # pre-backward copy-out, so the head's backward runs beside it too
            out.stage_backward_transient[-1].add("fsdp/prefetch_all_gather", sizes[order[-1]])
    if lay.pp == 1 and not out.grads_alive_in_forward:
        # The root's sharded gradients (views of its reduce-scatter output) exist only after
        # its post-backward, which runs after the last backward stage: alive in the step.
        for k in (0, -1):
            out.optimizer_temporaries.merge(out.grads_by_stage[k])
            out.grads_by_stage[k] = Breakdown()
    # A layer's sharded gradient is the output of its reduce-scatter: none of it exists at
    # the layer's compute peak (what its backward has made by then is the unsharded
    # gradients above). The root's stages keep theirs.
    out.stage_grads_at_peak = [Breakdown() if first <= k < first + len(order) else g
                               for k, g in enumerate(out.grads_by_stage)]
    if stage == 0:
        # The root's post-backward at the end of backward. Both versions reshard before they
        # reduce: FSDP2 _fsdp_param_group.py FSDPParamGroup.post_backward calls
        # self.reshard() and only then foreach_reduce (_fsdp_collectives.py), which
        # allocates the padded reduce-scatter input, copies the unsharded gradients in
        # (foreach_reduce_scatter_copy_in) and clears them; FSDP1 _runtime_utils.py
        # _post_backward_hook calls _post_backward_reshard before _reduce_grad, which
        # reduce-scatters the padded flat gradient itself (_get_reduce_scatter_tensors:
        # no copy when no padding is needed). So the root's unsharded gradients meet either
        # its unsharded parameters (and the first layer's reduce-scatter input, still held in
        # reduce_scatter_states) or the reduce-scatter buffers, never both.
        # FSDP1 with use_orig_params: the original parameters are views of the unsharded
        # FlatParameter (_flat_param.py FlatParamHandle._use_unsharded_views, split_with_sizes),
        # so autograd's SplitWithSizesBackward0 concatenates their gradients into the flat
        # gradient while the views' gradients and the unsharded FlatParameter are still alive:
        # one more gradient-sized tensor before the reshard.
        t = out.stage_backward_transient[0]
        t.add("fsdp/root_unsharded_grads", root_g)
        held = root_w + (gsizes.get(order[0], 0) * gb if order else 0)
        # Over DTensor TP the embedding's unsharded gradient is whole-vocabulary
        # (shard.dtensor_embedding_grads); the root's post-backward redistributes it to the
        # parameter's Shard(0) before the reshard (_fsdp_param.py FSDPParam.
        # _get_grad_inner_tensor -> DTensor.redistribute -> Shard._replicate_to_shard, which
        # clones this rank's chunk, tensor/placement_types.py), so the whole gradient and its
        # TP-local copy (counted in root_g) are alive together, beside the root's parameters.
        held += whole_embedding_grad
        if lay.fsdp_version == 1:
            held = max(held, root_w + root_g)
        copies = (1 if lay.fsdp_version == 2 else 0) + (1 if _gloo(lay) else 0)
        t.add("fsdp/root_params_then_reduce_scatter", max(held, copies * root_g))


def _forward_stages(trans: list[Breakdown], first: int, order: list, sizes: dict, root_terms: Breakdown,
                    dim0: bool, keep_all: bool) -> None:
    """What FSDP holds at a stage's forward transient (float8 casts, a checkpointed
    forward): the root's unsharded parameters (from the root's pre-forward on); in a layer,
    its unsharded parameters and, on FSDP2, its all-gather output, kept until the next unit's
    wait_for_unshard (see fsdp_buffers); in the head, the last layer's all-gather output."""
    for k, t in enumerate(trans):
        if not t.terms:
            continue
        # what is added differs stage by stage, and stages may share one Breakdown
        # (parallel/plan.py scales each distinct one once): each gets its own
        t = trans[k] = Breakdown(dict(t.terms)).merge(root_terms)
        j = k - first
        if 0 <= j < len(order):
            i = order[j]
            t.add("fsdp/unsharded_layers" if keep_all else "fsdp/unsharded_params",
                  sum(sizes[m] for m in order[:j + 1]) if keep_all else sizes[i])
            if dim0:
                t.add("fsdp/forward_all_gather_output", sizes[i])
        elif j >= len(order) and order and dim0:
            t.add("fsdp/forward_all_gather_output", sizes[order[-1]])


def _gloo(lay: Layout) -> bool:
    """Collectives on gloo (parallel.extras.dist_backend; the CPU runs of bench/parallel).
    ProcessGroupGloo has no native reduce-scatter: torch/csrc/distributed/c10d/
    ProcessGroupGloo.cpp ProcessGroupGloo::_reduce_scatter_base -> reduce_scatter_tensor_coalesced
    reduces a full-size buffer and copies each rank's chunk out of it, so one more buffer of the
    unsharded gradient size is alive while the reduce-scatter runs (seen by the exact meter as
    an `aten.split` output of the input's size at the root's post-backward)."""
    return str(lay.extras.get("dist_backend", "")).lower() == "gloo"


def _is_embedding(p: HeldParam) -> bool:
    base = p.name.split("#", 1)[0]
    return any(w in base for w in ("embed_tokens", "wte", "wpe", "embeddings"))


def fsdp1_largest_piece(unit: dict, root: list, n: int) -> HeldParam | None:
    """The largest trainable parameter piece any rank holds under FSDP1. Each wrapped unit is
    one FlatParameter: its parameters flattened in registration order (with use_orig_params
    each starts at a multiple of 16 bytes, _flat_param.py _init_flat_param_and_metadata,
    _get_aligned_numel), padded to a multiple of n and cut into n contiguous slices
    (FlatParamHandle._get_shard); each original parameter on a rank is a view of its part of
    the rank's slice (_use_sharded_views), so a parameter can sit whole on one rank while
    FSDP2 would give every rank 1/n of its rows. A per-parameter optimizer loop
    (_single_tensor_adamw) steps these pieces."""
    best: HeldParam | None = None
    for params in [*unit.values(), root]:
        offsets, o = [], 0
        for p in params:
            align = max(16 // max(nbytes(1, p.dtype), 1), 1)
            o = -(-o // align) * align
            offsets.append(o)
            o += p.numel
        s = -(-o // n)
        for p, o in zip(params, offsets):
            if not p.trainable or not p.numel or not s:
                continue
            a, b = o // s, (o + p.numel - 1) // s
            piece = p.numel if a == b else max(s * (a + 1) - o, o + p.numel - s * b, s if b - a > 1 else 0)
            if best is None or piece > best.numel:
                best = HeldParam(p.name, (piece,), p.dtype, p.trainable, p.kind, p.layer, p.full_shape or p.shape)
    return best


def dtensor_embedding_grad(spec, params) -> int:
    """Bytes of the whole-vocabulary gradient of the trainable input embedding in `params`
    (the unsharded set): DTensor has no Shard(0) strategy for embedding_dense_backward
    (shard.dtensor_embedding_grads), so every TP rank makes all of it."""
    return sum(nbytes(p.numel, grad_dtype(spec, p)) for p in params.trainable()
               if p.layer is None and "#" not in p.name and any(w in p.name for w in ("embed_tokens", "wte")))

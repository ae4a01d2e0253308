"""The distributed engines' own buffers, from their source, in named terms.

Every function returns a Breakdown of bytes on one rank. `unit` is the largest FSDP /
ZeRO-3 wrapping unit (one decoder layer), `root` the parameters outside the layers
(embedding, final norm, head), both unsharded, in the weight dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.parallel.layout import (
    DS_ALLGATHER_BUCKET, DS_MAX_LIVE_PARAMETERS, DS_PARAM_PERSISTENCE_THRESHOLD, DS_PREFETCH_BUCKET,
    DS_REDUCE_BUCKET, Layout,
)
from vramplan.units import nbytes


def ddp_buckets(lay: Layout, grad_bytes: int) -> Breakdown:
    """torch DDP: the Reducer allocates one flat `bucket.gradients` tensor per bucket
    covering every gradient (torch/csrc/distributed/c10d/reducer.cpp,
    Reducer::initialize_buckets; buckets of bucket_cap_mb=25 MiB, the first 1 MiB,
    torch/nn/parallel/distributed.py). Unless gradient_as_bucket_view=True, param.grad is a
    separate tensor, so the buckets are a second, persistent copy of the gradients."""
    out = Breakdown()
    if lay.knob("gradient_as_bucket_view", False):
        return out
    out.add("ddp/gradient_buckets", grad_bytes)
    return out


def zero12_ipg_buffer(lay: Layout, grad_dtype: str) -> Breakdown:
    """DeepSpeed ZeRO-1/2 (0.19, runtime/zero/stage_1_and_2.py): the gradient hook
    `process_gradients` calls `setup_buckets`, which with contiguous_gradients (default
    True) allocates `ipg_buckets[dtype].buffer` = torch.empty(reduce_bucket_size) in the
    gradient-reduction dtype (`_gradient_reduction_buffer_dtype`), and a second one with
    overlap_comm, for stage 1 and 2 alike. So the buffer appears at the *first* gradient
    hook (the head's AccumulateGrad), after the loss backward has freed the logits'
    gradients, and lives until `independent_gradient_partition_epilogue` ->
    `_release_ipg_buffers` at the end of backward. It has reduce_bucket_size elements even
    when the model is smaller. Measured: bench/parallel/results-deepspeed-cpu.json."""
    out = Breakdown()
    if lay.zero_stage in (1, 2) and lay.knob("contiguous_gradients", True):
        copies = 2 if lay.knob("overlap_comm", False) else 1
        out.add("zero/ipg_reduce_buckets", copies * nbytes(int(lay.knob("reduce_bucket_size", DS_REDUCE_BUCKET)),
                                                            grad_dtype))
    return out


def zero12_reduce_flat(lay: Layout, grad_dtype: str, total_grad_numel: int) -> Breakdown:
    """Each reduction of a bucket goes average_tensor -> allreduce_and_scatter ->
    allreduce_and_copy_with_multiple_ranks -> allreduce_bucket, which flattens the bucket's
    gradients into one new tensor (`self.flatten(bucket)`, stage_1_and_2.py) of up to
    reduce_bucket_size elements: alive with the ipg buffer while the bucket is reduced."""
    bucket = int(lay.knob("reduce_bucket_size", DS_REDUCE_BUCKET))
    return Breakdown().add("zero/reduce_bucket_flat", nbytes(min(bucket, total_grad_numel), grad_dtype))


def zero12_step_grad(states_numel: int) -> Breakdown:
    """ZeRO-1/2 step (stage_1_and_2.py DeepSpeedZeroOptimizer.step): the partition's
    gradients are flattened into a new tensor (`self.flatten(self.averaged_gradients[i])`)
    and converted to the fp32 partition's dtype (`.to(...)`, a second tensor only for 16-bit
    gradients, whose flat copy is then deleted); it is the fp32 partition's `.grad` while the
    wrapped optimizer steps, beside the gradient partition buffer it was copied from."""
    return Breakdown().add("zero/flat_grad_partition", nbytes(states_numel, "fp32"))


def zero3_step_grad(lay: Layout, states_numel: int) -> Breakdown:
    """ZeRO-3 step (stage3.py DeepSpeedZeroOptimizer_Stage3.step, one sub group at a time):
    _prepare_fp32_grad_for_sub_group flattens the sub group's gradient partitions (views
    into the persistent partition buffer) into a new fp32 tensor, the fp32 partition's
    `.grad` until _release_sub_group drops it; sub groups are `sub_group_size` elements
    (DeepSpeedZeroConfig default 1e9), so one sub group's worth is alive at a time."""
    sub = int(lay.knob("sub_group_size", 1_000_000_000))
    return Breakdown().add("zero/flat_grad_partition", nbytes(min(states_numel, sub), "fp32"))


def zero1_step_grads(partition_grads: list[Breakdown]) -> Breakdown:
    """ZeRO-1 holds only the rank's gradient partition at the step, like ZeRO-2 (0.19,
    stage_1_and_2.py): with contiguous_gradients, reduce_ipg_grads copies each reduced
    gradient of the rank's partition into `grads_in_partition` (copy_grads_in_partition,
    "zero stage 1 - partition only optimizer state" branch), the epilogue
    (independent_gradient_partition_epilogue) points `averaged_gradients` at those views
    (get_flat_partition) and `_clear_param_grad_only` sets every parameter's `.grad` to
    None, so the other ranks' gradients are freed before DeepSpeedZeroOptimizer.step.
    Without contiguous_gradients `averaged_gradients` are views of the partition's own
    `.grad` tensors, the same bytes. `partition_grads`: the gradient stages over the rank's
    partitioned (optimizer-state) set. Measured: bench/parallel/results-deepspeed-cpu.json
    (ZeRO-1's step equal to ZeRO-2's to the byte)."""
    out = Breakdown()
    for g in partition_grads:
        out.merge(g)
    return out


def zero2_first_bucket(lay: Layout, stage_numels: list[int]) -> int | None:
    """The stage (forward index) whose backward first fills a ZeRO-2 reduce bucket, or None
    when the whole model fits in one (then it is reduced in the backward epilogue).
    stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads: a gradient hook that
    would overflow `reduce_bucket_size` elements calls reduce_ipg_grads first; backward
    makes the gradients last stage first. `stage_numels`: every stage's whole (unsharded)
    trainable elements, forward order."""
    bucket, filled = int(lay.knob("reduce_bucket_size", DS_REDUCE_BUCKET)), 0
    for i in range(len(stage_numels) - 1, -1, -1):
        filled += stage_numels[i]
        if filled > bucket:
            return i
    return None


def zero2_first_reduction(own_acts: Breakdown, transient: Breakdown, partition_bytes: int,
                          param_grad_bytes: int) -> Breakdown:
    """ZeRO-2 with contiguous_gradients (stage_1_and_2.py, 0.19): a gradient hook copies
    the parameter's gradient into the ipg bucket and points `.grad` at it, so until the
    first bucket is reduced a rank holds no gradient of its own beyond the bucket. At the
    first reduction (reduce_ipg_grads -> copy_grads_in_partition) the rank owning the
    gradients reduced first (the last partition: it holds the head) allocates its whole
    gradient partition at once (`grads_in_partition = torch.empty(total_size)`); every
    later gradient of its partition is a view into it, the others' are freed
    (clear_grad_attribute). The meter's trace (rank 1, bench/parallel/
    results-deepspeed-cpu.json) shows the moment inside a layer's backward, at the hook of
    an MLP input projection: the MLP's intermediates and their gradients are freed, the
    rest of the layer's saved activations, the hidden-size activation gradient, that
    weight's whole gradient (`param_grad_bytes`, the stage's largest) and the new
    partition (`partition_bytes`) are alive."""
    out = Breakdown()
    for name, value in own_acts:
        if "/mlp/" not in name:
            out.add(name, value)
    for name, value in transient:
        if name != "backward/grad_mlp":
            out.add(name, value)
    return out.add("zero/grad_partition_buffer", partition_bytes).add("zero/reducing_param_grad", param_grad_bytes)


def zero_flat_step(temporaries: Breakdown, states_numel: int) -> Breakdown:
    """The wrapped optimizer steps one flat fp32 partition per parameter group, not the
    model's parameters (stage_1_and_2.py: `param_group['params'] = [single_partition_of_fp32_
    groups[i]]`; stage3.py: `fp32_partitioned_groups_flat`). A for-loop AdamW's
    per-parameter temporaries (`_single_tensor_adamw`: exp_avg_sq.sqrt() and the quotient,
    alive together) are therefore as large as the partition; foreach temporaries already sum
    over every parameter and stay as they are."""
    out = Breakdown()
    for name, value in temporaries:
        out.add(name, 2 * nbytes(states_numel, "fp32") if name == "temporaries/optimizer/forloop_denom" else value)
    return out


def zero_fp32_partition(spec_has_master: bool, states_numel: int) -> Breakdown:
    """The fp32 partition the optimizer steps: DeepSpeed clones it even when the model is
    already fp32 (stage_1_and_2.py DeepSpeedZeroOptimizer.__init__: `weights_partition =
    parallel_partitioned_bit16_groups[i][partition_id].detach().clone()` into
    single_partition_of_fp32_groups; stage3.py _create_fp32_partitions:
    `converted.clone().detach()` into fp32_partitioned_groups_flat). With 16-bit weights
    it is the master copy the precision already counts."""
    out = Breakdown()
    if not spec_has_master:
        out.add("zero/fp32_partition_copy", nbytes(states_numel, "fp32"))
    return out


def zero_allgather_bucket(lay: Layout, wdtype: str, total_numel: int) -> Breakdown:
    """After the step, ZeRO-1/2 all-gather the updated 16-bit partitions into the flat
    bit16 groups in chunks of allgather_bucket_size (runtime/utils.py all_gather_dp_groups);
    the output is the existing flat parameter buffer, so only the chunk bookkeeping is new;
    counted as one bucket-sized temporary when the engine cannot gather in place."""
    bucket = int(lay.knob("allgather_bucket_size", DS_ALLGATHER_BUCKET))
    return Breakdown().add("zero/allgather_bucket", nbytes(min(bucket, total_numel), wdtype) // max(lay.shard_group, 1))


def zero3_live(lay: Layout, wdtype: str, unit_numel: int, total_numel: int) -> Breakdown:
    """ZeRO-3 gathered parameters in a steady step (DeepSpeed 0.19
    runtime/zero/partitioned_param_coordinator.py). Once the module trace is complete (from
    the third step), every submodule fetch prefetches up to min(`stage3_max_live_parameters`
    - available, `stage3_prefetch_bucket_size`) elements, at least one parameter, also for
    modules whose own parameters are already there (persistent ones), so the prefetch runs
    ahead of the forward; and a parameter whose later use the prefetch's scan has passed is
    not released (`__params_to_release`: "reuse skipped by prefetch"). So what is gathered
    climbs to `stage3_max_live_parameters`, or to every gathered parameter when the model is
    smaller, and stays there into backward; the current module comes whole even when it is
    larger. Measured on the real engine: bench/parallel/deepspeed_cpu.py --set reuse (eight
    layers, a 1e5 prefetch bucket: every gathered weight is resident at the forward's peak,
    whatever `stage3_max_reuse_distance` says). Without prefetching (a bucket of 0) nothing
    is scanned ahead and each module's parameters go when it ends: the current module's."""
    max_live = int(lay.knob("stage3_max_live_parameters", DS_MAX_LIVE_PARAMETERS))
    prefetch = int(lay.knob("stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET))
    live = min(total_numel, max(max_live, unit_numel)) if prefetch > 0 else unit_numel
    return Breakdown().add("zero/gathered_params", nbytes(live, wdtype))


def zero3_hpz_secondary(lay: Layout, wdtype: str, numels: list[int]) -> Breakdown:
    """ZeRO++ hpZ (Wang et al. 2023, arXiv 2306.10209, section 3.2): a secondary partition
    of each parameter over the hpz ranks of its node, in the weights' dtype, so that
    backward gathers within the node. DeepSpeed 0.19 runtime/zero/partition_parameters.py
    Init._partition calls _partition_param_sec for every parameter it partitions, the
    persistent (small) ones included: ds_secondary_tensor of aligned_size // hpz elements
    (aligned_size: numel padded to a multiple of the data-parallel size). When it is alive
    is the caller's (parallel/plan.py _zero): measured on the real engine
    (bench/parallel/deepspeed_cpu.py, `hpz2-of-*` rows), all of it from the engine's init
    through the first step's forward and backward, and after that only in each optimizer
    step (stage3.py _reassign_or_swap_out_partitioned_parameters re-partitions the updated
    parameters; _post_step's invalidate_secondary_tensor drops them)."""
    hpz = int(lay.knob("zero_hpz_partition_size", 1))
    if hpz <= 1:
        return Breakdown()
    n = lay.shard_group
    sec = sum(-(-numel // n) * n // hpz for numel in numels)
    return Breakdown().add("zero/hpz_secondary_partition", nbytes(sec, wdtype))


def zero3_persistent_partitions(lay: Layout, wdtype: str, persistent_numels: list[int]) -> Breakdown:
    """ZeRO-3's persistent (small) parameters keep their partition too: Init partitions every
    parameter when it converts the module (runtime/zero/partition_parameters.py
    _convert_to_zero_parameters -> _partition_param: ds_tensor of aligned_size // world),
    and DeepSpeedZeroOptimizer_Stage3 moves every ds_tensor into its flat 16-bit partition
    buffer (stage3.py _create_fp16_partitions_with_defragmentation); the persistent ones are
    then gathered whole and stay so (parameter_offload.py mark_persistent_parameters,
    stage3.py _post_step). The whole copies are the rank's weights; these are the rest."""
    n = lay.shard_group
    return Breakdown().add("zero/persistent_param_partitions", nbytes(sum(-(-k // n) for k in persistent_numels), wdtype))


def zero3_prefetch_flat_buffer(lay: Layout, wdtype: str, numels: list[int]) -> Breakdown:
    """The flat buffer of a coalesced ZeRO-3 all-gather (runtime/zero/partition_parameters.py
    all_gather_coalesced: `flat_tensor = torch.empty(partition_sz * world_size)`, the bucket's
    partitions side by side). AllGatherCoalescedHandle.wait assembles every parameter of the
    bucket from it with torch.cat (new tensors, not views), and the handle, which holds the
    flat tensor, is dropped only when the bucket's last parameter is fetched
    (partitioned_param_coordinator.py: __inflight_param_registry.pop(param).wait()). Once
    the first step has recorded the module trace, fetch_sub_module prefetches the upcoming
    parameters in one such call per `stage3_prefetch_bucket_size` elements, so a bucket's
    flat buffer is alive beside its assembled parameters until its last module runs. Whole
    (every non-persistent parameter, `numels`) where they fit one bucket; else one bucket.
    Measured on the real engine (bench/parallel/deepspeed_cpu.py --set hpz): the buffer and
    the assembled parameters both alive at the forward's peak, before the output head."""
    n = lay.shard_group
    prefetch = int(lay.knob("stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET))
    whole = sum(-(-k // n) for k in numels) * n
    return Breakdown().add("zero/allgather_flat_buffer", nbytes(min(whole, prefetch), wdtype))


def zero3_reduce(lay: Layout, grad_dtype: str, unit_numel: int, grad_partition_numel: int) -> Breakdown:
    """ZeRO-3 (runtime/zero/stage3.py, DeepSpeedZeroOptimizer_Stage3.__init__): with
    contiguous_gradients `ipg_buckets[dtype].buffer = torch.empty(reduce_bucket_size)`,
    persistent; and `grad_partitions_flat_buffer = torch.zeros(sum(p.partition_numel()))`
    in the gradient-accumulation dtype, persistent from init: every parameter's gradient
    partition is a view into it, so the sharded gradients are one static buffer, not
    tensors made during backward. The module's full gradients exist until copied into the
    ipg buffer and reduce-scattered."""
    bucket = int(lay.knob("reduce_bucket_size", DS_REDUCE_BUCKET))
    out = Breakdown()
    if lay.knob("contiguous_gradients", True):
        out.add("zero/ipg_bucket_flat_buffer", nbytes(bucket, grad_dtype))
    out.add("zero/grad_partitions_flat_buffer", nbytes(grad_partition_numel, grad_dtype))
    out.add("zero/unsharded_grads", nbytes(unit_numel, grad_dtype))
    return out


def padded(numel_rows: list[tuple[int, int]], n: int) -> int:
    """Elements after FSDP2 pads each parameter's dim 0 to a multiple of n
    (_fsdp_param.py: padded_sharded_size = chunks[0].size() * world_size)."""
    return sum(-(-rows // n) * n * rest for rows, rest in numel_rows)


def fsdp_backward_stage(unit: int, prev_unit: int, next_unit: int, grad_unit: int,
                        wbytes: int, gbytes: int, compute: int, prefetch: bool,
                        version: int = 2, gloo: bool = False, shards: int = 1) -> Breakdown:
    """One wrapped layer's backward under FSDP full-shard, in bytes:
    * its unsharded parameters (FSDPParamGroup.pre_backward -> unshard -> wait_for_unshard:
      `alloc_storage` of every unsharded param, _fsdp_param.py);
    * the previous layer's all-gather output, prefetched by `_backward_prefetch`
      (_fsdp_param_group.py) and held in `_all_gather_result` until that layer's
      wait_for_unshard copies it out (FSDP1: backward_prefetch=BACKWARD_PRE);
    * the later layer's reduce-scatter input, kept in comm_ctx.reduce_scatter_states until
      this layer's post_backward (reduce_scatter_max_input_buffers = 1);
    * its unsharded gradients, then the reduce-scatter input they are copied into and the
      sharded gradient, the reduce-scatter output (_fsdp_collectives.py foreach_reduce:
      `reduce_scatter_input` of the padded unsharded numel, copy-in, `unsharded_grads.clear()`,
      then the output of 1/n of it, which the sharded parameter's .grad views).
    `compute` is what the layer holds at its compute peak beyond the parameters and buffers
    above (its activations still saved, the unsharded gradients made so far, the activation
    gradients): the layer's sharded gradient does not exist yet there. The later moments,
    with the layer's activations gone: the end of its compute (later RS input + full
    gradients) and its post-backward. FSDP2 reshards before it reduces
    (_fsdp_param_group.py FSDPParamGroup.post_backward: self.reshard(), then it pops the
    later layer's reduce-scatter state, then foreach_reduce), so its unsharded parameters
    are gone when the reduce-scatter input is allocated: gradients + RS input at the copy-in,
    RS input + output while it reduces. FSDP1 (use_orig_params) concatenates the original
    parameters' gradients into the flat gradient in SplitWithSizesBackward0 while the
    unsharded FlatParameter is alive (_flat_param.py _use_unsharded_views), and then
    reduce-scatters the flat gradient itself (_runtime_utils.py _reduce_grad). On gloo the
    reduce-scatter holds one more buffer of the input size (ProcessGroupGloo.cpp
    reduce_scatter_tensor_coalesced). The term is the largest excess over the compute
    peak."""
    out = Breakdown()
    out.add("fsdp/unsharded_params", unit * wbytes)
    if prefetch:
        out.add("fsdp/prefetch_all_gather", prev_unit * wbytes)
    start = next_unit * gbytes
    g = grad_unit * gbytes
    reducing = (1 + gloo) * g + g // shards - unit * wbytes
    if version == 2:
        post = max(start + g, 2 * g - unit * wbytes, reducing)
    else:
        post = max(2 * g, reducing)
    out.add("fsdp/reduce_scatter_or_unsharded_grads", max(start, post - compute, 0))
    return out

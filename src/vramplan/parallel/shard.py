"""Per-rank parameter shapes: what tensor, pipeline and expert parallelism leave on a rank,
and what ZeRO / FSDP partitioning over the data-parallel group leaves of that.

Each function returns a ParamSet of the same HeldParam records with smaller shapes, so the
components (weights, gradients, optimizer) compute per-rank terms with their own rules.
"""
from __future__ import annotations


from vramplan.components.trainable import HeldParam, ParamSet
from vramplan.model import ModelDesc

# Megatron-LM tensor parallelism (megatron/core/tensor_parallel/layers.py):
# ColumnParallelLinear splits the output dim (q/k/v, gate/up, fc1, the output head);
# RowParallelLinear splits the input dim (o_proj, down_proj, fc2);
# VocabParallelEmbedding splits the vocabulary. Norms and row-parallel biases are replicated.
_COLUMN = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj",
           "c_attn", "c_fc", "fc1", "w1", "w3", "lm_head", "embed_tokens", "wte", "query", "key",
           "value", "intermediate.dense")
_ROW = ("o_proj", "down_proj", "c_proj", "fc2", "w2", "dense")


def _leaf(p: HeldParam) -> str:
    base = p.name.split("#", 1)[0]
    parts = base.rsplit(".", 2)
    return parts[-2] if len(parts) >= 2 else base


def is_expert(p: HeldParam) -> bool:
    return ".experts." in p.name


def tp_shape(p: HeldParam, t: int) -> tuple[int, ...]:
    """Shape of one TP rank's slice (ceil division; LoRA A/B follow their base linear:
    PEFT's Megatron LoRA splits B with a column base and A with a row base)."""
    if t == 1 or not p.shape:
        return p.shape
    key = (p.name, p.kind, len(p.shape))
    dim = _SPLIT_DIM.get(key)
    if dim is None:
        if len(_SPLIT_DIM) >= 1 << 16:
            _SPLIT_DIM.clear()
        dim = _SPLIT_DIM[key] = _split_dim(p)
    if dim == 0:
        return (-(-p.shape[0] // t),) + p.shape[1:]
    if dim == 1:
        return (p.shape[0], -(-p.shape[1] // t))
    return p.shape


# (name, kind, ndim) -> the dimension tensor parallelism splits (None: replicated); the
# rule reads only these, and a search asks it of the same tensors under every TP degree
_SPLIT_DIM: dict[tuple, int | None] = {}


def _split_dim(p: HeldParam) -> int | None:
    """The rule by what it reads: the module's leaf name, the tensor's own name, kind and
    rank (identical layers' tensors share one entry)."""
    leaf = _leaf(p)
    key = (leaf, p.name.rsplit(".", 1)[-1], p.kind, len(p.shape))
    if key not in _BY_LEAF:
        _BY_LEAF[key] = _rule(p, leaf)
    return _BY_LEAF[key]


_BY_LEAF: dict[tuple, int | None] = {}


def _rule(p: HeldParam, leaf: str) -> int | None:
    if any(leaf == c or leaf.endswith(c) for c in _COLUMN) or "embed" in leaf:
        return 0 if p.kind != "lora" or p.name.endswith("lora_B") else None
    if any(leaf == r or leaf.endswith(r) for r in _ROW) and not p.name.endswith(".bias") and len(p.shape) == 2:
        return 1 if p.kind != "lora" or p.name.endswith("lora_A") else None
    return None


def pp_layers(num_layers: int, pp: int, split: list[int] | None = None) -> list[range]:
    """Layer ranges per pipeline stage. Default: as even as possible, earlier stages take the
    remainder (torchtitan pipelining `generate_split_points`); `split` = layers per stage
    (Megatron decoder_first/last_pipeline_num_layers give uneven splits)."""
    if split:
        if sum(split) != num_layers or len(split) != pp:
            raise ValueError(f"parallel.extras.pp_layers: {split} must have {pp} entries summing to {num_layers}")
        sizes = list(split)
    else:
        base, extra = divmod(num_layers, pp)
        sizes = [base + (1 if i < extra else 0) for i in range(pp)]
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return out


def on_stage(desc: ModelDesc, p: HeldParam, stage: int, pp: int, layers: range) -> bool:
    """Megatron: embedding on the first stage, final norm and head on the last; a tied
    embedding keeps a copy on the last stage too (megatron/core/models/common/
    language_module/language_module.py, setup_embeddings_and_output_layer)."""
    if pp == 1:
        return True
    if p.layer is not None:
        return p.layer in layers
    base = p.name.split("#", 1)[0]
    is_embed = any(w in base for w in ("embed_tokens", "wte", "wpe", "embeddings"))
    if is_embed:
        return stage == 0 or (stage == pp - 1 and desc.tie_word_embeddings)
    return stage == pp - 1


def model_parallel_set(desc: ModelDesc, params: ParamSet, *, tp: int, ep: int, pp: int,
                       stage: int, layers: range, expert_tp: int | None = None) -> ParamSet:
    """Parameters one rank of (tp, pp stage, ep) holds before any data-parallel sharding.
    Experts are split by the expert tensor-parallel size, which Megatron defaults to the
    tensor-parallel size (megatron/training/arguments.py: expert_tensor_parallel_size = tp
    when not given; megatron/core/transformer/moe/experts.py shards each expert's fc1 by
    columns and fc2 by rows over the expert-TP group)."""
    etp = tp if expert_tp is None else expert_tp
    if tp == 1 and ep == 1 and pp == 1 and etp == 1:
        return params                 # every tensor whole on the rank: the set itself
    held = []
    for p in params.params:
        if not on_stage(desc, p, stage, pp, layers):
            continue
        if is_expert(p):
            shape = _expert_shape(p, ep, etp)
            if shape is None:
                continue
        else:
            shape = tp_shape(p, tp)
        held.append(HeldParam(p.name, shape, p.dtype, p.trainable, p.kind, p.layer, p.full_shape))
    return ParamSet(tuple(held), params.unmatched_targets)


def _expert_shape(p: HeldParam, ep: int, etp: int) -> tuple[int, ...] | None:
    """One rank's part of an expert tensor, or None when the expert lives on another EP rank.
    transformers 5 stores all experts of a layer in 3-D tensors (gate_up_proj (E, 2f, h),
    down_proj (E, h, f)): EP divides E; expert-TP divides f. Older per-expert modules
    (experts.N.w1 ...) keep every ep-th expert and split like ordinary linears."""
    idx = _expert_index(p)
    if idx is not None:
        if ep > 1 and idx % ep:
            return None
        return tp_shape(p, etp)
    shape = p.shape
    if len(shape) != 3:
        return shape
    e = -(-shape[0] // ep)
    if p.name.endswith("down_proj"):
        return (e, shape[1], -(-shape[2] // etp))
    return (e, -(-shape[1] // etp), shape[2])


def _expert_index(p: HeldParam) -> int | None:
    tail = p.name.split(".experts.", 1)[1]
    head = tail.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def flat_numel(p: HeldParam) -> int:
    return p.numel


def dp_shard(params: ParamSet, n: int, *, per_param_dim0: bool, persist_below: int = 0,
             expert_n: int | None = None) -> ParamSet:
    """One data-parallel rank's partition of each tensor.

    per_param_dim0: FSDP2 shards each parameter on dim 0 and pads dim 0 to a multiple of n
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, FSDPParam._init_sharded_param:
    `chunks = torch.chunk(tensor, world_size, dim=0)`, padded to `padded_sharded_size`).
    Otherwise flat partitioning (DeepSpeed ZeRO flattens each param group and splits it into
    n equal partitions, runtime/zero/stage_1_and_2.py `get_data_parallel_partitions`;
    FSDP1 FlatParameter, torch/distributed/fsdp/_flat_param.py `_get_shard`): ceil(numel/n).
    persist_below: ZeRO-3 keeps parameters with fewer elements unpartitioned
    (runtime/zero/parameter_offload.py, `persistence_threshold` -> `ds_persist`)."""
    if n == 1 and (expert_n or 1) == 1:
        return params                 # one rank in the group: nothing is partitioned
    held = []
    for p in params.params:
        k = expert_n if (expert_n and is_expert(p)) else n
        numel = flat_numel(p)
        if k == 1 or numel < persist_below:
            held.append(p)
            continue
        if per_param_dim0 and p.shape:
            rows = -(-p.shape[0] // k)
            shard = rows
            for d in p.shape[1:]:
                shard *= d
        else:
            shard = -(-numel // k)
        held.append(HeldParam(p.name, (shard,), p.dtype, p.trainable, p.kind, p.layer, p.full_shape or p.shape))
    return ParamSet(tuple(held), params.unmatched_targets)


def numel_where(params: ParamSet, pred) -> int:
    return sum(flat_numel(p) for p in params.params if pred(p))


def dtensor_embedding_grads(params: ParamSet, mp: ParamSet) -> ParamSet:
    """`mp` with the input embedding's gradient whole again. DTensor tensor parallelism
    (torch.distributed.tensor.parallel RowwiseParallel on nn.Embedding, torchtitan's plan)
    splits the vocabulary (Shard(0)), but aten.embedding_dense_backward has no sharding
    strategy with a Shard(0) weight gradient (torch/distributed/tensor/_ops/_embedding_ops.py
    embedding_dense_backward_strategy: Shard(1) from a column-sharded grad_out, else Partial),
    so every rank builds the whole-vocabulary gradient and its shard stays a view of it until
    zero_grad (measured: bench/parallel/tp_cpu.py). Megatron's VocabParallelEmbedding
    computes only its rows."""
    whole = {p.name: p.shape for p in params.params}
    held = []
    for p in mp.params:
        base = p.name.split("#", 1)[0]
        if p.layer is None and any(w in base for w in ("embed_tokens", "wte")) and p.name in whole:
            p = HeldParam(p.name, whole[p.name], p.dtype, p.trainable, p.kind, p.layer, p.full_shape)
        held.append(p)
    return ParamSet(tuple(held), mp.unmatched_targets)

"""Communication volume per rank and step, per parallel axis, in bytes sent by one rank.

Collective costs on a ring of n ranks, message B bytes (Patarasuk & Yuan 2009; NCCL's
PERFORMANCE.md "bus bandwidth"): all-reduce 2(n-1)/n * B, reduce-scatter and all-gather
(n-1)/n * B (B = the full, unsharded size), all-to-all (n-1)/n * B.
Legend: b micro-batch, s sequence, h hidden, k KV heads, d head_dim, L layers,
M micro-batches per step (grad_accum_steps), W / G parameter / gradient bytes of the rank's
model-parallel slice.
"""
from __future__ import annotations

from vramplan.components.dtypes import dtypes_of
from vramplan.model import ModelDesc
from vramplan.parallel.layout import Layout
from vramplan.spec import JobSpec
from vramplan.units import nbytes


def _ring(kind: str, n: int, size: int) -> int:
    if n <= 1:
        return 0
    factor = 2 if kind == "all-reduce" else 1
    return int(factor * (n - 1) * size // n)


def volumes(desc: ModelDesc, spec: JobSpec, lay: Layout, w_bytes: int, g_bytes: int,
            layers_on_rank: int, moe_layers_on_rank: int) -> dict[str, dict]:
    b, s, h, M = spec.micro_batch_size, spec.seq_len, desc.hidden_size, spec.grad_accum_steps
    c = dtypes_of(spec).compute
    out: dict[str, dict] = {}
    n = lay.data_ranks
    if lay.engine == "ddp":
        # DDP all-reduces every gradient once per step (no_sync during accumulation,
        # torch/nn/parallel/distributed.py).
        out["dp"] = _entry(_ring("all-reduce", n, g_bytes), "all-reduce G once per step: 2(n-1)/n*G",
                           "torch/nn/parallel/distributed.py, Reducer all-reduce per bucket")
    elif lay.engine == "zero":
        if lay.zero_stage == 3:
            vol = M * (2 * _ring("all-gather", n, w_bytes) + _ring("reduce-scatter", n, g_bytes))
            out["dp"] = _entry(vol, "per micro-batch: all-gather W in forward and backward, "
                               "reduce-scatter G: M*(n-1)/n*(2W+G)",
                               "ZeRO paper (arXiv 1910.02054) section 7.2.2; runtime/zero/stage3.py")
        else:
            red = (M if lay.zero_stage == 2 else 1) * _ring("reduce-scatter", n, g_bytes)
            vol = red + _ring("all-gather", n, w_bytes)
            out["dp"] = _entry(vol, "reduce-scatter G (each micro-batch at stage 2) + all-gather W "
                               "after the step", "ZeRO paper section 7.2.1; runtime/zero/stage_1_and_2.py")
    elif lay.engine == "fsdp":
        k = lay.shard_group
        gathers = 1 if lay.fsdp == "shard-grad-op" else 2
        vol = M * (gathers * _ring("all-gather", k, w_bytes) + _ring("reduce-scatter", k, g_bytes))
        if lay.fsdp == "hybrid-shard":
            vol += _ring("all-reduce", n // max(k, 1), g_bytes // max(k, 1))
        out["dp"] = _entry(vol, f"per micro-batch: {gathers} all-gather(s) of W + reduce-scatter of G "
                           "over the shard group (+ all-reduce of the shard across replicas for HSDP)",
                           "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py foreach_all_gather / foreach_reduce")
    if lay.tp > 1:
        act = nbytes(b * (s // lay.seq_shards) * h, c)
        vol = M * layers_on_rank * 4 * _ring("all-reduce", lay.tp, act)
        out["tp"] = _entry(vol, "per layer 2 all-reduces of b*s*h in forward and 2 in backward "
                           "(with SP: all-gather + reduce-scatter, the same volume)",
                           "Shoeybi et al. 2019 (arXiv 1909.08053) Fig. 4; Korthikanti et al. 2022 section 4.2.2")
    if lay.pp > 1:
        act = nbytes(b * (s // lay.seq_shards) * h, c) // (lay.tp if lay.sp else 1)
        out["pp"] = _entry(2 * M * act, "per micro-batch send activation forward + gradient backward: 2*M*b*s*h",
                           "megatron/core/pipeline_parallel/p2p_communication.py send_forward / send_backward")
    if lay.cp > 1:
        kv = 2 * nbytes(b * (s // lay.seq_shards) * desc.num_kv_heads * desc.head_dim, c)
        vol = M * layers_on_rank * 3 * (lay.cp - 1) * kv
        out["cp"] = _entry(vol, "ring attention: K,V chunk passed cp-1 times per layer in forward, "
                           "K,V and dK,dV in backward: 3*(cp-1)*2*b*(s/cp)*k*d per layer",
                           "Liu et al. 2023 Ring Attention (arXiv 2310.01889); TransformerEngine attn_forward_func_with_cp")
    if lay.ulysses > 1:
        local = b * (s // lay.seq_shards) * desc.head_dim
        qkvo = nbytes(local * (2 * desc.num_heads + 2 * max(desc.num_kv_heads, lay.ulysses)), c)
        vol = M * layers_on_rank * 2 * _ring("all-to-all", lay.ulysses, qkvo)
        out["ulysses"] = _entry(vol, "per layer all-to-all of q, k, v and the attention output, forward "
                                "and backward: 2*(u-1)/u*b*(s/u)*(2a+2k)*d",
                                "Jacobs et al. 2023 DeepSpeed-Ulysses (arXiv 2309.14509) section 3.2; "
                                "deepspeed/runtime/sequence_parallel/ulysses_sp.py")
    if lay.ep > 1 and moe_layers_on_rank and desc.moe:
        tok = nbytes(b * (s // lay.seq_shards) * desc.moe.top_k * h, c)
        vol = M * moe_layers_on_rank * 4 * _ring("all-to-all", lay.ep, tok)
        out["ep"] = _entry(vol, "per MoE layer dispatch + combine all-to-all of b*s*top_k*h, forward and backward",
                           "megatron/core/transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher")
    return out


def _entry(volume: int, formula: str, source: str) -> dict:
    return {"bytes": int(volume), "formula": formula, "source": source}

"""What tensor, sequence and context parallelism leave of each saved activation.

Megatron tensor parallelism (Korthikanti et al. 2022, arXiv 2205.05198, section 4.2.1 and
Table 2): attention internals (q, k, v, scores, softmax, dropout mask, context) and the
MLP's intermediate tensors are split over t ranks; layernorm inputs/outputs, the inputs of
the QKV and fc1 linears and the residual dropout masks stay replicated (the 10*s*b*h term
of sbh(10 + 24/t + 5as/(ht))). Sequence parallelism (section 4.2.2) splits those along the
sequence too, so every layer activation is divided by t. The output head is
vocab-parallel (megatron/core/tensor_parallel/cross_entropy.py, VocabParallelCrossEntropy):
logits and their gradients are divided by t. Context parallelism (ring attention,
megatron/core/transformer/... TransformerEngine `attn_forward_func_with_cp`) splits the
sequence over c ranks: every activation, logit and gradient of activations is divided by c.
DeepSpeed Ulysses (Jacobs et al. 2023, arXiv 2309.14509; deepspeed/runtime/sequence_parallel/
ulysses_sp.py UlyssesSPAttentionHF) splits the sequence over u ranks the same way outside
attention; inside, an all-to-all trades the sequence split for a head split, so attention saves
q, k, v and its output with all of the sequence and 1/u of the heads: the same bytes. With fewer
KV heads than u ranks, each rank gets one replicated KV head (`kv_replication_factor`), so the
saved k and v are s x 1 head instead of (s/u) x kv heads. The labels are sharded as well
(UlyssesSPDataLoaderAdapter shards `shift_labels`), so the logits are divided by u too.
The attention output goes back through a second all-to-all (`_partition_global_sequence`) and
a contiguous reshape before the output projection, which saves that new tensor, while the
kernel keeps its own output for its backward: one more b x (s/u) x h tensor per layer
(`attn/ulysses_out`, seen in the meter's trace of the real run, bench/parallel).
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.parallel.layout import Layout

_TP_SPLIT = ("/attn/", "/mlp/", "/moe/", "logits/", "backward/grad_mlp")
_TP_KEEP = ("logits/labels", "logits/padded_labels", "input_ids")


def _div(value: int, k: int) -> int:
    return -(-value // k)


# The norms' outputs: the input the next column-parallel linear saves.
_SP_GATHERED = ("attn_norm", "mlp_norm", "final_norm")
_DIVIDES: dict[tuple[str, bool, bool], bool] = {}


def tp_divides(name: str, sp: bool, dtensor: bool = False) -> bool:
    """Whether tensor parallelism splits the term `name` (memoized: a pure function of the
    name, asked for every term of every layer of every layout a search tries)."""
    hit = _DIVIDES.get((name, sp, dtensor))
    if hit is None:
        if len(_DIVIDES) >= 4096:
            _DIVIDES.clear()
        hit = _DIVIDES[(name, sp, dtensor)] = _tp_divides(name, sp, dtensor)
    return hit


def _tp_divides(name: str, sp: bool, dtensor: bool) -> bool:
    if any(k in name for k in _TP_KEEP) or "rotary/" in name:
        return False
    if sp and dtensor and name.endswith(_SP_GATHERED):
        # DTensor sequence parallelism (torchtitan's plan: PrepareModuleInput Shard(1) ->
        # Replicate before attention and the MLP, ColwiseParallel(input_layouts=Shard(1)) on the
        # head) all-gathers the norm's output and the column-parallel linears save that
        # gathered tensor for their weight gradients: whole on every rank. Megatron saves the
        # sequence shard and all-gathers it again in backward (megatron/core/tensor_parallel/
        # layers.py LinearWithGradAccumulationAndAsyncCommunication.forward,
        # sequence_parallel), so it stays divided there.
        return False
    if sp:
        return True
    return any(k in name for k in _TP_SPLIT)


# The k and v a Ulysses rank's attention kernel saves (components/arch.py names).
_ULYSSES_KV = ("attn/k_rope", "attn/v")
_ULYSSES_OUT = "attn/core"


# torch's vocab-parallel loss (torch/distributed/tensor/parallel/loss.py, loss_parallel):
# _nll_loss_and_log_softmax_backward returns the logits' gradient itself and
# _log_softmax_backward_handler passes it on (`grad_output.to(input_dtype)`, no copy in the
# same dtype), so the log-softmax backward makes no tensor of its own.
_LOSS_PARALLEL_NONE = "logits/grad_logits_fp32"
_SCALED: dict[tuple, dict[str, int]] = {}


def scale(bd: Breakdown, lay: Layout, kv_heads: int = 0) -> Breakdown:
    """One rank's share of each term of `bd` (a fresh Breakdown: callers add to it)."""
    shards = lay.seq_shards
    if lay.tp == 1 and shards == 1:
        return Breakdown().merge(bd)  # nothing divides: the same terms, as add() takes them
    # Memoized on the terms themselves: every layer's transients are equal but distinct
    # objects, and a search scales them again for each layout.
    key = (tuple(bd.terms.items()), lay.tp, lay.sp, lay.dtensor_tp, shards, lay.ulysses, kv_heads)
    hit = _SCALED.get(key)
    if hit is None:
        if len(_SCALED) >= 4096:
            _SCALED.clear()
        hit = _SCALED[key] = _scale(bd, lay, shards, kv_heads).terms
    return Breakdown(dict(hit))


def _scale(bd: Breakdown, lay: Layout, shards: int, kv_heads: int) -> Breakdown:
    out = Breakdown()
    kv_wide = lay.ulysses > 1 and 0 < kv_heads < lay.ulysses
    for name, value in bd:
        if lay.tp > 1 and lay.dtensor_tp and name.endswith(_LOSS_PARALLEL_NONE):
            continue
        if lay.tp > 1 and tp_divides(name, lay.sp, lay.dtensor_tp):
            value = _div(value, lay.tp)
        if shards > 1:
            if kv_wide and name.endswith(_ULYSSES_KV):
                value = _div(value * lay.ulysses, shards * kv_heads)
            else:
                value = _div(value, shards)
            if lay.ulysses > 1 and name.endswith(_ULYSSES_OUT):
                out.add(name[: -len(_ULYSSES_OUT)] + "attn/ulysses_out", value)
        out.add(name, value)
    return out


def pipeline_in_flight(lay: Layout, stage: int, micro_batches: int) -> float:
    """Micro-batches whose activations a pipeline stage holds at its peak.
    1F1B (megatron/core/pipeline_parallel/schedules.py,
    forward_backward_pipelining_without_interleaving): num_warmup_microbatches =
    pp - rank - 1, so rank r holds min(pp - r, M). Interleaved with v model chunks
    (forward_backward_pipelining_with_interleaving): warmup = (pp - r - 1) * 2 + (v - 1) * pp
    chunk-micro-batches, each 1/v of the stage's layers. GPipe (all-forward-all-backward): M."""
    m = micro_batches
    if lay.pp == 1:
        return 1.0
    if lay.pp_schedule in ("gpipe", "all-forward-all-backward"):
        return float(m)
    if lay.pp_schedule == "interleaved":
        v = int(lay.extras.get("virtual_stages", 2))
        warmup = (lay.pp - stage - 1) * 2 + (v - 1) * lay.pp
        return min(warmup + 1, m * v) / v
    return float(min(lay.pp - stage, m))

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
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.parallel.layout import Layout

_TP_SPLIT = ("/attn/", "/mlp/", "/moe/", "logits/", "backward/grad_mlp")
_TP_KEEP = ("logits/labels", "logits/padded_labels", "input_ids")


def _div(value: int, k: int) -> int:
    return -(-value // k)


def tp_divides(name: str, sp: bool) -> bool:
    if any(k in name for k in _TP_KEEP) or "rotary/" in name:
        return False
    if sp:
        return True
    return any(k in name for k in _TP_SPLIT)


def scale(bd: Breakdown, lay: Layout) -> Breakdown:
    out = Breakdown()
    for name, value in bd:
        if lay.tp > 1 and tp_divides(name, lay.sp):
            value = _div(value, lay.tp)
        if lay.cp > 1:
            value = _div(value, lay.cp)
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

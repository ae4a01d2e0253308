"""Frozen models: their weights, and the peak of a forward under torch.no_grad().

Under no_grad autograd saves nothing, so each layer's tensors are freed as the next is
computed; what a frozen forward leaves is its output (logits, hidden states, scores).
Its peak is the larger of one layer's working set and its output head.
Legend: r rows, s sequence, h hidden, f MLP width, a heads, k KV heads, d head_dim,
v vocabulary, c compute dtype, T = r * s.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.model import MlpKind, ModelDesc
from vramplan.units import nbytes


def frozen_weights(desc: ModelDesc, dtype: str, key: str = "weights/frozen") -> Breakdown:
    return Breakdown().add(key, nbytes(desc.num_params(), dtype))


def layer_working_set(desc: ModelDesc, rows: int, s: int, c: str) -> Breakdown:
    """One decoder layer under no_grad (transformers LlamaDecoderLayer.forward): the
    residual stream and the normed input stay alive through the block; in the MLP,
    `down(act(gate(x)) * up(x))` holds act, up and their product at once; in attention,
    q, k, v and the rotated q, k, then the attention output. The larger block is the peak."""
    t = rows * s
    res = Breakdown().add("forward/residual", nbytes(t * desc.hidden_size, c)).add(
        "forward/normed", nbytes(t * desc.hidden_size, c))
    width = desc.moe.expert_intermediate_size * desc.moe.top_k if desc.moe else desc.intermediate_size
    n_mlp = 3 if desc.mlp is MlpKind.GATED else 2
    mlp = Breakdown().merge(res).add("forward/mlp", n_mlp * nbytes(t * width, c))
    qkv = t * desc.head_dim * (2 * desc.num_heads + 3 * desc.num_kv_heads)  # q, k, v, rope(q), rope(k)
    attn = Breakdown().merge(res).add("forward/attention", nbytes(qkv + t * desc.num_heads * desc.head_dim, c))
    return mlp if mlp.total() >= attn.total() else attn


def no_grad_forward_peak(desc: ModelDesc, rows: int, s: int, c: str, head: Breakdown) -> Breakdown:
    """The peak of a no_grad forward whose output stage holds `head`."""
    layer = layer_working_set(desc, rows, s, c)
    return head if head.total() >= layer.total() else layer


def logps_head(rows: int, s: int, v: int, c: str) -> Breakdown:
    """A frozen model's per-sequence log-probs (trl get_batch_logps under no_grad): logits
    in c, their shifted fp32 copy and its log_softmax are alive together."""
    t, t1 = rows * s, rows * (s - 1)
    out = Breakdown().add("logits/logits", nbytes(t * v, c))
    if c != "fp32":
        out.add("logits/logits_fp32", nbytes(t1 * v, "fp32"))
    return out.add("logits/log_softmax", nbytes(t1 * v, "fp32"))


def cast_first_logps_head(rows: int, s: int, v: int) -> Breakdown:
    """A frozen model's log-probs under LLaMA-Factory's `concatenated_forward` (no_grad):
    the logits cast to fp32 whole, then get_batch_logps' log_softmax of the shifted view
    (llamafactory/train/dpo/trainer.py, train/trainer_utils.py): fp32 logits and the
    log_softmax alive together."""
    return Breakdown().add("logits/logits_fp32", nbytes(rows * s * v, "fp32")).add(
        "logits/log_softmax", nbytes(rows * (s - 1) * v, "fp32"))

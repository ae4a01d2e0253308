"""Megatron-Core's vocab-parallel cross-entropy: the loss terms of a `stack: megatron` job.

GPTModel.forward hands the output layer's logits ([s, b, v/tp], in the compute dtype) to
`compute_language_model_loss` (megatron/core/models/common/language_module/
language_module.py), which transposes the labels to [s, b] (a contiguous int64 copy) and
calls `tensor_parallel.vocab_parallel_cross_entropy` (megatron-core 0.16,
megatron/core/tensor_parallel/cross_entropy.py `_VocabParallelCrossEntropy`; with
`cross_entropy_loss_fusion` the jit-fused copy in megatron/core/fusions/
fused_cross_entropy.py, which allocates the same):
* `calculate_logits_max`: `vocab_parallel_logits.float()`, one fp32 copy of the logits (the
  logits themselves when they are fp32), and its row max;
* `calculate_predicted_logits`: the max subtracted *in place*, the target mask (bool) and the
  shifted targets (int64), the gathered target logit, then `torch.exp(x, out=x)` in place
  and the row sums;
* `calculate_cross_entropy_loss`: `log(sum_exp) - predicted` and `exp_logits.div_(sum_exp)`:
  the same fp32 buffer becomes the softmax;
* saved for backward: that softmax, the mask and the shifted targets; nothing else of the
  size of the logits. transformers' loss keeps an fp32 log-softmax beside an fp32 copy of
  the logits, and its backward makes two more fp32 logits-sized gradients.
* backward writes the gradient into the saved softmax in place (`grad_2d[arange, target] -=
  update`, `grad_input.mul_(grad_output)`) and returns it; for 16-bit logits autograd casts
  it to their dtype (one logits-sized copy in the compute dtype) before the output layer's
  backward.
Legend: T tokens (s * b), v the vocabulary (each TP rank's part: parallel/activations.py
divides the `logits/` terms by tp), c the logits' dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.units import nbytes


def megatron_ce_terms(tokens: int, v: int, c: str, hidden_bytes: int) -> tuple[Breakdown, Breakdown, Breakdown, Breakdown]:
    """(saved for backward, alive at the end of forward, loss backward, head backward) of
    `vocab_parallel_cross_entropy` over `tokens` rows of `v` logits in dtype `c`;
    `hidden_bytes`: the output layer's input gradient."""
    T = tokens
    saved = (Breakdown().add("logits/softmax_fp32", nbytes(T * v, "fp32"))
             .add("logits/labels_mask", nbytes(T, "bool")).add("logits/labels_shifted", nbytes(T, "int64")))
    fwd = Breakdown()
    if c != "fp32":
        # the output layer's logits stay alive until GPTModel.forward returns
        fwd.add("logits/logits", nbytes(T * v, c))
    # the [s, b] labels (`labels.transpose(0, 1).contiguous()`) and the per-token loss
    fwd.add("logits/labels_transposed", nbytes(T, "int64")).add("logits/token_loss", nbytes(T, "fp32"))
    bwd0 = Breakdown()
    if c != "fp32":
        # autograd's cast of the fp32 gradient to the logits' dtype, the softmax buffer alive
        bwd0.add("logits/grad_logits", nbytes(T * v, c))
    head = Breakdown().add("logits/grad_logits", nbytes(T * v, c)).add("logits/grad_hidden", hidden_bytes)
    return saved, fwd, bwd0, head

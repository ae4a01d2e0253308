"""The loss of repository-code causal LMs written before transformers' ForCausalLMLoss
(InternLM2ForCausalLM and BaichuanForCausalLM .forward in their repositories'
modeling_*.py): `shift_logits = logits[..., :-1, :].contiguous()` copies the logits of
b * (s - 1) tokens, `shift_labels` likewise, then CrossEntropyLoss (log_softmax + nll_loss).

kind "float" (InternLM2): `logits = logits.float()` first, so the copy and the loss are fp32.
kind "zloss" (Baichuan 2): no upcast; the loss adds `z_loss_weight * (shift_logits.max(-1)
.values ** 2).mean()` (computed at any weight, 0 included): max keeps its int64 indices, pow
its input, and max's backward scatters into a new (T', v) zero gradient that is added to the
cross-entropy's. The head is a NormHead: its backward makes the normalized weight's
gradient and then, in F.normalize's division backward, the weight's gradient and the
(v, h) temporaries of `-grad * (self / other) / other` (derivatives.yaml div.Tensor).
Legend: T' = b * (s - 1) tokens with a target, v vocab, c logits dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.arch_gpt2_bert import family_forward
from vramplan.components.dtypes import dtypes_of
from vramplan.model import ModelDesc
from vramplan.spec import JobSpec, Task
from vramplan.units import nbytes


def loss_kind(desc: ModelDesc, spec: JobSpec) -> str:
    """The family forward module's LOSS_KIND ("" for transformers' ForCausalLMLoss)."""
    forward = family_forward(desc)
    if forward is None or spec.task is Task.SEQUENCE_CLASSIFICATION:
        return ""
    return getattr(forward, "LOSS_KIND", "")


def shifted_loss_terms(desc: ModelDesc, spec: JobSpec, v: int, c: str, autocast: bool, grad_hidden: int,
                       head_trains: bool):
    """(loss_saved, forward_end_transient, loss_backward_transient, head_backward_transient)."""
    kind, b, s = loss_kind(desc, spec), spec.micro_batch_size, spec.seq_len
    # a trained NormHead's weight: (v, h, dtype)
    head_weight = (v, desc.hidden_size, dtypes_of(spec).weights) if kind == "zloss" and head_trains else None
    tokens = b * (s - 1)
    saved, fwd, bwd0, head = Breakdown(), Breakdown(), Breakdown(), Breakdown()
    # F.cross_entropy: log_softmax runs in fp32 under autocast (autocast's fp32 op list)
    ls = "fp32" if kind == "float" or autocast else c
    full = nbytes(b * s * v, "fp32" if kind == "float" else c)
    saved.add("logits/log_softmax", nbytes(tokens * v, ls)).add("logits/shift_labels", nbytes(tokens, "int64"))
    fwd.add("logits/logits" if kind == "zloss" else "logits/logits_fp32", full)
    if b > 1:  # one row's first s - 1 positions are contiguous: `.contiguous()` returns the slice itself
        fwd.add("logits/shift_logits", nbytes(tokens * v, "fp32" if kind == "float" else c))
    if ls != c and kind == "zloss":
        fwd.add("logits/shift_logits_fp32", nbytes(tokens * v, ls))
    if kind == "zloss":
        saved.add("logits/zloss_max_indices", nbytes(tokens, "int64")).add("logits/zloss_max_values",
                                                                         nbytes(tokens, c))
    # nll_loss backward's d(log_softmax) and log_softmax backward's d(shift_logits)
    bwd0.add("logits/grad_log_softmax", nbytes(tokens * v, ls)).add("logits/grad_shift_logits",
                                                                   nbytes(tokens * v, ls))
    # the slice's backward: a new (b, s, v) gradient; .float()'s backward casts it back
    head.add("logits/grad_logits", full)
    if kind == "float" and c != "fp32":
        head.add("logits/grad_logits_model_dtype", nbytes(b * s * v, c))
    head.add("logits/grad_hidden", grad_hidden)
    if head_weight is not None:
        hv, hh, hd = head_weight
        # linear backward writes d(normalized weight) next to d(hidden); the division's
        # backward then holds d(weight) and one temporary of the same size beside it
        head.add("logits/grad_normalized_weight", nbytes(hv * hh, hd)).add("logits/normalize_div_temporary",
                                                                          nbytes(hv * hh, hd))
    return saved, fwd, bwd0, head


def label_smoother_terms(b: int, s: int, v: int, c: str, grad_hidden: int, autocast: bool = True):
    """(loss_saved, forward_end_transient, loss_backward_transient, head_backward_transient) of the
    HF Trainer's label-smoothed loss (TrainingArguments.label_smoothing_factor > 0):

    transformers/trainer.py `compute_loss` pops the labels, so the model returns logits only
    (no ForCausalLMLoss), and calls `LabelSmoother(outputs, labels, shift_labels=True)`
    (transformers/trainer_pt_utils.py):
    `logits[..., :-1, :].contiguous()` copies T' = b * (s - 1) rows of the logits, fp32 under
    bf16/fp16 autocast (accelerate's `convert_outputs_to_fp32` frees the 16-bit ones), the
    model's own dtype otherwise (a bf16 model without autocast: nothing upcasts them),
    `log_probs = -log_softmax(logits)`: log_softmax saves its output and `gather` saves its input,
    the negated copy, so two (T', v) tensors are kept for backward (measured:
    bench/trainers `label-smoothing`, trace `aten._log_softmax` and `aten.neg` at the end of
    forward). Backward starts in GatherBackward: `new_zeros` then `scatter_add` (out of place),
    two more (T', v) tensors beside the two saved ones (the backward peak of the trace).
    Then the slice's backward writes the (b, s, v) gradient and, under autocast, the cast's
    backward its 16-bit copy, as the model's own loss does.
    Legend: T' = b * (s - 1) shifted tokens, v vocab, c logits dtype.
    """
    lp = "fp32" if autocast else c  # the dtype the smoother computes in
    shifted, full = nbytes(b * (s - 1) * v, lp), nbytes(b * s * v, lp)
    # saved: log_softmax's output, gather's input (the negated copy), the shifted labels and
    # the clamped index gather keeps (int64 each)
    saved = (Breakdown().add("logits/log_softmax", shifted).add("logits/neg_log_probs", shifted)
             .add("logits/shift_labels", 2 * nbytes(b * (s - 1), "int64")))
    # at the end of forward: the logits the model returned (fp32 under autocast) and their shifted copy
    logits = "logits/logits_fp32" if lp == "fp32" else "logits/logits"
    fwd = Breakdown().add(logits, full)
    if b > 1:  # at b = 1 the slice is contiguous and `.contiguous()` copies nothing (as shifted_loss_terms)
        fwd.add("logits/shift_logits", shifted)
    bwd0 = Breakdown().add("logits/gather_grad_zeros", shifted).add("logits/gather_grad_scatter", shifted)
    if lp != "fp32":
        # `log_probs.sum(dim=-1, keepdim=True, dtype=torch.float32)` of 16-bit log-probs: its
        # backward (SumBackward1, run before the gather's) casts the expanded fp32 gradient back,
        # a (T', v) copy that waits in log_probs' input buffer (seen with the exact CPU meter)
        bwd0.add("logits/sum_grad_cast", shifted)
    head = Breakdown().add(f"logits/grad_{logits.split('/')[1]}", full)
    if c != lp:
        head.add("logits/grad_logits", nbytes(b * s * v, c))
    return saved, fwd, bwd0, head.add("logits/grad_hidden", grad_hidden)

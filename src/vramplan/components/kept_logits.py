"""ms-swift's `logits_to_keep`: the output head runs on the positions that have a label only.

ms-swift 4.x's Seq2SeqTrainer._prepare_inputs calls `prepare_logits_to_keep`
(swift/trainers/mixin.py) whenever `use_logits_to_keep` resolves true, its default for a
model whose forward takes `logits_to_keep` (every transformers causal LM; multimodal ones
from transformers 5) with no sequence parallelism:
- one row per micro-batch: `loss_mask = labels != -100`, the labels kept where it is true,
  and `logits_to_keep = pad(loss_mask[1:], (0, 1), value=True)`, a boolean mask: the model
  takes `hidden_states[:, mask, :]` (transformers' `slice_indices`), an aten::index copy,
  whose backward scatters into a new zero gradient of the whole hidden state;
- more rows: `logits_to_keep = s - min(first labelled position) + 1`, an int: the model
  takes `hidden_states[:, -k:, :]`, a view, whose backward (SliceBackward0) also makes a
  new zero gradient of the whole hidden state and copies the kept part in.
The logits, their fp32 copy, the log-softmax and their gradients then have K rows per row
instead of s. K from the spec's `prompt_len` p (spec/prompt.py; None: 1): s - p + 1 with
several rows, and s - p (labelled tokens) + 1 (the last position, always kept) with one.
Verified against ms-swift 4.6.0's own `sft_main` (bench/stack/ms_swift.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from vramplan.components.arch_gpt2_bert import is_other
from vramplan.i18n import Msg
from vramplan.spec import JobSpec, LossImpl, Task
from vramplan.spec.stack import Framework


KEEPING_TASKS = (Task.SFT, Task.PRETRAIN, Task.DPO, Task.IPO)
"""ms-swift's Seq2SeqTrainer (sft, pt) and its DPOTrainer (`concatenated_forward`, IPO a loss
of it) call prepare_logits_to_keep; chosen and rejected rows share the prompt."""


@dataclass(frozen=True, slots=True)
class Kept:
    positions: int
    """K: positions per row whose logits are computed."""
    gathered: bool
    """A boolean-mask gather (one row: a copy) rather than a slice (a view)."""


def kept_positions(spec: JobSpec, desc=None) -> Kept | None:
    """The positions ms-swift's head keeps, or None where the head sees every position
    (other stacks; sequence parallelism; Liger's and the chunked losses, which take the
    hidden state whole; packed rows, vision-language jobs and the families with their own
    head, not measured: the estimate keeps every position, an upper bound)."""
    if (spec.stack.framework is not Framework.MS_SWIFT or spec.task not in KEEPING_TASKS
            or spec.parallel.ulysses > 1 or spec.loss_impl is not LossImpl.STANDARD or spec.packing
            or spec.vision is not None or (desc is not None and is_other(desc))):
        return None
    labelled = spec.seq_len - (spec.prompt_len or 1)
    return Kept(labelled + 1, gathered=spec.micro_batch_size == 1)


def notes(spec: JobSpec, desc) -> list[Msg]:
    """A prompt_len the step does not read says so."""
    if spec.prompt_len is None or kept_positions(spec, desc) is not None:
        return []
    return [Msg("prompt_len: logits are computed at every position here (only ms-swift's logits_to_keep, "
                "on a standard loss without packing or sequence parallelism, skips the prompt), so it "
                "changes nothing")]


def kept_input(rec, h, kept: Kept):
    """The head's input: a view of the last K positions, or (one row) a gathered copy."""
    b, _, hidden = h.shape
    if kept.gathered:
        return rec.new("kept_hidden", (b, kept.positions, hidden), h.dtype, h.requires_grad)
    return rec.view(h, (b, kept.positions, hidden), "kept_hidden")


__all__ = ["Kept", "kept_input", "kept_positions", "notes"]

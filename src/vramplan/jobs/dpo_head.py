"""TRL DPOTrainer's own log-prob head before the fused one (TRL 0.13 to 1.14): the whole
logits scored by `selective_log_softmax` (trl/trainer/utils.py; jobs/rl.py
`completion_logps_loss` holds its saved tensors and backward), with what each release keeps
alive around it. From 1.15 the trainer asks the model for a fused head instead
(jobs/logprob.py `chunked_head`). Read from each release's trl/trainer/dpo_trainer.py and
measured on CPU with 0.25.1, 0.29.1, 1.4.0, 1.6.0, 1.13.0 and 1.14.0
(bench/trainers/trl_releases.py).

The logits the trainer scores are `l`-typed: fp32 copies when the trainer autocasts
(accelerate's `convert_outputs_to_fp32`, which holds the model's c-typed logits and the
copy at once: jobs/trained.py `trainer_logits_dtype`), else the head's dtype.

* ROLLED, 0.15 <= TRL < 0.29 (`concatenated_forward`): all s positions against
  `torch.roll(input_ids, -1)`, no slice. It returns log-probs and mean logits only, so the
  policy's logits outlive it only where selective_log_softmax saved them; its
  `logits[:b][loss_mask[:b]]` is a boolean-index copy of the chosen rows' completion
  positions, counted here as all b x s (the spec does not split prompt from completion: an
  upper bound, high by the prompt's share of one such copy). The reference runs after, in
  `compute_ref_log_probs`, through the same function (its own mean-logits copy included),
  and its logits die with that call.
  From 0.19 it passes `output_hidden_states=True`: the reference's outputs hold its
  embedding output, every later layer's input and the normed last state (num_layers + 1
  tensors of r x s x h) through its head, and under no_grad nothing else holds them.
* CONTIGUOUS, 0.29 <= TRL < 1.6 (`_compute_loss`): it scores
  `outputs.logits[..., :-1, :].contiguous()`, a copy, and `outputs`, the copy and the
  reference's logits and copy are locals until it returns. After the loss,
  `entropy_from_logits(shift_logits.detach())` folds 128-row chunks (log_softmax, exp and
  their product: three chunks at once), then the chosen and rejected rows' mean logits take
  boolean-index copies (`chosen_logits[chosen_mask.bool()]`, b x (s - 1) at most).
* VIEW, 1.6 <= TRL < 1.14: the same on views; the entropy's `reshape(-1, v)` of the
  non-contiguous shifted view copies it whenever there is more than one row.
* KTOTrainer (trl/trainer/kto_trainer.py `_compute_loss`, rows = b unpaired completions) runs
  the VIEW pattern from 1.9 to 1.13 and the JOINT one in 1.14, its KL-batch forwards (policy
  and reference, under no_grad) each before the forward they pair with; its mean logits take
  `index_select` copies of the chosen and rejected rows first. Before 1.9 its heads are not
  modelled (bench/trainers README).
* SWIFT, ms-swift's DPOTrainer (swift/rlhf_trainers/dpo_trainer.py `concatenated_forward`,
  a subclass of TRL's): the logits of the kept positions only (`prepare_logits_to_keep`,
  components/kept_logits.py: s here is K), labels rolled, `get_per_token_logps`
  (rlhf_mixin.py) reducing the mean logits before any mask (rows x K, no vocabulary-sized
  copy) and scoring with `selective_log_softmax`; no hidden states asked for. Measured with
  ms-swift 4.6.0 (bench/stack/ms_swift.py).
* JOINT, TRL 1.14: `selective_log_softmax_and_entropy` right after the policy's forward,
  before the reference's, so the entropy's copy and chunks sit beside the policy's logits
  only. On CUDA, where Triton imports, its kernel (trl/kernels, the one ORPO runs in 1.16:
  jobs/odds_ratio.py `triton_selective`) computes both: no copy, no chunks.

Legend: r = 2b rows (chosen then rejected), s sequence, v vocabulary, L = r s v and
S = r (s - 1) v elements in l, C = r s v in c, K = three 128-row chunks of v in l.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from vramplan.breakdown import Breakdown
from vramplan.components.trl_sft_metrics import ENTROPY_CHUNK_ROWS
from vramplan.jobs.odds_ratio import triton_selective
from vramplan.jobs.selective import cast_moment, completion_logps_loss
from vramplan.jobs.trained import LossTerms, compute_dtype, trainer_logits_dtype
from vramplan.model import ModelDesc
from vramplan.spec import Backend, JobSpec, Task
from vramplan.spec.stack import Framework
from vramplan.units import nbytes


class Variant(Enum):
    SWIFT = "ms-swift"
    ROLLED = "0.13-0.28"
    CONTIGUOUS = "0.29-1.5"
    VIEW = "1.6-1.13"
    JOINT = "1.14"


HIDDEN_STATES_SINCE, CONTIGUOUS_SINCE, VIEW_SINCE, JOINT_SINCE = (0, 19), (0, 29), (1, 6), (1, 14)
"""The releases whose dpo_trainer.py changed what lives around the head (module docstring)."""


def variant(spec: JobSpec) -> Variant:
    """The release's variant; a spec that names no release gets the 0.2x one, which is what
    `logprob_head: selective` has always meant. KTO (1.9 to 1.14 only): VIEW, then JOINT."""
    release = spec.stack.minor("trl")
    if spec.stack.framework is Framework.MS_SWIFT and spec.task is not Task.KTO:
        return Variant.SWIFT
    if spec.task is Task.KTO:
        return Variant.VIEW if release < JOINT_SINCE else Variant.JOINT
    if release is None or release < CONTIGUOUS_SINCE:
        return Variant.ROLLED
    if release < VIEW_SINCE:
        return Variant.CONTIGUOUS
    return Variant.VIEW if release < JOINT_SINCE else Variant.JOINT


@dataclass(slots=True)
class DpoHead:
    """The policy's head terms and the moments around the reference's forward."""

    terms: LossTerms
    held: Breakdown
    """The policy's tensors kept alive as locals through the reference's forward (beyond
    what autograd saved)."""
    reference: Breakdown
    """The reference's head inside its no_grad forward."""
    reference_held: Breakdown
    """The reference's tensors still bound after its forward, until `_compute_loss` returns."""
    metrics: Breakdown | None
    """The metrics pass after the loss (beside `held` and `reference_held`), or None."""


def dpo_head(spec: JobSpec, rows: int, s: int, v: int, with_reference: bool) -> DpoHead:
    """The head of `rows` sequences of s tokens over a v-word vocabulary, by release
    (module docstring); `with_reference`: a reference forward runs (not precomputed)."""
    kind = variant(spec)
    rolled = kind in (Variant.ROLLED, Variant.SWIFT)  # the scored positions are the logits themselves
    c, l = compute_dtype(spec), trainer_logits_dtype(spec)
    big_l, big_s = nbytes(rows * s * v, l), nbytes(rows * (s - 1) * v, l)
    # accelerate's cast: the model's own logits beside the fp32 copy
    cast = Breakdown().add("logits/logits_model_dtype", nbytes(rows * s * v, c)) if l != c else Breakdown()
    chosen = nbytes(rows // 2 * (s if rolled else s - 1) * v, l)
    # ms-swift reduces the mean logits before it masks them: no vocabulary-sized copy
    mean_logits = Breakdown() if kind is Variant.SWIFT else Breakdown().add("logits/mean_logits_masked_copy", chosen)
    if spec.task is Task.KTO:
        # `shift_logits.detach().index_select(0, chosen_idx)` and the rejected rows' copy (all
        # rows between them), then one class's boolean-index copy, counted at half the rows
        # (a balanced batch; TRL's KTO docs recommend desirable:undesirable near 1:1)
        mean_logits.add("logits/mean_logits_index_copies", big_s)
    ref_head = Breakdown().add("logits/logits", big_l).merge(cast)
    if kind is Variant.JOINT and spec.backend is Backend.CUDA:
        terms = triton_selective(rows, s, v, l)
        terms.forward_end = cast
        ref_held = Breakdown().add("reference/logits/logits", big_l) if with_reference else Breakdown()
        return DpoHead(terms, Breakdown(), ref_head, ref_held, Breakdown().merge(mean_logits))
    fp32 = l == "fp32"
    if rolled:
        terms = completion_logps_loss(rows, s, v, l, rolled=True)
    else:
        terms = completion_logps_loss(rows, s - 1, v, l)
    held = Breakdown()
    if kind is Variant.CONTIGUOUS:
        copy = Breakdown().add("logits/shifted_copy", big_s)
        if fp32:  # the copy, not the logits, is what gather and logsumexp save
            terms.saved = copy
            copy = Breakdown()
        held.add("logits/logits", big_l).merge(copy)
        ref_head = Breakdown().add("logits/logits", big_l).add("logits/shifted_copy", big_s)
    elif not rolled and not fp32:
        held.add("logits/logits", big_l)
    if not fp32:
        # the row loop's log_softmax beside the reference's logits: under no_grad nothing saves
        # a row's output, but `row_logps` still binds the previous row's while the next is made
        scored = s if rolled else s - 1
        ref_row = Breakdown().add("logits/logits", big_l).add(
            "logits/row_log_softmax", min(2, rows) * nbytes(scored * v, l))
        ref_head = max((ref_head, ref_row), key=Breakdown.total)
    moments = [terms.forward_end, cast_moment(terms, Breakdown().add("logits/logits", big_l), cast)]
    chunks = Breakdown().add("logits/entropy_chunks", 3 * nbytes(min(ENTROPY_CHUNK_ROWS, rows * (s - 1)) * v, l))
    # the reshape of a non-contiguous view copies it (one row: the view reshapes in place)
    reshaped = Breakdown().add("logits/entropy_reshape_copy", big_s if rows > 1 else 0)
    if rolled:
        moments.append(Breakdown().merge(mean_logits).merge(terms.forward_end))
    if kind is Variant.CONTIGUOUS:
        moments.append(held)
    if kind is Variant.JOINT:
        moments.append(Breakdown().merge(held).merge(reshaped).merge(chunks))
    terms.forward_end = max(moments, key=Breakdown.total)
    if rolled:
        # the reference goes through the same concatenated_forward: its mean-logits copy too
        with_mean = Breakdown().add("logits/logits", big_l).merge(mean_logits)
        return DpoHead(terms, held, max((ref_head, with_mean), key=Breakdown.total), Breakdown(), None)
    ref_held = Breakdown()
    if with_reference:
        ref_held.add("reference/logits/logits", big_l)
        if kind is Variant.CONTIGUOUS:
            ref_held.add("reference/logits/shifted_copy", big_s)
    entropy = {Variant.CONTIGUOUS: chunks, Variant.VIEW: Breakdown().merge(reshaped).merge(chunks),
               Variant.JOINT: Breakdown()}[kind]
    return DpoHead(terms, held, ref_head, ref_held, max((entropy, mean_logits), key=Breakdown.total))


def reference_hidden_states(spec: JobSpec, desc: ModelDesc, rows: int, c: str) -> Breakdown:
    """What 0.19 <= TRL < 0.29 adds to the reference's head: its `output_hidden_states`."""
    release = spec.stack.minor("trl")
    if variant(spec) is not Variant.ROLLED or release is None or release < HIDDEN_STATES_SINCE:
        return Breakdown()
    each = nbytes(rows * spec.seq_len * desc.hidden_size, c)
    return Breakdown().add("hidden_states", (desc.num_layers + 1) * each)


__all__ = ["dpo_head", "reference_hidden_states", "variant", "Variant", "DpoHead", "HIDDEN_STATES_SINCE",
           "CONTIGUOUS_SINCE", "VIEW_SINCE", "JOINT_SINCE"]

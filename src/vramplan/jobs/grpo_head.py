"""TRL GRPOTrainer's own log-prob head before the fused one (TRL 0.16 to 1.14):
`_get_per_token_logps_and_entropies` (trl/trainer/grpo_trainer.py) runs the model with
`logits_to_keep = C + 1`, drops the last position and keeps the last C (views), divides by the
sampling temperature, scores `selective_log_softmax` (trl/trainer/utils.py; jobs/selective.py
`completion_logps_loss` holds its saved tensors and backward) and, for the trained policy from
0.21 (`compute_entropy=True`), `entropy_from_logits` under no_grad: 128-row chunks (one batch
row of C positions in 0.21 and 0.22), three at once, over the scored logits (a reshape copy when they are a non-contiguous view of more than one
row). The reference's log-probs come from the same function under no_grad, without entropy.
The logits are `l`-typed: fp32 copies under the trainer's autocast (jobs/trained.py
`trainer_logits_dtype`; accelerate's cast holds the model's c-typed logits beside them), else
the head's dtype. How each release divides, read from its source and measured on CPU with
0.19.1, 0.29.1, 1.0.0, 1.6.0, 1.12.0 and 1.14.0 (bench/trainers/trl_releases.py):

* COPY, 0.16 <= TRL < 1.0: `logits = logits / self.temperature`, a new (rows, C, v) tensor;
  the model's logits die with the views; from 0.21 the entropy reads the contiguous copy
  (`_get_per_token_logps` before 0.21 computes none).
* IN_PLACE, 1.0 <= TRL < 1.10: `logits.div_(self.temperature)` on the view, so backward
  runs CopySlices over the whole logits (jobs/rl.py `completion_logps_loss`, `logits_len`);
  the entropy's reshape copies the view.
* COPY_BOUND, 1.10 <= TRL < 1.14: the copy again, but `outputs = model(...)` keeps the
  model's logits bound until the function returns.
* JOINT, TRL 1.14: `selective_log_softmax_and_entropy(..., temperature=...)` divides only
  when the temperature is not 1.0 (GRPOConfig's default is 1.0: no copy); on CUDA, where
  Triton imports, one kernel computes both (jobs/odds_ratio.py `triton_selective`).

Before 0.16 (no temperature division; 0.14 scores without selective_log_softmax) the estimate
keeps TRL 1.16's head and says so. Legend: r rows, C completion tokens, v vocabulary, L = r (C + 1) v and
R = r C v elements in l, K = three 128-row chunks of v in l.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from vramplan.breakdown import Breakdown
from vramplan.components.trl_sft_metrics import ENTROPY_CHUNK_ROWS, ENTROPY_FLAT_SINCE
from vramplan.jobs.logprob import GRPO_ENTROPY_SINCE
from vramplan.jobs.odds_ratio import triton_selective
from vramplan.jobs.selective import cast_moment, completion_logps_loss
from vramplan.jobs.trained import LossTerms, compute_dtype, trainer_logits_dtype
from vramplan.spec import Backend, JobSpec
from vramplan.units import nbytes


class Division(Enum):
    COPY = "0.16-0.29"
    IN_PLACE = "1.0-1.9"
    COPY_BOUND = "1.10-1.13"
    JOINT = "1.14"


IN_PLACE_SINCE, COPY_BOUND_SINCE, JOINT_SINCE = (1, 0), (1, 10), (1, 14)
"""The releases whose grpo_trainer.py changed the head (module docstring); from
jobs/logprob.py GRPO_SELECTIVE_SINCE (0.16) to FUSED_SINCE (1.15) `auto` resolves to it."""


def division(spec: JobSpec) -> Division:
    """How the spec's release divides by the temperature (a release from 0.16 to 1.14)."""
    release = spec.stack.minor("trl")
    if release < IN_PLACE_SINCE:
        return Division.COPY
    if release < COPY_BOUND_SINCE:
        return Division.IN_PLACE
    return Division.COPY_BOUND if release < JOINT_SINCE else Division.JOINT


@dataclass(slots=True)
class GrpoHead:
    terms: LossTerms
    """The trained policy's head (entropy moment included in forward_end)."""
    reference: Breakdown
    """The reference's head inside its no_grad forward."""


def grpo_head(spec: JobSpec, rows: int, new: int, v: int) -> GrpoHead:
    """The head of `rows` sequences scored over `new` completion tokens (module docstring)."""
    kind = division(spec)
    c, l = compute_dtype(spec), trainer_logits_dtype(spec)
    fp32 = l == "fp32"
    big_l, big_r = nbytes(rows * (new + 1) * v, l), nbytes(rows * new * v, l)
    logits = Breakdown().add("logits/logits", big_l)
    cast = Breakdown().add("logits/logits_model_dtype", nbytes(rows * (new + 1) * v, c)) if l != c else Breakdown()
    if kind is Division.JOINT and spec.backend is Backend.CUDA:
        terms = triton_selective(rows, new + 1, v, l)
        terms.forward_end = cast
        return GrpoHead(terms, Breakdown().merge(logits).merge(cast))
    # before 0.23 the entropy takes one batch row (C positions) at a time, unreshaped
    flat = spec.stack.minor("trl") >= ENTROPY_FLAT_SINCE
    chunk = min(ENTROPY_CHUNK_ROWS, rows * new) if flat else new
    chunks = Breakdown().add("logits/entropy_chunks", 3 * nbytes(chunk * v, l))
    # the scored view (a slice of C + 1 positions) reshapes in place only for one row
    reshaped = Breakdown().add("logits/entropy_reshape_copy", big_r if rows > 1 and flat else 0)
    copy = Breakdown().add("logits/temperature_copy", big_r)
    # the reference's head: accelerate's cast, the division's copy, or the 16-bit row loop
    # (two rows' log_softmax bound at once: `row_logps` still holds the previous one)
    ref_moments = [Breakdown().merge(logits).merge(cast)]
    if kind in (Division.COPY, Division.COPY_BOUND):
        ref_moments.append(Breakdown().merge(logits).merge(copy))
    if not fp32:
        ref_moments.append(Breakdown().merge(logits).add("logits/row_log_softmax",
                                                         min(2, rows) * nbytes(new * v, l)))
    reference = max(ref_moments, key=Breakdown.total)
    if kind is Division.IN_PLACE:
        terms = completion_logps_loss(rows, new, v, l)
        # What the selective head saved (the logits themselves in fp32, the rows' outputs in
        # 16-bit) is released by its own backward, before the division's: CopySlices' full-size
        # result, AsStrided's zeros of the base, the slice's clone and its DivBackward (PPO's
        # in-place division, jobs/selective.py, without PPO's `output` keeping the logits).
        # So the saved set is counted in the moments that hold it, not as saved.
        held = Breakdown().merge(terms.saved)
        terms.saved = Breakdown()
        copy_slices = (Breakdown().add("logits/grad_view_base", big_l).add("logits/grad_copy_slices", big_l)
                       .add("logits/grad_slice_clone", big_r).add("logits/grad_temperature_div", big_r))
        terms.backward_start = max((Breakdown().merge(held).merge(terms.backward_start), copy_slices),
                                   key=Breakdown.total)
        # the view binds the logits until the function returns
        terms.forward_end = Breakdown().merge(held).merge(Breakdown() if fp32 else logits)
        entropy = Breakdown().merge(terms.forward_end).merge(reshaped).merge(chunks)
    elif kind is Division.JOINT:
        terms = completion_logps_loss(rows, new, v, l)
        # `outputs` binds the logits; the 16-bit path saves the rows' outputs, not them
        entropy = Breakdown().merge(reshaped).merge(chunks).merge(Breakdown() if fp32 else logits)
    else:
        terms = completion_logps_loss(rows, new, v, l)
        bound = logits if kind is Division.COPY_BOUND else Breakdown()
        if fp32:  # gather and logsumexp save the copy; its gradient goes back through the division
            terms.saved = Breakdown().merge(copy)
            terms.head_backward = Breakdown().add("logits/grad_temperature_div", big_r).add("logits/grad_logits", big_l)
            terms.forward_end = Breakdown().merge(logits)  # at the division, beside the saved copy
            entropy = Breakdown().merge(bound).merge(chunks)
        else:  # the rows' outputs are saved; the copy is a local. At the division the logits
            # and the copy are alive and no row is saved yet: the saved rows (the copy's size)
            # stand in for the copy there
            terms.forward_end = max((Breakdown().merge(logits), Breakdown().merge(bound).merge(copy)),
                                    key=Breakdown.total)
            entropy = Breakdown().merge(bound).merge(copy).merge(chunks)
    if spec.stack.minor("trl") < GRPO_ENTROPY_SINCE:
        entropy = Breakdown()  # `_get_per_token_logps`: log-probs only
    moments = [terms.forward_end, entropy, cast_moment(terms, logits, cast)]
    terms.forward_end = max(moments, key=Breakdown.total)
    return GrpoHead(terms, reference)


__all__ = ["grpo_head", "division", "Division", "GrpoHead", "IN_PLACE_SINCE", "COPY_BOUND_SINCE", "JOINT_SINCE"]

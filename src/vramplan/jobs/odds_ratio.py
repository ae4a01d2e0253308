"""ORPO and SimPO: one trained model, chosen and rejected rows, the full logits.

TRL 1.16 runs them in trl.experimental: orpo/orpo_trainer.py `ORPOTrainer` and
cpo/cpo_trainer.py `CPOTrainer` (SimPO = `loss_type="simpo"`, `cpo_alpha=0.0`).
`concatenated_forward` runs the 2b chosen + rejected rows at once and keeps `all_logits`
(r, s, v) as the model returns them (fp32 copies under the trainer's autocast:
jobs/trained.py `trainer_logits_dtype`). ORPO then takes the NLL of the chosen rows:
`logits[..., :-1, :].contiguous()` (a copy) into `nn.CrossEntropyLoss` (log_softmax, whose
output is saved); CPO skips it when `cpo_alpha == 0`. Both score the labels with
`get_batch_logps` -> trl/trainer/utils.py `selective_log_softmax`:
* off CUDA, fp32 logits: `gather` and a per-row `logsumexp`, which save views of the logits
  (so the logits live until their backward) and, in backward, gather's `new_zeros` and
  `scatter_add` beside the stacked row gradients (jobs/rl.py `completion_logps_loss`);
  16-bit logits: a per-row `log_softmax`, each output saved;
* on CUDA with Triton, `selective_log_softmax_and_entropy` (trl/kernels/logprob_entropy.py
  `_LogProbEntropyFunction`): saves the logits and four per-token fp32 vectors; backward
  writes one `empty_like(logits)` gradient.
Legend: r = 2b rows, s sequence, v vocabulary, l the loss's dtype, c compute dtype,
U_b = b * (s - 1) * v elements (the chosen rows' shifted logits).
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.jobs.selective import completion_logps_loss
from vramplan.jobs.trained import LossTerms, compute_dtype, trainer_logits_dtype
from vramplan.spec import Backend, JobSpec, Task
from vramplan.units import nbytes


def triton_selective(rows: int, s: int, v: int, l: str) -> LossTerms:
    """`_LogProbEntropyFunction` on the shifted logits view (CUDA)."""
    n = rows * (s - 1)
    full = nbytes(rows * s * v, l)
    saved = Breakdown().add("logits/logits", full).add("logprob/per_token_fp32", 4 * nbytes(n, "fp32"))
    start = Breakdown().add("logits/grad_logits_shifted", nbytes(n * v, l))
    return LossTerms(saved, Breakdown(), start, Breakdown().add("logits/grad_logits", full))


def odds_ratio_loss(spec: JobSpec, rows: int, s: int, v: int) -> LossTerms:
    """The trained model's loss terms for task orpo or simpo (module docstring)."""
    c, l = compute_dtype(spec), trainer_logits_dtype(spec)
    full = nbytes(rows * s * v, l)
    if spec.backend is Backend.CUDA:
        terms = triton_selective(rows, s, v, l)
    else:
        terms = completion_logps_loss(rows, s - 1, v, l)
    keeps_logits = "logits/logits" in terms.saved.terms
    moments = []
    if l != c:
        # accelerate's copy: the head's own logits and the fp32 copy at once
        moments.append(Breakdown().add("logits/logits_model_dtype", nbytes(rows * s * v, c)))
    if spec.task is Task.ORPO:
        u_b = nbytes(rows // 2 * (s - 1) * v, l)
        terms.saved.add("logits/nll_log_softmax", u_b)
        # inside CrossEntropyLoss: the contiguous shifted copy beside its log_softmax. With
        # 16-bit rows off CUDA the later moment, all rows' saved log_softmax, is the larger.
        if keeps_logits:
            moments.append(Breakdown().add("logits/nll_shifted_copy", u_b))
        # backward, after the selective head's: its full-size gradient waits in the logits'
        # input buffer while the chosen rows' SliceBackward makes its own zeros of all rows
        # from the (b, s, v) gradient of the chosen slice
        terms.head_backward = (Breakdown().add("logits/grad_logits", full).add("logits/grad_chosen_rows", full)
                               .add("logits/grad_chosen_slice", nbytes(rows // 2 * s * v, l)))
    moments.append(terms.forward_end)
    terms.forward_end = max(moments, key=Breakdown.total)
    return terms


__all__ = ["odds_ratio_loss", "triton_selective"]

"""TRL's SFTTrainer before its fused head: after the model's own loss, `compute_loss` scores
entropy and token accuracy over the full logits under `torch.no_grad()`, while everything
the loss saved for backward is still alive (trl/trainer/sft_trainer.py `compute_loss`,
trl/trainer/utils.py `entropy_from_logits`). The moment can exceed the loss's own.

What is alive beside the saved tensors (L: the logits the trainer gets, fp32 under autocast,
which accelerate's `convert_outputs_to_fp32` copies them to, else the head's dtype; T' = rows
x (s - 1) shifted positions; a chunk is 128 flattened rows):

* 0.15 <= TRL < 0.22: the token accuracy only: `outputs.logits[..., :-1, :].contiguous()`
  (a T' x v copy when there is more than one row) and its int64 argmax, beside L.
* TRL 0.22: first `entropy_from_logits(outputs.logits)` one batch row at a time
  (`chunk_size=1` along the batch: three s x v tensors), then the same accuracy.
* 0.23 <= TRL < 1.4: `entropy_from_logits(outputs.logits)` folds 128-row chunks, each holding
  log_softmax, exp and their product (three chunks) beside L; then the accuracy's
  `outputs.logits[..., :-1, :].contiguous()` (a T' x v copy when there is more than one row)
  and its int64 argmax.
* 1.4 <= TRL < 1.6: the shifted copy is made first and the entropy runs on it (L + copy +
  three chunks); the accuracy then makes a second copy while the first is still bound.
* 1.6 <= TRL < 1.10: the shifted logits are a view; `reshape(-1, v)` of that non-contiguous
  view copies it (more than one row), beside L and the three chunks.

Measured on CPU with 0.25.1, 1.4.0 and 1.6.0 (bench/trainers/trl_releases.py), and 0.19.1
and 0.22.2; the others are read from their source. Before 0.15 SFTTrainer keeps the
Trainer's own loss (nothing is added); from 1.7 chunked_nll (jobs/chunked_nll.py).
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.i18n import Msg
from vramplan.spec import JobSpec, LossImpl, Task
from vramplan.spec.stack import Framework
from vramplan.units import nbytes

ENTROPY_CHUNK_ROWS = 128
"""trl/trainer/utils.py entropy_from_logits `chunk_size: int = 128` (0.23 onwards)."""
ENTROPY_FLAT_SINCE = (0, 23)
"""entropy_from_logits flattens the leading dimensions and takes 128-row chunks from 0.23;
0.21 and 0.22 split dimension 0 with `chunk_size=1`: one batch row (all its positions) at a
time, with no reshape (read from 0.22.2 and 0.23.1)."""
_ACCURACY_SINCE, _ROW_ENTROPY, _SINCE, _COPY_FIRST, _VIEW = (0, 15), (0, 22), (0, 23), (1, 4), (1, 6)
CHUNKED_NLL_SINCE = (1, 7)
"""SFTConfig's loss_type defaults to chunked_nll from 1.7 (jobs/chunked_nll.py): no metrics
pass over the full logits from then on."""


def metrics_moment(spec: JobSpec, rows: int, s: int, v: int, logits_dtype: str) -> Breakdown | None:
    """The transient set of SFTTrainer's metrics, or None where that release computes none
    over the full logits (or the job is not TRL's SFT with the model's own loss)."""
    release = spec.stack.minor("trl")
    if (spec.task is not Task.SFT or spec.stack.framework is not Framework.TRL or release is None
            or not _ACCURACY_SINCE <= release < CHUNKED_NLL_SINCE or spec.loss_impl is not LossImpl.STANDARD):
        return None
    t = rows * s
    shifted = rows * (s - 1)
    copy = nbytes(shifted * v, logits_dtype) if rows > 1 else 0
    chunks = 3 * nbytes(min(ENTROPY_CHUNK_ROWS, shifted if release >= _COPY_FIRST else t) * v, logits_dtype)
    if release < _SINCE:  # 0.22's entropy folds one batch row (s x v) at a time; none before
        chunks = 3 * nbytes(s * v, logits_dtype) if release >= _ROW_ENTROPY else 0
    argmax = nbytes(shifted, "int64")
    held = Breakdown().add("logits/trainer_logits", nbytes(t * v, logits_dtype))
    if release < _COPY_FIRST:
        entropy, accuracy = chunks, copy + argmax
    elif release < _VIEW:
        entropy, accuracy = copy + chunks, 2 * copy + argmax
    else:
        entropy, accuracy = copy + chunks, argmax
    if entropy >= accuracy:
        return held.add("logits/metrics_shifted_copy", entropy - chunks).add("logits/entropy_chunks", chunks)
    return held.add("logits/metrics_shifted_copy", accuracy - argmax).add("logits/accuracy_argmax", argmax)


def notes(spec: JobSpec) -> list[Msg]:
    """What the answer says of a TRL release's SFT loss where it is not TRL 1.16's."""
    release = spec.stack.minor("trl")
    if spec.task is not Task.SFT or spec.stack.framework is not Framework.TRL or release is None:
        return []
    if CHUNKED_NLL_SINCE <= release < FUSED_SINCE:
        # trl/trainer/sft_config.py: loss_type defaults to "chunked_nll" from 1.7
        return [Msg("SFT loss: TRL {release}'s default chunked_nll (the head and cross-entropy in 256-token "
                    "checkpointed chunks, each with fp32 copies of the head weight)", release=spec.stack.trl)]
    return []


FUSED_SINCE = (1, 15)
"""The fused log-prob head (jobs/logprob.py resolve_head): measured with 1.16; 1.15 ships the
same kernel (trl/kernels/chunked_logprob.py, 4096 x 32768 tiles) with Triton only, no CPU
fallback, so it was not run here."""

__all__ = ["metrics_moment", "notes", "ENTROPY_CHUNK_ROWS", "ENTROPY_FLAT_SINCE", "FUSED_SINCE", "CHUNKED_NLL_SINCE"]

"""`selective_log_softmax` (trl/trainer/utils.py) as TRL's trainers score their logits with
it: what it holds under no_grad and what it saves and allocates in backward. The trainers'
heads around it: jobs/rl.py (GRPO, PPO), jobs/grpo_head.py, jobs/dpo_head.py, jobs/odds_ratio.py.
Legend: r rows, C scored positions, v vocabulary, c the logits' dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.jobs.trained import LossTerms
from vramplan.units import nbytes


def completion_logps_head(rows: int, new: int, v: int, c: str) -> Breakdown:
    """TRL 0.x `_get_per_token_logps` under no_grad: `model(..., logits_to_keep=C + 1)`
    logits (rows, C + 1, v) in c, the last position dropped (a view), then
    trl.trainer.utils.selective_log_softmax: for bf16/fp16 a loop over rows holding one
    row's `log_softmax` (C, v) at a time; for fp32 `gather` and a per-row `torch.logsumexp`
    (fused on the row: no (C, v) temporary). Temperature 1.0 (TRL's default): no scaled copy."""
    out = Breakdown().add("logits/logits", nbytes(rows * (new + 1) * v, c))
    if c != "fp32":
        out.add("logits/row_log_softmax", nbytes(new * v, c))
    return out


def completion_logps_loss(rows: int, new: int, v: int, c: str, logits_len: int | None = None,
                          rolled: bool = False) -> LossTerms:
    """The same head with gradients (selective_log_softmax, trl/trainer/utils.py).
    bf16/fp16 rows: each row's log_softmax output is saved (rows x C x v in all); backward
    turns them one by one into row gradients, UnbindBackward stacks them (rows, C, v) with
    the saved outputs gone, then SliceBackward's full-size (rows, C + 1, v) zeros.
    fp32: `gather` and `logsumexp` save the logits themselves (views: the (C + 1) logits
    stay alive); backward holds gather's `new_zeros` and `scatter_add` and the stacked
    logsumexp row gradients (3 x rows x C x v fp32) beside them, then SliceBackward.
    PPO (trl/trainer/ppo_trainer.py: `forward(model, mb_query_responses, ...)` passes no
    logits_to_keep, then `logits = output.logits[:, context_length - 1 : -1]`): the logits
    cover all `logits_len` = P + C positions. `rolled`: the logits are the `new` scored
    positions themselves (TRL 0.2x DPO scores `torch.roll(input_ids, -1)`: no slice).
    """
    rcv = nbytes(rows * new * v, c)
    full = rcv if rolled else nbytes(rows * (logits_len or new + 1) * v, c)
    head = Breakdown().add("logits/grad_logits", full)
    if logits_len:
        # PPO: `logits /= args.temperature + 1e-7` (PPOConfig temperature 0.7) in place on the
        # view of the (rows, S, v) logits makes a CopySlices node: the view's gradient lands in
        # a full-size zeros of the base (AsStridedBackward), CopySlices allocates its full-size
        # result, clones the slice's gradient and runs DivBackward on it (rows x C x v each).
        # That stage is larger than the gather/logsumexp one before it (full >= rcv).
        grad = (Breakdown().add("logits/grad_view_base", full).add("logits/grad_copy_slices", full)
                .add("logits/grad_slice_clone", rcv).add("logits/grad_temperature_div", rcv))
        # `output` keeps the logits alive through the whole backward. bf16/fp16: the rows'
        # saved log_softmax outputs are freed by their backward before this stage (counted at
        # the end of the forward only).
        end = Breakdown().add("logits/log_softmax", rcv) if c != "fp32" else Breakdown()
        return LossTerms(Breakdown().add("logits/logits", full), end, grad, Breakdown())
    if c != "fp32":
        return LossTerms(Breakdown().add("logits/log_softmax", rcv), Breakdown().add("logits/logits", full),
                         Breakdown().add("logits/grad_rows_stacked", rcv), head)
    grad = (Breakdown().add("logits/grad_gather_zeros", rcv).add("logits/grad_gather_scatter", rcv)
            .add("logits/grad_rows_stacked", rcv))
    return LossTerms(Breakdown().add("logits/logits", full), Breakdown(), grad, head)


def cast_moment(terms: LossTerms, logits: Breakdown, cast: Breakdown) -> Breakdown:
    """accelerate's `convert_outputs_to_fp32` (the model's c-typed logits beside their fp32
    copy, `logits`), which comes before the head saves anything. Beside the saved set only
    where that is the logits themselves (or nothing): where the head saves a copy made after
    the cast (a shifted or divided copy, at least the c-typed logits' size), the copy's own
    moment is the larger, and this one is not counted."""
    saves_logits = "logits/logits" in terms.saved.terms
    if terms.saved.total() and not saves_logits:
        return Breakdown()
    return Breakdown().merge(cast).merge(Breakdown() if saves_logits else logits)


__all__ = ["cast_moment", "completion_logps_head", "completion_logps_loss"]

"""The one-line description of a job above every answer: who is trained, how many
parameters each model holds, and what one micro-batch is (pairs, rows, or video frames)."""
from __future__ import annotations

from vramplan.i18n import N_, Msg
from vramplan.spec import Task

# Tasks whose micro_batch_size counts preference pairs: each pair is a chosen and a rejected
# row, and both go through every model (trl DPOTrainer `concatenated_forward`, RewardTrainer
# `compute_loss`), so a micro-batch of b pairs is 2b rows.
PAIR_TASKS = (Task.DPO, Task.IPO, Task.ORPO, Task.SIMPO, Task.REWARD_MODEL)

BATCH_HELP = N_("per-device micro-batch: rows per GPU per micro-step; dpo/ipo/orpo/simpo/reward-model: "
              "PAIRS (each a chosen and a rejected row, so 2x rows); kto: unpaired rows; "
              "ppo/grpo: completions; diffusion: samples")


def params_text(est) -> str:
    """'policy 7.62 B + reference 7.62 B params' for several models, '7.616 B params' for one."""
    models = getattr(est, "models", None) or {}
    if len(models) > 1:
        return Msg("{models} params", models=" + ".join(f"{role} {n / 1e9:,.2f} B" for role, n in models.items()))
    return Msg("{billions} B params", billions=f"{est.num_params / 1e9:,.3f}")


def batch_text(spec) -> str:
    """What one micro-batch is, in the words of the task."""
    b, s = spec.micro_batch_size, spec.seq_len
    if spec.task is Task.DIFFUSION and spec.diffusion is not None:
        d = spec.diffusion
        if d.num_frames > 1:
            return Msg("b={b} video {frames}x{height}x{width} (frames x height x width)", b=b,
                       frames=d.num_frames, height=d.height, width=d.width)
        return Msg("b={b} image {height}x{width}", b=b, height=d.height, width=d.width)
    if spec.task in PAIR_TASKS:
        return Msg("b={b} pairs ({rows} rows: chosen + rejected) s={s}", b=b, rows=2 * b, s=s)
    if spec.task is Task.KTO:
        return Msg("b={b} unpaired rows s={s}", b=b, s=s)
    if spec.task in (Task.INFERENCE, Task.DISTILL) and spec.max_new_tokens:
        return Msg("b={b} prompt s={s} + {new} new tokens", b=b, s=s, new=spec.max_new_tokens)
    if spec.task in (Task.PPO, Task.GRPO, Task.RLOO):
        if spec.max_new_tokens:
            return Msg("b={b} completions, prompt s={s} + {new} new", b=b, s=s, new=spec.max_new_tokens)
        return Msg("b={b} completions, prompt s={s}", b=b, s=s)
    return f"b={b} s={s}"


def job_header(est) -> str:
    spec = est.spec
    if spec.task is Task.INFERENCE:  # no gradients, no optimizer, no checkpointing
        return Msg("{model}: {params} | inference, {precision} | {batch} | attention {attention}",
                   model=est.model.name, params=params_text(est), precision=spec.precision.value,
                   batch=batch_text(spec), attention=spec.attention.value)
    return Msg("{model}: {params}, {trainable} M trainable | {method}, {precision}, {optimizer} ({impl}) | {batch} | "
               "checkpointing {ckpt}, attention {attention}", model=est.model.name, params=params_text(est),
               trainable=f"{est.trainable_params / 1e6:,.2f}", method=spec.method.value,
               precision=spec.precision.value, optimizer=spec.optimizer.value, impl=spec.optimizer_impl.value,
               batch=batch_text(spec), ckpt=spec.gradient_checkpointing.value, attention=spec.attention.value)

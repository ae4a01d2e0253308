"""The one-line description of a job above every answer: who is trained, how many
parameters each model holds, and what one micro-batch is (pairs, rows, or video frames)."""
from __future__ import annotations

from vramplan.spec import Task

# Tasks whose micro_batch_size counts preference pairs: each pair is a chosen and a rejected
# row, and both go through every model (trl DPOTrainer `concatenated_forward`, RewardTrainer
# `compute_loss`), so a micro-batch of b pairs is 2b rows.
PAIR_TASKS = (Task.DPO, Task.IPO, Task.ORPO, Task.SIMPO, Task.REWARD_MODEL)

BATCH_HELP = ("per-device micro-batch: rows per GPU per micro-step; dpo/ipo/orpo/simpo/reward-model: "
              "PAIRS (each a chosen and a rejected row, so 2x rows); kto: unpaired rows; "
              "ppo/grpo: completions; diffusion: samples")


def params_text(est) -> str:
    """'policy 7.62 B + reference 7.62 B params' for several models, '7.616 B params' for one."""
    models = getattr(est, "models", None) or {}
    if len(models) > 1:
        return " + ".join(f"{role} {n / 1e9:,.2f} B" for role, n in models.items()) + " params"
    return f"{est.num_params / 1e9:,.3f} B params"


def batch_text(spec) -> str:
    """What one micro-batch is, in the words of the task."""
    b, s = spec.micro_batch_size, spec.seq_len
    if spec.task is Task.DIFFUSION and spec.diffusion is not None:
        d = spec.diffusion
        if d.num_frames > 1:
            return f"b={b} video {d.num_frames}x{d.height}x{d.width} (frames x height x width)"
        return f"b={b} image {d.height}x{d.width}"
    if spec.task in PAIR_TASKS:
        return f"b={b} pairs ({2 * b} rows: chosen + rejected) s={s}"
    if spec.task is Task.KTO:
        return f"b={b} unpaired rows s={s}"
    if spec.task in (Task.PPO, Task.GRPO):
        new = f" + {spec.max_new_tokens} new" if spec.max_new_tokens else ""
        return f"b={b} completions, prompt s={s}{new}"
    return f"b={b} s={s}"


def job_header(est) -> str:
    spec = est.spec
    return (f"{est.model.name}: {params_text(est)}, {est.trainable_params / 1e6:,.2f} M trainable | "
            f"{spec.method.value}, {spec.precision.value}, {spec.optimizer.value} ({spec.optimizer_impl.value})"
            f" | {batch_text(spec)} | checkpointing {spec.gradient_checkpointing.value}, "
            f"attention {spec.attention.value}")

"""Settings a job's task never reads: refused, so the answer is not a number for a job other
than the one described (round 3 of the bad-input sweep found each of these dropped without
a word, the estimate unchanged)."""
from __future__ import annotations

from vramplan.spec.enums import Attention, Checkpointing, LossImpl, Method, SpecError, Task
from vramplan.spec.packing import check_packing

GENERATING_TASKS = (Task.PPO, Task.GRPO, Task.RLOO)
"""Tasks whose step generates completions (jobs/rl.py reads `generation`: engine, batch, vLLM share)."""


def check_unread(spec) -> None:
    check_packing(spec)
    task = spec.task
    if spec.generation is not None and task not in GENERATING_TASKS:
        raise SpecError("generation", f"task {task.value} generates no completions; the section is read by tasks "
                        "ppo, grpo and rloo only; drop it")
    if spec.lengths is not None and task is Task.DIFFUSION:
        raise SpecError("lengths", "a diffusion job has no token rows to pad; drop the lengths section")
    if spec.vision is not None and spec.loss_impl is not LossImpl.STANDARD:
        raise SpecError("loss_impl", "a vision-language job is estimated with the standard loss; use loss_impl standard")
    if task is Task.DIFFUSION:
        _check_diffusion(spec)


def _check_diffusion(spec) -> None:
    """A denoiser's step (diffusers' training scripts) has no token loss, no embedding noise
    and no torchtune-only memory options. (logprob_head stays free: the measuring harness
    writes `full` into every job it records.)"""
    for name, given in (("loss_impl", spec.loss_impl is not LossImpl.STANDARD),
                        ("neftune_noise_alpha", spec.neftune_noise_alpha is not None),
                        ("optimizer_in_backward", spec.optimizer_in_backward),
                        ("activation_offloading", spec.activation_offloading),
                        ("gradient_checkpointing", spec.gradient_checkpointing
                         not in (Checkpointing.NONE, Checkpointing.FULL))):
        if given and name == "gradient_checkpointing":
            raise SpecError(name, "the diffusers training scripts checkpoint whole blocks (--gradient_checkpointing); "
                            "use none or full")
        if given:
            raise SpecError(name, "a diffusion job does not read it (the denoiser's training step has no token "
                            "loss, embedding noise or torchtune memory options); drop it")
    # fuzz: each of these gave the number of the job without it
    if spec.checkpoint_every > 1:
        raise SpecError("checkpoint_every", "the diffusers training scripts checkpoint every block "
                        "(--gradient_checkpointing), not one in N; drop checkpoint_every")
    if spec.method is Method.QLORA:
        raise SpecError("method", "a quantized frozen base (QLoRA) is modelled on language models, not on "
                        "diffusion denoisers; use method lora")
    if spec.float8 is not None:
        raise SpecError("float8", "torchao float8 training of a diffusion denoiser is not modelled; drop float8")
    if spec.attention is Attention.EAGER:
        raise SpecError("attention", "a diffusion denoiser is modelled with diffusers' default attention "
                        "processor (torch's scaled_dot_product_attention); use attention sdpa")


__all__ = ["GENERATING_TASKS", "check_unread"]

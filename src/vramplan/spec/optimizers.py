"""Which optimizer settings go together (checked once, in JobSpec.__post_init__)."""
from __future__ import annotations

from vramplan.spec.enums import Method, Optimizer, SpecError, Task

LOW_RANK = (Optimizer.GALORE_ADAMW, Optimizer.APOLLO_ADAMW)
FUSED_IN_BACKWARD = (Optimizer.LOMO, Optimizer.ADALOMO)
"""Optimizers whose update is a gradient hook: they always step inside backward."""


def steps_in_backward(spec) -> bool:
    """The update runs per parameter inside backward (optimizer_in_backward, LOMO, AdaLomo)."""
    return spec.optimizer_in_backward or spec.optimizer in FUSED_IN_BACKWARD


def check_optimizer_fields(spec) -> None:
    opt = spec.optimizer
    if opt in LOW_RANK and spec.low_rank is None:
        # transformers/trainer_optimizer.py _setup_low_rank_optimizer refuses the same
        # ("You need to define `optim_target_modules`"); GaLore has no rank by default.
        raise SpecError("low_rank", f"{opt.value} needs a low_rank section, e.g. "
                        "low_rank: {rank: 128, target_modules: all-linear}")
    if spec.low_rank is not None and opt not in LOW_RANK:
        raise SpecError("low_rank", f"only galore-adamw and apollo-adamw project gradients; "
                        f"drop low_rank or change optimizer {opt.value}")
    if spec.momentum and opt is not Optimizer.SGD:
        # momentum is torch.optim.SGD's argument; the others keep their own moment states
        # (AdamW's betas), so a momentum here changes nothing and is a slip.
        raise SpecError("momentum", f"only optimizer sgd takes momentum, not {opt.value}; drop momentum or "
                        "set optimizer: sgd")
    if spec.num_labels != 2 and spec.task not in (Task.SEQUENCE_CLASSIFICATION, Task.REWARD_MODEL):
        # the classification head (AutoModelForSequenceClassification's `score`) is built only
        # for sequence-classification; a language model's head is its vocabulary.
        raise SpecError("num_labels", f"task {spec.task.value} has no classification head; drop num_labels "
                        "or set task: sequence-classification")
    if steps_in_backward(spec) and spec.grad_accum_steps > 1:
        # torchtune recipes: "Gradient accumulation is not supported with optimizer in bwd";
        # transformers' layer-wise GaLore: "does not support gradient accumulation".
        field = "optimizer_in_backward" if spec.optimizer_in_backward else "grad_accum_steps"
        raise SpecError(field, "the optimizer steps each parameter as its gradient is made, so "
                        "gradients cannot accumulate; use grad_accum_steps 1")
    if spec.optimizer_in_backward and spec.task is Task.INFERENCE:  # no optimizer: the switch was never read
        raise SpecError("optimizer_in_backward", "task inference runs no optimizer; drop optimizer_in_backward")
    trained = [m.role for m in spec.models if getattr(m, "method", "frozen") != "frozen"]
    if steps_in_backward(spec) and (spec.task is Task.PPO or trained):
        # a second trained model (PPO's critic, a trained role of `models`) stepped inside
        # backward is not modelled: the step failed inside (IndexError in timeline._walk)
        second = "the critic (task ppo)" if spec.task is Task.PPO else f"role {trained[0]}"
        field = "optimizer_in_backward" if spec.optimizer_in_backward else "optimizer"
        raise SpecError(field, f"an optimizer step inside backward is modelled for one trained model, and "
                        f"{second} trains too; use an optimizer that steps after backward (e.g. adamw)")
    if opt is Optimizer.ADAM_MINI and spec.method in (Method.LORA, Method.QLORA):
        # adam_mini.py views q/k weights as (-1, dim*dim/n_heads) blocks; a LoRA A/B matrix
        # named ...q_proj.lora_A does not split into heads.
        raise SpecError("optimizer", "adam-mini partitions the model's own weights by head and "
                        "neuron; it does not take LoRA adapters (use adamw with lora)")

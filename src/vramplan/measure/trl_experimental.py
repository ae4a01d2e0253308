"""TRL 1.16's distillation and odds-ratio/contrastive preference trainers, under the meter.

    from vramplan.measure.trl_experimental import BUILDERS   # task -> builder, as trainers.py

* distill: ``trl.experimental.gkd.GKDTrainer`` with ``lmbda=0.0`` and ``seq_kd=False``: the
  teacher scores the job's own rows, the student is trained on the generalized JSD of the
  two distributions with GKDConfig's default ``beta=0.5`` (gkd_trainer.py ``compute_loss``
  -> ``generalized_jsd_loss``). With ``max_new_tokens`` the job is on-policy: TRL 1.16's
  ``trl.DistillationTrainer``, whose student generates the completions the teacher scores.
* orpo: ``trl.experimental.orpo.ORPOTrainer``; simpo: ``trl.experimental.cpo.CPOTrainer``
  with ``loss_type="simpo"`` and ``cpo_alpha=0.0`` (TRL's SimPO recipe: no NLL term).
* PPO is not shipped by TRL 1.16 (neither trl nor trl.experimental has a PPOTrainer): its
  measurement stays the hand-written step of measure/ppo.py, and says so.

Precision follows the spec's stack (components/dtypes.py): the weights are built in the
dtype the job loads them in and the trainer's ``bf16``/``fp16`` flag is set where the stack
turns the word into autocast, as TRL's configs do (``bf16=True`` over a bf16 checkpoint).
The older builders of measure/trainers.py run the 16-bit words without autocast.
"""
from __future__ import annotations

import torch

from . import trl_data as data
from .trainers import common_args, frozen_model, num_rows, peft_policy, policy_model, trl_dropout, with_optimizer

ENTRIES = {"distill": ("trl.experimental.gkd", "GKDTrainer"),
           "orpo": ("trl.experimental.orpo", "ORPOTrainer"),
           "simpo": ("trl.experimental.cpo", "CPOTrainer")}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def stack_precision(job: dict) -> tuple[torch.dtype, dict]:
    """(weights dtype, the trainer's bf16/fp16 flags) as the spec's stack means the precision."""
    from vramplan import load_spec
    from vramplan.components.dtypes import dtypes_of, resolve_load_dtype
    from vramplan.jobs import resolve_models

    spec = load_spec(job)
    spec = resolve_load_dtype(spec, resolve_models(spec)["policy"].checkpoint_dtype)
    d = dtypes_of(spec)
    if d.master_weights or d.policy == "fp32-params":
        raise ValueError(f"precision: {spec.precision.value} under stack {spec.stack.framework.value} keeps "
                         "fp32 master weights; the HF/TRL trainers have no such mode (use stack trl)")
    return DTYPES[d.weights], {"bf16": d.autocast == "bf16", "fp16": d.autocast == "fp16"}


def _gkd(job: dict, dtype, flags: dict):
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from transformers import default_data_collator
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    policy, peft_config = _policy(job, dtype)
    teacher = frozen_model(job, job["teacher"], dtype)
    vocab = policy.config.vocab_size
    args = GKDConfig(**common_args(job, flags), **trl_dropout(job), lmbda=0.0, seq_kd=False, max_length=int(job["seq_len"]))
    trainer = GKDTrainer(model=policy, teacher_model=teacher, args=args, data_collator=default_data_collator,
                         train_dataset=data.dataset(data.distill_rows(num_rows(job), job["seq_len"], vocab)),
                         processing_class=data.tokenizer(vocab), peft_config=peft_config)
    return trainer, {"policy": with_optimizer(trainer, job, flags), "teacher": teacher}, {}


def _distillation(job: dict, dtype, flags: dict):
    """TRL 1.16's DistillationTrainer (trl/trainer/distillation_trainer.py): the student
    generates `max_new_tokens` per prompt (HF generate, no EOS to stop at), the teacher scores
    them, the generalized JSD at DistillationConfig's default beta 1.0 (reverse KL) through
    trl/kernels/chunked_divergence.py."""
    from trl import DistillationConfig, DistillationTrainer

    policy, peft_config = _policy(job, dtype)
    teacher = frozen_model(job, job["teacher"], dtype)
    vocab = policy.config.vocab_size
    args = DistillationConfig(**common_args(job, flags), **trl_dropout(job),
                              max_completion_length=int(job["max_new_tokens"]), use_vllm=False,
                              generation_kwargs={"eos_token_id": None})
    trainer = DistillationTrainer(model=policy, teacher_model=teacher, args=args, peft_config=peft_config,
                                  train_dataset=data.dataset(data.prompt_rows(num_rows(job), job["seq_len"], vocab)),
                                  processing_class=data.tokenizer(vocab))
    return trainer, {"policy": with_optimizer(trainer, job, flags), "teacher": teacher}, {"generation": True}


def _odds_ratio(job: dict, dtype, flags: dict):
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    seq_len = int(job["seq_len"])
    if job["task"] == "orpo":
        from trl.experimental.orpo import ORPOConfig as Config, ORPOTrainer as Trainer
        extra = {}
    else:
        from trl.experimental.cpo import CPOConfig as Config, CPOTrainer as Trainer
        extra = {"loss_type": "simpo", "cpo_alpha": 0.0}
    policy, peft_config = _policy(job, dtype)
    vocab = policy.config.vocab_size
    args = Config(**common_args(job, flags), **trl_dropout(job), max_length=seq_len, dataset_num_proc=None, **extra)
    trainer = Trainer(model=policy, args=args, peft_config=peft_config,
                      train_dataset=data.dataset(data.preference_rows(num_rows(job), seq_len, vocab)),
                      processing_class=data.tokenizer(vocab))
    return trainer, {"policy": with_optimizer(trainer, job, flags)}, {}


def _policy(job: dict, dtype):
    """A QLoRA policy as the quantized base and `peft_config`, so that the trainer prepares it
    its own way (ORPO/CPO: prepare_model_for_kbit_training, then peft_module_casting_to_bf16;
    GKD: SFTTrainer's bf16 cast); a LoRA policy wrapped here (the same get_peft_model call)."""
    if job.get("method") == "qlora":
        return peft_policy(job, dtype)
    return policy_model(job, dtype), None


def _distill(job: dict, dtype, flags: dict):
    """distill with max_new_tokens: TRL's on-policy DistillationTrainer; else GKD off-policy."""
    return (_distillation if job.get("max_new_tokens") else _gkd)(job, dtype, flags)


BUILDERS = {"distill": _distill, "orpo": _odds_ratio, "simpo": _odds_ratio}


def runner(task: str, job: dict | None = None) -> dict:
    import trl

    if task == "distill" and job and job.get("max_new_tokens"):
        return {"library": "trl", "version": trl.__version__, "entry": "DistillationTrainer"}
    return {"library": "trl", "version": trl.__version__, "entry": ENTRIES[task][1],
            "module": ENTRIES[task][0]}


__all__ = ["BUILDERS", "ENTRIES", "runner", "stack_precision"]

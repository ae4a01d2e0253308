"""The real library trainers, one job each, under the exact CPU meter.

    from vramplan.measure.trainers import measure_trainer, runs_library
    result = measure_trainer(spec)          # result.runner == {"library": "trl", ...}

What runs (tiny random-init models built from the spec's config by measure/build.py, tiny
in-memory datasets from measure/trl_data.py, ``use_cpu=True``, ``report_to="none"``, no
saving, two optimizer steps):

* dpo, ipo: ``trl.DPOTrainer`` (``loss_type`` ``sigmoid`` / ``ipo``); a separate
  reference model, or, for a LoRA policy with no ``reference_model``, the policy with its
  adapter disabled (dpo_trainer.py ``_compute_loss`` -> ``use_adapter``), or, for
  ``reference_model: precomputed``, ``precompute_ref_log_probs=True`` (done before train());
* kto: ``trl.KTOTrainer``; reward-model: ``trl.RewardTrainer``;
* grpo, rloo: ``trl.GRPOTrainer``, ``trl.RLOOTrainer`` with HF ``generate`` (``use_vllm=False``)
  and a reward function;
* sft: the HF ``transformers.Trainer`` (the model's own causal-LM loss), with
  ``DataCollatorWithFlattening`` for ``packing``; under ``stack: trl`` TRL's SFTTrainer
  (``packing=True``: BFD packing, padding-free);
* distill, orpo, simpo: trl.experimental's GKDTrainer, ORPOTrainer, CPOTrainer
  (measure/trl_experimental.py, which also states how their precision is mapped).

The TRL configs' own defaults (``gradient_checkpointing=True``, ``bf16=True``: trl/trainer/
base_config.py ``_BaseConfig``) are overridden by the spec, which states both; the
optimizer is the spec's torch optimizer handed to the trainer (``optimizers=(opt, None)``),
so ``optimizer_impl`` is the spec's rather than Trainer's ``adamw_torch`` (for-loop on CPU).
Precision follows the spec's stack (measure/trl_experimental.py ``stack_precision``): under
``stack: hf-trainer``/``trl`` the word ``bf16`` is a bf16 model with the trainer's
``bf16=True`` (autocast), as the estimate reads it; ``stack: plain`` bf16 is pure bf16;
``amp-bf16`` an fp32 model with ``bf16=True``; ``mixed-*`` has no equivalent in these trainers.
"""
from __future__ import annotations

import tempfile

import torch

from . import MeasureResult
from . import trl_data as data
from .build import (
    apply_method, build_model, build_optimizer, job_dict,
)
from .trainer_meter import metered_train
from vramplan.spec.enums import Task
from vramplan.spec.grpo import GRPO_MAX_COMPLETION, default_generations

TRL_TASKS = {"dpo": "DPOTrainer", "ipo": "DPOTrainer", "kto": "KTOTrainer",
             "reward-model": "RewardTrainer", "grpo": "GRPOTrainer", "rloo": "RLOOTrainer",
             # trl.experimental (measure/trl_experimental.py)
             "distill": "GKDTrainer", "orpo": "ORPOTrainer", "simpo": "CPOTrainer"}
HF_TASKS = {"sft": "Trainer"}
DPO_LOSS = {"dpo": "sigmoid", "ipo": "ipo"}


def runs_library(task: str) -> bool:
    """Whether a library trainer is measured for ``task`` (and installed)."""
    if task in HF_TASKS:
        return True
    if task not in TRL_TASKS:
        return False
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def build_role(job: dict, field, dtype, task: str = "sft", num_labels: int | None = None):
    sub = dict(job, model=field, task=task, method="full")
    if num_labels is not None:
        from .build import hf_config_dict

        sub["model"] = dict(hf_config_dict(field), num_labels=num_labels)
    model = build_model(sub, "cpu", dtype)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = data.PAD
    model.config.pad_token_id = data.PAD
    return model


def policy_model(job: dict, dtype, task: str = "sft", num_labels: int | None = None):
    model = build_role(job, job["model"], dtype, task, num_labels)
    return apply_method(model, job, "cpu")


def peft_policy(job: dict, dtype):
    """(model, peft_config) for the trainers that take a reference (DPO, KTO, GRPO). A LoRA
    policy is handed over as TRL documents it, the base model with `peft_config`: the trainer
    wraps it (`get_peft_model`) and scores the reference with the adapter disabled. A PeftModel
    handed in instead gets a frozen copy of its adapter named "ref" as the reference
    (dpo_trainer.py, kto_trainer.py, grpo_trainer.py `__init__`: `model.add_adapter("ref",
    ...)`), which the spec does not state. A QLoRA policy is handed over the same way, the
    quantized base as `from_pretrained` loads it with `peft_config`, so that the trainer's own
    preparation runs (TRL >= 0.26: none, and its trainable parameters cast to bf16,
    sft_trainer.py / dpo_trainer.py `__init__`), not PEFT's prepare_model_for_kbit_training."""
    if job.get("method") not in ("lora", "qlora"):
        return policy_model(job, dtype), None
    from .build import lora_config

    base = build_role(job, job["model"], dtype)
    if job.get("method") == "qlora":
        from .quantized import quantize_base

        base = quantize_base(base, job, "cpu")
    return base, lora_config(job.get("lora") or {}, "sft")


def with_optimizer(trainer, job: dict, flags: dict):
    """The spec's optimizer over the parameters the trainer trains (after its PEFT wrapping):
    the Trainer builds none when one is set (trainer.py `create_optimizer`)."""
    trainer.optimizer = optimizers_for(trainer.model, job, flags)[0]
    return trainer.model


def frozen_model(job: dict, field, dtype):
    model = build_role(job, field, dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def common_args(job: dict, flags: dict) -> dict:
    """TrainingArguments fields every trainer gets (`flags` override them: a case that needs a
    third step, GRPO's num_iterations, names max_steps)."""
    gc = job.get("gradient_checkpointing", "none") not in (None, False, "none", "off")
    return dict(output_dir=tempfile.mkdtemp(prefix="vramplan-measure-"),
                per_device_train_batch_size=int(job.get("micro_batch_size", 1)),
                gradient_accumulation_steps=int(job.get("grad_accum_steps", 1)), max_steps=2,
                use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no",
                disable_tqdm=True, dataloader_num_workers=0, seed=0, gradient_checkpointing=gc,
                learning_rate=float(job.get("learning_rate", 1e-4)),
                label_smoothing_factor=float(job.get("label_smoothing", 0.0)),
                neftune_noise_alpha=job.get("neftune_noise_alpha")) | flags


def trl_dropout(job: dict) -> dict:
    """The spec's `disable_dropout` for a TRL config (its own default when the spec leaves it out)."""
    return {} if job.get("disable_dropout") is None else {"disable_dropout": bool(job["disable_dropout"])}


def optimizers_for(model, job: dict, flags: dict | None = None):
    """The spec's torch optimizer for the trainer, or (None, None) when the trainer args name
    an ``optim`` string: then the Trainer builds its own (transformers/trainer.py
    ``create_optimizer`` -> trainer_optimizer.py ``get_optimizer_cls_and_kwargs``)."""
    if flags and "optim" in flags:
        return None, None
    return build_optimizer([p for p in model.parameters() if p.requires_grad], job), None


def num_rows(job: dict) -> int:
    return 4 * int(job.get("micro_batch_size", 1)) * int(job.get("grad_accum_steps", 1))


def _dpo(job: dict, dtype, flags: dict):
    from trl import DPOConfig, DPOTrainer

    policy, peft_config = peft_policy(job, dtype)
    vocab = policy.config.vocab_size
    ref = job.get("reference_model")
    # precomputed: DPOConfig.precompute_ref_log_probs with no ref_model; DPOTrainer `__init__`
    # scores the dataset with the policy (`_precompute_ref_logps`) before train(), which is
    # metered from its first step on (the reference log-probs ride in the batch).
    precomputed = ref == "precomputed"
    lora_ref = ref is None and job.get("method") in ("lora", "qlora")
    ref_model = None if lora_ref or precomputed else frozen_model(job, ref or job["model"], dtype)
    args = DPOConfig(**common_args(job, flags), **trl_dropout(job), max_length=int(job["seq_len"]), precompute_ref_log_probs=precomputed,
                     loss_type=[DPO_LOSS[job["task"]]], dataset_num_proc=None)
    trainer = DPOTrainer(model=policy, ref_model=ref_model, args=args, peft_config=peft_config,
                         train_dataset=data.dataset(data.preference_rows(num_rows(job), job["seq_len"], vocab)),
                         processing_class=data.tokenizer(vocab))
    policy = with_optimizer(trainer, job, flags)
    models = {"policy": policy} | ({"reference": ref_model} if ref_model is not None else {})
    return trainer, models, {}


def _kto(job: dict, dtype, flags: dict):
    from trl import KTOConfig, KTOTrainer

    policy, peft_config = peft_policy(job, dtype)
    vocab = policy.config.vocab_size
    ref = job.get("reference_model")
    # precomputed: as DPO's, KTOTrainer `__init__` scores the dataset (`_precompute_ref_logps`)
    # with no reference kept (kto_trainer.py: ref_model None when precompute_ref_log_probs)
    precomputed = ref == "precomputed"
    lora_ref = ref is None and job.get("method") in ("lora", "qlora")
    ref_model = None if lora_ref or precomputed else frozen_model(job, ref or job["model"], dtype)
    args = KTOConfig(**common_args(job, flags), **trl_dropout(job), max_length=int(job["seq_len"]), dataset_num_proc=None,
                     precompute_ref_log_probs=precomputed)
    trainer = KTOTrainer(model=policy, ref_model=ref_model, args=args, peft_config=peft_config,
                         train_dataset=data.dataset(data.unpaired_rows(num_rows(job), job["seq_len"], vocab)),
                         processing_class=data.tokenizer(vocab))
    policy = with_optimizer(trainer, job, flags)
    models = {"policy": policy} | ({"reference": ref_model} if ref_model is not None else {})
    return trainer, models, {}


def _reward(job: dict, dtype, flags: dict):
    from trl import RewardConfig, RewardTrainer

    if job.get("method") == "qlora":
        # the quantized classifier with peft_config, as TRL documents it: the trainer wraps and
        # prepares it (a SEQ_CLS adapter, the score head in modules_to_save)
        from .build import lora_config
        from .quantized import quantize_base

        base = build_role(job, job["model"], dtype, "sequence-classification", num_labels=1)
        policy, peft_config = quantize_base(base, job, "cpu"), lora_config(job.get("lora") or {}, "reward-model")
    else:
        policy, peft_config = policy_model(job, dtype, "sequence-classification", num_labels=1), None
    vocab = policy.config.vocab_size
    args = RewardConfig(**common_args(job, flags), **trl_dropout(job), max_length=int(job["seq_len"]), dataset_num_proc=None)
    trainer = RewardTrainer(model=policy, args=args, peft_config=peft_config,
                            train_dataset=data.dataset(data.reward_rows(num_rows(job), job["seq_len"], vocab)),
                            processing_class=data.tokenizer(vocab))
    return trainer, {"policy": with_optimizer(trainer, job, flags)}, {}


def _length_reward(completions, **kwargs) -> list[float]:
    """A reward function (no reward model): the completion's length."""
    return [float(len(c)) for c in completions]


def _grpo(job: dict, dtype, flags: dict):
    return _group(job, dtype, flags, rloo=False)


def _rloo(job: dict, dtype, flags: dict):
    return _group(job, dtype, flags, rloo=True)


def _group(job: dict, dtype, flags: dict, rloo: bool):
    """GRPOTrainer, or RLOOTrainer (trl/trainer/rloo_trainer.py, the same generation and
    loading; its KL goes into the reward, and the policy scores its own old log-probs)."""
    from unittest import mock

    if rloo:
        from trl import RLOOConfig as Config, RLOOTrainer as Trainer
        from trl.trainer import rloo_trainer as module
    else:
        from trl import GRPOConfig as Config, GRPOTrainer as Trainer
        from trl.trainer import grpo_trainer as module

    policy, peft_config = peft_policy(job, dtype)
    vocab = policy.config.vocab_size
    # the estimate's defaults, TRL's (spec/tasks.py; the spec refuses a batch they do not divide)
    g = int(job.get("num_generations") or default_generations(Task(job["task"])))
    new = int(job.get("max_new_tokens") or GRPO_MAX_COMPLETION)
    ref = job.get("reference_model")
    # The spec's reference: none for "precomputed" (beta = 0.0, GRPOConfig's default from
    # 0.19, builds no reference); else GRPO's beta 0.04 (its 0.x default), RLOO's 0.05 (its
    # default). A LoRA policy is its own reference with the adapter disabled; otherwise the
    # trainer loads the reference from the policy's checkpoint path (`create_model_from_path`),
    # which a random-init model has not: the loader is handed the reference built from the
    # spec instead.
    beta = 0.0 if ref == "precomputed" else 0.05 if rloo else 0.04
    frozen = None if beta == 0.0 or job.get("method") in ("lora", "qlora") else frozen_model(job, ref or job["model"], dtype)
    # Every completion runs to max_new_tokens: generation with no EOS to stop at. (Not
    # `min_new_tokens`, which adds transformers' MinNewTokensLengthLogitsProcessor and its
    # (rows, v) fp32 clone/where copies at each sampling step, logits_process.py: TRL's
    # defaults add no logits processor, and the estimate models none.)
    args = Config(**common_args(job, flags), **trl_dropout(job), num_generations=g, max_completion_length=new, beta=beta,
                  use_vllm=False, generation_kwargs={"eos_token_id": None})
    # (create=True: releases before 0.26 load the reference another way; a LoRA policy or
    # beta 0 loads none)
    with mock.patch.object(module, "create_model_from_path", lambda *a, **k: frozen, create=True):
        trainer = Trainer(model=policy, reward_funcs=_length_reward, args=args, peft_config=peft_config,
                          train_dataset=data.dataset(data.prompt_rows(num_rows(job), job["seq_len"], vocab)),
                          processing_class=data.tokenizer(vocab))
    policy = with_optimizer(trainer, job, flags)
    models = {"policy": policy} | ({"reference": frozen} if frozen is not None else {})
    return trainer, models, {"generation": True}


def _sft(job: dict, dtype, flags: dict):
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments, default_data_collator

    policy = policy_model(job, dtype)
    vocab = policy.config.vocab_size
    args = TrainingArguments(**common_args(job, flags))
    # spec packing: transformers' padding-free collator (one row of b*s tokens, position_ids)
    collator = DataCollatorWithFlattening() if job.get("packing") else default_data_collator
    trainer = Trainer(model=policy, args=args, data_collator=collator,
                      train_dataset=data.dataset(data.lm_rows(num_rows(job), job["seq_len"], vocab)),
                      optimizers=optimizers_for(policy, job, flags))
    return trainer, {"policy": policy}, {}


def _sft_trl(job: dict, dtype, flags: dict):
    """TRL's SFTTrainer (stack trl): its own collator (input_ids, labels, attention_mask) and
    `compute_loss` with `fused_lm_head=True` (trl/trainer/sft_trainer.py), the chunked head."""
    from trl import SFTConfig, SFTTrainer

    # QLoRA handed over as TRL documents it (the quantized base and `peft_config`): the
    # trainer wraps and prepares it its own way. (A LoRA policy is wrapped here, which for
    # a 16-bit base comes to the same get_peft_model call.)
    policy, peft_config = peft_policy(job, dtype) if job.get("method") == "qlora" else (policy_model(job, dtype), None)
    vocab = policy.config.vocab_size
    # spec packing: SFTConfig packing (BFD, which turns padding_free on: sft_trainer.py
    # `__init__`), rows of seq_len/4 tokens packed four to a seq_len row
    pack = bool(job.get("packing")) and flags.get("packing", True)
    s = int(job["seq_len"])
    flags = {"packing": pack, "max_length": s} | flags
    args = SFTConfig(**common_args(job, flags), dataset_num_proc=None)
    rows = data.lm_rows(4 * num_rows(job), s // 4, vocab) if pack else data.lm_rows(num_rows(job), s, vocab)
    trainer = SFTTrainer(model=policy, args=args, train_dataset=data.dataset({"input_ids": rows["input_ids"]}),
                         processing_class=data.tokenizer(vocab), peft_config=peft_config)
    return trainer, {"policy": with_optimizer(trainer, job, flags)}, {}


BUILDERS = {"dpo": _dpo, "ipo": _dpo, "kto": _kto, "reward-model": _reward, "grpo": _grpo, "rloo": _rloo,
            "sft": _sft}


def _framework(job: dict) -> str:
    stack = job.get("stack") or {}
    return stack if isinstance(stack, str) else stack.get("framework", "plain")


def trl_sft(job: dict) -> bool:
    """SFT under `stack: trl`: TRL's SFTTrainer, whose loss is not the model's own."""
    return job["task"] == "sft" and _framework(job) == "trl"


def _runner(task: str, job: dict | None = None) -> dict:
    from .trl_experimental import ENTRIES, runner

    if task in ENTRIES:
        return runner(task, job)
    if task in HF_TASKS:
        import transformers

        return {"library": "transformers", "version": transformers.__version__, "entry": HF_TASKS[task]}
    import trl

    return {"library": "trl", "version": trl.__version__, "entry": TRL_TASKS[task]}


def measure_trainer(job, trace: bool = False, trainer_args: dict | None = None) -> MeasureResult:
    """Run the job's library trainer for two optimizer steps under the exact CPU meter.

    ``trainer_args``: trainer config fields the spec has no word for (e.g.
    ``gradient_checkpointing_kwargs``, SFTConfig's ``padding_free``), set over what the spec
    gives; bench/trainers records them with each case."""
    job = job_dict(job)
    task = job["task"]
    from . import trl_experimental

    if task in trl_experimental.BUILDERS:
        build, precision = trl_experimental.BUILDERS[task], trl_experimental.stack_precision
    elif trl_sft(job):  # SFT under stack trl: TRL's SFTTrainer
        build, precision = _sft_trl, trl_experimental.stack_precision
    elif task in BUILDERS:
        build, precision = BUILDERS[task], trl_experimental.stack_precision
    else:
        raise ValueError(f"task: no library trainer is measured for {task!r}")
    torch.manual_seed(0)
    dtype, flags = precision(job)
    flags = {**flags, **(trainer_args or {})}
    trainer, models, options = build(job, dtype, flags)
    runner = _runner(task, job)
    if trl_sft(job):
        import trl

        runner = {"library": "trl", "version": trl.__version__, "entry": "SFTTrainer"}
    return metered_train(trainer, models, runner, trace=trace, **options)


__all__ = ["measure_trainer", "runs_library", "trl_sft", "TRL_TASKS", "HF_TASKS"]

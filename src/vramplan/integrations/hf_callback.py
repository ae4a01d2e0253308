"""A Hugging Face `TrainerCallback`: check memory before the first step, then log the estimate
beside `torch.cuda.max_memory_allocated` after the first steps. An edge module (imports
transformers and torch; the estimator core does not).

    from vramplan.integrations.hf_callback import VramplanCallback
    trainer = Trainer(..., callbacks=[VramplanCallback(seq_len=2048)])

Before the first step the callback builds a JobSpec from the Trainer's model and
TrainingArguments and, on a CUDA device, raises `vramplan.DoesNotFitError` (with
suggestions) if the estimate exceeds what the device can give this process. Without CUDA
it checks against the catalog GPU named by `gpu=` if any, and skips the measurement.
After `measure_after_steps` steps it appends one record to `trainer.state.log_history`:
`vramplan/estimate_peak_allocated_bytes`, `vramplan/measured_max_allocated_bytes` (None
without CUDA) and their ratio.
"""
from __future__ import annotations

import logging

from transformers import TrainerCallback

from vramplan.spec import JobSpec, load_spec

logger = logging.getLogger("vramplan")

# TrainingArguments.optim values (transformers.training_args.OptimizerNames) -> spec fields.
_OPTIM = {
    "adamw_torch": {"optimizer": "adamw"}, "adamw_hf": {"optimizer": "adamw"},
    "adamw_torch_fused": {"optimizer": "adamw", "optimizer_impl": "fused"},
    "adamw_torch_xla": {"optimizer": "adamw"}, "adamw_torch_npu_fused": {"optimizer": "adamw"},
    "adamw_bnb_8bit": {"optimizer": "adamw-8bit"}, "adamw_8bit": {"optimizer": "adamw-8bit"},
    "paged_adamw_8bit": {"optimizer": "paged-adamw-8bit"},
    "paged_adamw_32bit": {"optimizer": "paged-adamw-32bit"},
    "adafactor": {"optimizer": "adafactor"}, "sgd": {"optimizer": "sgd"},
    "lion_32bit": {"optimizer": "lion"},
}
_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash", "flash_attention_3": "flash"}


def _precision(model, args) -> str:
    """The Trainer's own flag: bf16/fp16 turn on autocast over the weights as loaded
    (components/dtypes.py, stack hf-trainer); the loaded dtype is `_load_dtype`."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def _load_dtype(model) -> str:
    import torch
    dtype = next(model.parameters()).dtype
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def _lora_fields(model) -> dict:
    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        return {}
    cfg = next(iter(peft_config.values()))
    targets = cfg.target_modules
    targets = targets if isinstance(targets, str) else sorted(targets or ())
    quantized = getattr(model.get_base_model(), "is_loaded_in_4bit", False)
    out = {"method": "qlora" if quantized else "lora",
           "lora": {"r": cfg.r, "alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout,
                    "target_modules": targets, "modules_to_save": sorted(cfg.modules_to_save or ()),
                    "use_dora": bool(getattr(cfg, "use_dora", False)),
                    "use_rslora": bool(getattr(cfg, "use_rslora", False))}}
    return out


# TRL's config classes (trl/trainer/*_config.py, trl/experimental/*) -> the spec's task. Other
# TRL trainers (GKD's teacher, PPO's critic) need models the callback cannot see: pass
# `task=` and the other models as spec overrides.
_TRL_TASKS = {"SFTConfig": "sft", "DPOConfig": "dpo", "KTOConfig": "kto", "GRPOConfig": "grpo",
              "RLOOConfig": "rloo", "RewardConfig": "reward-model", "ORPOConfig": "orpo",
              "DistillationConfig": "distill"}


def _release(library: str) -> str | None:
    """The installed release as major.minor (a dev or rc suffix dropped), or None."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        parts = version(library).split(".")
    except PackageNotFoundError:
        return None
    digits = [p for p in parts[:2] if p.isdigit()]
    return ".".join(digits) if len(digits) == 2 else None


def _stack(args) -> dict:
    """The framework the arguments belong to (TRL's configs subclass TrainingArguments) and
    the releases installed here, which decide TRL's log-prob heads and metrics passes
    (jobs/logprob.py, components/trl_sft_metrics.py), PEFT's adapter dtype and
    transformers' loading dtype."""
    trl = any(cls.__module__.startswith("trl.") for cls in type(args).__mro__)
    releases = {lib: r for lib in ("transformers", "trl", "peft") if (r := _release(lib))}
    return {"framework": "trl" if trl else "hf-trainer", **releases}


def _trl_fields(args) -> dict:
    """Task and lengths from a TRL config (field names and defaults of trl/trainer/*_config.py)."""
    task = _TRL_TASKS.get(type(args).__name__)
    if task is None:
        return {}
    out = {"task": task}
    if task == "dpo" and getattr(args, "loss_type", None) in ("ipo", ["ipo"]):
        out["task"] = "ipo"
    if task in ("dpo", "kto") and getattr(args, "precompute_ref_log_probs", False):
        out["reference_model"] = "precomputed"
    if task == "distill":
        # DistillationTrainer: on-policy, max_completion_length new tokens per prompt; its
        # teacher by name when the config holds one (else pass `teacher=`)
        out["max_new_tokens"] = args.max_completion_length
        if getattr(args, "teacher_model_name_or_path", None):
            out["teacher"] = args.teacher_model_name_or_path
    if task in ("grpo", "rloo"):
        # GRPO's and RLOO's seq_len is the prompt; the completion and the group size are their own fields
        out.update(num_generations=args.num_generations, max_new_tokens=args.max_completion_length)
        if getattr(args, "max_prompt_length", None):
            out["seq_len"] = int(args.max_prompt_length)
        if getattr(args, "beta", None) == 0.0:
            out["reference_model"] = "precomputed"  # beta 0: TRL builds no reference
    return out


def spec_from_trainer(model, args, *, seq_len: int | None = None, **overrides) -> JobSpec:
    """A JobSpec for what the Trainer will run: model config, batch, precision, optimizer, and,
    under a TRL trainer, the task and the releases installed here."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.to_dict()
    trl = _trl_fields(args)
    seq = seq_len or trl.get("seq_len") or getattr(args, "max_seq_length", None) or getattr(args, "max_length", None)
    if not seq:
        seq = min(2048, config.get("max_position_embeddings") or 2048)
        logger.warning("vramplan: no seq_len given; assuming %d tokens per row", seq)
    data = {
        "model": config,
        "micro_batch_size": args.per_device_train_batch_size,
        "grad_accum_steps": args.gradient_accumulation_steps,
        "seq_len": int(seq),
        "num_gpus": max(1, args.world_size),
        "backend": "cuda" if args.device.type == "cuda" else "cpu",
        "precision": _precision(model, args), "load_dtype": _load_dtype(model), "stack": _stack(args),
        # transformers 5 renamed gradient_checkpointing to activation_checkpointing.
        "gradient_checkpointing": "full" if (getattr(args, "activation_checkpointing", False)
                                             or getattr(args, "gradient_checkpointing", False)) else "none",
        "attention": _ATTENTION.get(getattr(base.config, "_attn_implementation", None) or "sdpa", "sdpa"),
        "weight_decay": args.weight_decay,
        **_OPTIM.get(str(getattr(args.optim, "value", args.optim)), {"optimizer": "adamw"}),
        **_lora_fields(model),
    }
    if type(base).__name__.endswith("ForSequenceClassification") and "task" not in trl:
        data.update(task="sequence-classification", num_labels=base.config.num_labels)
    data.update({k: v for k, v in trl.items() if k != "seq_len"})
    data.update(overrides)
    return load_spec(data)


class VramplanCallback(TrainerCallback):
    """Check before the first step; log estimate vs measured peak after the first steps."""

    def __init__(self, *, seq_len: int | None = None, gpu: str | None = None, headroom_bytes: int = 0,
                 measure_after_steps: int = 2, check: bool = True, **spec_overrides):
        self.seq_len = seq_len
        self.gpu = gpu
        self.headroom_bytes = headroom_bytes
        self.measure_after_steps = measure_after_steps
        self.do_check = check
        self.spec_overrides = spec_overrides
        self.spec: JobSpec | None = None
        self.estimate = None
        self.record: dict | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from vramplan.estimation import estimate
        self.spec = spec_from_trainer(model, args, seq_len=self.seq_len, **self.spec_overrides)
        self.estimate = estimate(self.spec)
        logger.info("vramplan: estimated peak allocated %.2f GiB per GPU",
                    self.estimate.peak_allocated_bytes / 2**30)
        if self.do_check:
            self._check(args)
        if _cuda(args):
            import torch
            torch.cuda.reset_peak_memory_stats(args.device)

    def _check(self, args) -> None:
        """Raises DoesNotFitError before any step if the job will not fit."""
        from vramplan.check import LocalGPU, check
        if _cuda(args):
            import torch
            index = args.device.index or 0
            free, total = torch.cuda.mem_get_info(index)
            # The model is already on the device: what this process holds counts as available.
            mine = torch.cuda.memory_reserved(index)
            local = LocalGPU(index, torch.cuda.get_device_name(index), int(total), int(free + mine), "torch")
            check(self.spec.with_(backend="cuda"), device=index, gpus=[local],
                  headroom_bytes=self.headroom_bytes)
        elif self.gpu:
            check(self.spec.with_(backend="cuda", gpu=self.gpu), gpus=[],
                  headroom_bytes=self.headroom_bytes)
        else:
            logger.info("vramplan: no CUDA device and no gpu= given; skipping the memory check")

    def on_step_end(self, args, state, control, **kwargs):
        if self.record is not None or state.global_step < self.measure_after_steps:
            return
        measured = None
        if _cuda(args):
            import torch
            measured = int(torch.cuda.max_memory_allocated(args.device))
        est = self.estimate.peak_allocated_bytes
        self.record = {"vramplan/estimate_peak_allocated_bytes": est,
                       "vramplan/measured_max_allocated_bytes": measured,
                       "vramplan/estimate_over_measured": None if not measured else est / measured,
                       "step": state.global_step}
        state.log_history.append(dict(self.record))
        if measured is None:
            logger.info("vramplan: estimate %.2f GiB; no CUDA device, measurement skipped", est / 2**30)
        else:
            logger.info("vramplan: estimate %.2f GiB, measured %.2f GiB (x%.3f)",
                        est / 2**30, measured / 2**30, est / measured)


def _cuda(args) -> bool:
    return getattr(args.device, "type", "cpu") == "cuda"

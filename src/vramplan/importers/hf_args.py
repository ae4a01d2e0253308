"""Hugging Face TrainingArguments / TRL config (JSON or YAML) -> spec overrides
(field names of transformers/training_args.py TrainingArguments and trl SFTConfig)."""
from __future__ import annotations

from vramplan.importers.report import ImportError_, ImportReport

# transformers/training_args.py OptimizerNames -> vramplan optimizer (+ implementation).
OPTIM = {
    "adamw_torch": ("adamw", None), "adamw_torch_fused": ("adamw", "fused"),
    "adamw_torch_foreach": ("adamw", "foreach"), "adamw_hf": ("adamw", None),
    "adamw_apex_fused": ("adamw", "fused"), "adafactor": ("adafactor", None),
    "adamw_bnb_8bit": ("adamw-8bit", None), "adamw_8bit": ("adamw-8bit", None),
    "paged_adamw_8bit": ("paged-adamw-8bit", None), "paged_adamw_32bit": ("paged-adamw-32bit", None),
    "paged_adamw": ("paged-adamw-32bit", None), "sgd": ("sgd", None), "lion_32bit": ("lion", None),
    "adam": ("adam", None),
}
_NO_MEMORY = {"output_dir", "learning_rate", "lr_scheduler_type", "warmup_ratio", "warmup_steps",
              "num_train_epochs", "max_steps", "logging_steps", "save_steps", "save_strategy",
              "eval_strategy", "evaluation_strategy", "report_to", "run_name", "seed", "logging_dir",
              "save_total_limit", "push_to_hub", "weight_decay", "max_grad_norm", "adam_beta1",
              "adam_beta2", "adam_epsilon", "dataloader_num_workers", "remove_unused_columns",
              "overwrite_output_dir", "do_train", "do_eval", "hub_model_id", "logging_first_step",
              "dataset_text_field", "ddp_find_unused_parameters", "per_device_eval_batch_size",
              "eval_steps", "load_best_model_at_end", "metric_for_best_model", "gradient_checkpointing_kwargs"}


def from_training_args(cfg: dict, source: str = "training-args") -> tuple[dict, ImportReport]:
    if not isinstance(cfg, dict):
        raise ImportError_(f"{source}: expected a mapping of TrainingArguments fields")
    rep = ImportReport(source)
    # The Trainer (or a TRL trainer, an HF Trainer subclass) runs the step: its meaning of
    # bf16/fp16 applies (components/dtypes.py).
    out: dict = {"stack": "trl" if any(k in cfg for k in _TRL_ONLY) else "hf-trainer"}
    for name, value in cfg.items():
        handler = _FIELDS.get(name)
        if handler:
            handler(value, out, rep, name)
        elif name in _NO_MEMORY:
            rep.ignored.append(name)
        else:
            rep.ignored.append(name)
    return out, rep


def _int(name, value, rep):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ImportError_(f"{rep.source}: {name} must be a positive integer, got {value!r}")
    return value


def _batch(v, out, rep, name):
    out["micro_batch_size"] = _int(name, v, rep)
    rep.use(name, "micro_batch_size")


def _accum(v, out, rep, name):
    out["grad_accum_steps"] = _int(name, v, rep)
    rep.use(name, "grad_accum_steps")


def _seq(v, out, rep, name):
    if v is None:
        return
    out["seq_len"] = _int(name, v, rep)
    rep.use(name, "seq_len")


def _gc(v, out, rep, name):
    out["gradient_checkpointing"] = "full" if v else "none"
    rep.use(name, "gradient_checkpointing")


def _bf16(v, out, rep, name):
    # Trainer with bf16=True runs torch.autocast over the weights as loaded (accelerate
    # mixed_precision="bf16"), unless DeepSpeed's bf16 section takes over: the stack's
    # word bf16, read with load_dtype (components/dtypes.py).
    if v:
        out.setdefault("precision", name)
        rep.use(name, f"precision = {name} (autocast over the load dtype)")


def _model_init_kwargs(v, out, rep, name):
    """TRL's `model_init_kwargs` (and `ref_model_init_kwargs`): the `dtype` (or 4.x
    `torch_dtype`) the trainer passes to from_pretrained when given a model name."""
    if not isinstance(v, dict):
        return
    for key in ("dtype", "torch_dtype"):
        if v.get(key) not in (None, "auto"):
            out["load_dtype"] = v[key]
            rep.use(f"{name}.{key}", "load_dtype")
            return


def _optim(v, out, rep, name):
    key = str(v).lower()
    if key not in OPTIM:
        rep.unresolved[name] = f"optimizer {v!r} is not modelled; known: {', '.join(sorted(OPTIM))}"
        return
    opt, impl = OPTIM[key]
    out["optimizer"] = opt
    if impl:
        out["optimizer_impl"] = impl
    rep.use(name, f"optimizer = {opt}")


def _fsdp(v, out, rep, name):
    """TrainingArguments.fsdp: a string of options ("full_shard auto_wrap offload") or a list."""
    opts = v.split() if isinstance(v, str) else list(v or [])
    modes = {"full_shard": "full-shard", "shard_grad_op": "shard-grad-op",
             "hybrid_shard": "hybrid-shard", "no_shard": "no-shard", "hybrid_shard_zero2": "hybrid-shard"}
    par = out.setdefault("parallel", {})
    for o in opts:
        if o in modes:
            par["fsdp"] = modes[o]
        elif o == "offload":
            par["offload_params"] = "cpu"
            par["offload_optimizer"] = "cpu"
    if par:
        rep.use(name, "parallel.fsdp")
    elif opts:
        rep.unresolved[name] = f"no sharding strategy in {v!r}"


def _fsdp_config(v, out, rep, name):
    if isinstance(v, dict) and str(v.get("version", v.get("fsdp_version", ""))) == "2":
        out.setdefault("parallel", {})["fsdp_version"] = 2
        rep.use(name + ".version", "parallel.fsdp_version")
    elif isinstance(v, dict):
        rep.ignored.append(name)


def _deepspeed(v, out, rep, name):
    """A path or an inline dict; the caller reads a path and passes it to from_deepspeed."""
    out["__deepspeed__"] = v
    rep.use(name, "DeepSpeed config (imported separately)")


def _lora(v, out, rep, name):
    if v:
        out["method"] = "lora"
        rep.use(name, "method = lora")


_FIELDS = {
    "per_device_train_batch_size": _batch, "gradient_accumulation_steps": _accum,
    "gradient_checkpointing": _gc, "bf16": _bf16, "fp16": _bf16, "optim": _optim,
    "fsdp": _fsdp, "fsdp_config": _fsdp_config, "deepspeed": _deepspeed,
    "max_seq_length": _seq, "max_length": _seq, "use_peft": _lora,
    "model_init_kwargs": _model_init_kwargs,
}

# Fields only TRL's configs have (trl/trainer/*_config.py): the file is a TRL config.
_TRL_ONLY = ("model_init_kwargs", "dataset_text_field", "max_seq_length", "beta", "num_generations",
             "max_prompt_length", "max_completion_length", "use_peft", "completion_only_loss", "packing")

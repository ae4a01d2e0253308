"""Hugging Face TrainingArguments / TRL config (JSON or YAML) -> spec overrides
(field names of transformers/training_args.py TrainingArguments and trl SFTConfig)."""
from __future__ import annotations

from vramplan.importers.report import ImportError_, ImportReport, need_bool, need_int

# transformers/training_args.py OptimizerNames -> vramplan optimizer (+ implementation).
OPTIM = {
    "adamw_torch": ("adamw", None), "adamw_torch_fused": ("adamw", "fused"),
    "adamw_torch_foreach": ("adamw", "foreach"), "adamw_hf": ("adamw", None),
    "adamw_apex_fused": ("adamw", "fused"), "adafactor": ("adafactor", None),
    "adamw_bnb_8bit": ("adamw-8bit", None), "adamw_8bit": ("adamw-8bit", None),
    "paged_adamw_8bit": ("paged-adamw-8bit", None), "paged_adamw_32bit": ("paged-adamw-32bit", None),
    "paged_adamw": ("paged-adamw-32bit", None), "sgd": ("sgd", None), "lion_32bit": ("lion", None),
    "adam": ("adam", None),
    "galore_adamw": ("galore-adamw", None), "galore_adamw_layerwise": ("galore-adamw", "in-backward"),
    "apollo_adamw": ("apollo-adamw", None), "apollo_adamw_layerwise": ("apollo-adamw", "in-backward"),
    "lomo": ("lomo", None), "adalomo": ("adalomo", None),
    "schedule_free_adamw": ("schedule-free-adamw", None),
    "adamw_torch_8bit": ("torchao-adamw-8bit", None), "adamw_torch_4bit": ("torchao-adamw-4bit", None),
}
# transformers/trainer_optimizer.py `_get_galore_optimizer` / `_get_apollo_optimizer`:
# rank 128 and update_proj_gap 200 unless `optim_args` says otherwise.
_LOW_RANK_DEFAULT_RANK = 128
_LOW_RANK_ARGS = {"rank": int, "update_proj_gap": int, "scale": float, "proj_type": str}
_NO_MEMORY = {"output_dir", "learning_rate", "lr_scheduler_type", "warmup_ratio", "warmup_steps",
              "num_train_epochs", "max_steps", "logging_steps", "save_steps", "save_strategy",
              "eval_strategy", "evaluation_strategy", "report_to", "run_name", "seed", "logging_dir",
              "save_total_limit", "push_to_hub", "max_grad_norm", "adam_beta1",
              "adam_beta2", "adam_epsilon", "dataloader_num_workers", "remove_unused_columns",
              "overwrite_output_dir", "do_train", "do_eval", "hub_model_id", "logging_first_step",
              "dataset_text_field", "ddp_find_unused_parameters", "per_device_eval_batch_size",
              "eval_steps", "load_best_model_at_end", "metric_for_best_model", "gradient_checkpointing_kwargs"}


def from_training_args(cfg: dict, source: str = "training-args", *,
                       file_defaults: bool = True) -> tuple[dict, ImportReport]:
    """file_defaults: a whole file, whose missing fields run with TrainingArguments' defaults
    (weight_decay 0.0); False for flags laid over a spec (cli/flags.py), which keep the spec's."""
    if not isinstance(cfg, dict):
        raise ImportError_(source, "config", "expected a mapping of TrainingArguments fields at the top level")
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
    if "weight_decay" not in cfg and file_defaults:
        # TrainingArguments.weight_decay defaults to 0.0 (transformers/training_args.py), not
        # torch's AdamW 0.01 (the spec's default): SGD builds no decayed-gradient temporary
        # (torch/optim/sgd.py) under the Trainer's own optim (bench/trainers optim-sgd)
        out["weight_decay"] = 0.0
        rep.use("weight_decay (TrainingArguments' default, 0.0)", "weight_decay")
    if out["stack"] == "trl":
        _trl_defaults(cfg, out, rep)
    if "low_rank" in out and out.get("optimizer") not in ("galore-adamw", "apollo-adamw"):
        out.pop("low_rank")  # optim_args / optim_target_modules of another optimizer
        rep.ignored += [k for k in ("optim_target_modules", "optim_args") if k in cfg]
    if cfg.get("bf16") is True and cfg.get("fp16") is True:
        # transformers TrainingArguments.__post_init__: at most one of fp16 and bf16.
        raise ImportError_(source, "bf16", "bf16 and fp16 cannot both be true; keep one")
    return out, rep


def _trl_defaults(cfg: dict, out: dict, rep: ImportReport) -> None:
    """The TrainingArguments defaults every TRL config overrides (trl/trainer/base_config.py
    `_BaseConfig`, TRL 1.16): `gradient_checkpointing` True, and `bf16` True unless `fp16` is
    set (`__post_init__`: `self.bf16 = not self.fp16 if self.bf16 is None`). A file that
    leaves them out runs with them, so the spec gets them too."""
    if "gradient_checkpointing" not in cfg:
        out["gradient_checkpointing"] = "full"
        rep.use("gradient_checkpointing (TRL's default, true)", "gradient_checkpointing")
    if cfg.get("bf16") is None and not cfg.get("fp16"):
        out.setdefault("precision", "bf16")
        rep.use("bf16 (TRL's default when fp16 is not set, true)", "precision = bf16 (autocast over the load dtype)")


def _int(name, value, rep):
    return need_int(rep, name, value)


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
    out["gradient_checkpointing"] = "full" if need_bool(rep, name, v) else "none"
    rep.use(name, "gradient_checkpointing")


def _bf16(v, out, rep, name):
    # Trainer with bf16=True runs torch.autocast over the weights as loaded (accelerate
    # mixed_precision="bf16"), unless DeepSpeed's bf16 section takes over: the stack's
    # word bf16, read with load_dtype (components/dtypes.py). None is the field left unset
    # (TRL's configs then decide: _trl_defaults).
    if v is not None and need_bool(rep, name, v):
        out.setdefault("precision", name)
        rep.use(name, f"precision = {name} (autocast over the load dtype)")


def _number(key):
    """A numeric field copied to spec `key` (the spec validates its range)."""
    def handler(v, out, rep, name):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ImportError_(rep.source, name, f"expected a number, got {v!r}")
        out[key] = float(v)
        rep.use(name, key)
    return handler


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
    key = v.lower() if isinstance(v, str) else None
    if key not in OPTIM:
        raise ImportError_(rep.source, name, f"optimizer {v!r} is not modelled; use one of "
                           f"{', '.join(sorted(OPTIM))} (or pass --optimizer)")
    opt, impl = OPTIM[key]
    out["optimizer"] = opt
    if impl == "in-backward":
        # *_layerwise: one optimizer per parameter stepped in a post-accumulate-grad hook
        # (transformers' _setup_low_rank_optimizer, LayerWiseDummyOptimizer)
        out["optimizer_in_backward"] = True
    elif impl:
        out["optimizer_impl"] = impl
    if opt in ("galore-adamw", "apollo-adamw"):
        out.setdefault("low_rank", {}).setdefault("rank", _LOW_RANK_DEFAULT_RANK)
    rep.use(name, f"optimizer = {opt}")


def _optim_target_modules(v, out, rep, name):
    if v is None:
        return
    if not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(t, str) for t in v))):
        raise ImportError_(rep.source, name, f"expected a module name, a list of names or 'all-linear', got {v!r}")
    out.setdefault("low_rank", {})["target_modules"] = v
    rep.use(name, "low_rank.target_modules")


def _optim_args(v, out, rep, name):
    """TrainingArguments.optim_args: "rank=64,update_proj_gap=100,scale=0.25"."""
    if v in (None, ""):
        return
    for key, value in low_rank_args(v, name, rep.source).items():
        out.setdefault("low_rank", {})[key] = value
        rep.use(f"{name}.{key}", f"low_rank.{key}")


def low_rank_args(v, name: str, source: str = "flags") -> dict:
    """The low_rank keys of an `optim_args` string ("rank=64,update_proj_gap=100,scale=0.25";
    transformers/trainer_optimizer.py splits it on commas into key=value pairs); other keys
    belong to other optimizers and are left out."""
    if not isinstance(v, str):
        raise ImportError_(source, name, f'expected "key=value,key=value", got {v!r}')
    out = {}
    for item in filter(None, (x.strip() for x in v.replace(" ", ",").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ImportError_(source, name, f'expected "key=value,key=value", got {item!r}')
        if key in _LOW_RANK_ARGS:
            try:
                out[key] = _LOW_RANK_ARGS[key](value)
            except ValueError:
                raise ImportError_(source, name, f"{key}={value!r} is not a number") from None
    return out


def _fsdp(v, out, rep, name):
    """TrainingArguments.fsdp: a string of options ("full_shard auto_wrap offload") or a list."""
    if isinstance(v, bool):  # TrainingArguments: True means full_shard, False nothing
        v = "full_shard" if v else ""
    if v is None:
        v = ""
    if not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(o, str) for o in v))):
        raise ImportError_(rep.source, name, f'expected options like "full_shard auto_wrap", got {v!r}')
    opts = v.split() if isinstance(v, str) else list(v)
    modes = {"full_shard": "full-shard", "shard_grad_op": "shard-grad-op",
             "hybrid_shard": "hybrid-shard", "no_shard": "no-shard", "hybrid_shard_zero2": "hybrid-shard"}
    unknown = [o for o in opts if o not in modes and o not in ("offload", "auto_wrap")]
    if unknown:  # transformers.trainer_utils.FSDPOption
        raise ImportError_(rep.source, name, f"unknown option {unknown[0]!r}; use "
                           f"{', '.join(modes)}, offload, auto_wrap")
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
    version = v.get("version", v.get("fsdp_version")) if isinstance(v, dict) else None
    if version is not None and (isinstance(version, bool) or str(version) not in ("1", "2")):
        raise ImportError_(rep.source, name + ".version", f"must be 1 or 2, got {version!r}")
    if isinstance(v, dict) and str(version) == "2":
        out.setdefault("parallel", {})["fsdp_version"] = 2
        rep.use(name + ".version", "parallel.fsdp_version")
    elif isinstance(v, dict):
        rep.ignored.append(name)


def deepspeed_config(v, out, rep, name):
    """A path or an inline dict; the caller reads a path and passes it to from_deepspeed."""
    if not isinstance(v, (str, dict)) or not v:
        raise ImportError_(rep.source, name, f"expected a DeepSpeed JSON path or an inline mapping, got {v!r}")
    out["__deepspeed__"] = v
    rep.use(name, "DeepSpeed config (imported separately)")


def _lora(v, out, rep, name):
    if need_bool(rep, name, v):
        out["method"] = "lora"
        rep.use(name, "method = lora")


def _neftune(v, out, rep, name):
    if v is not None:  # None is TrainingArguments' default: off
        out["neftune_noise_alpha"] = v
        rep.use(name, "neftune_noise_alpha")


def _packing(v, out, rep, name):
    # TRL SFTConfig `packing` and `padding_free`: rows without padding, documents told apart
    # by position_ids (trl/trainer/sft_trainer.py DataCollatorForLanguageModeling padding_free)
    if need_bool(rep, name, v) and v:
        out["packing"] = True
        rep.use(name, "packing")


def _disable_dropout(v, out, rep, name):
    # TRL's RewardConfig, DPOConfig, KTOConfig, CPOConfig, ORPOConfig, GKDConfig and GRPOConfig:
    # `disable_dropout` runs trl/trainer/utils.py disable_dropout_in_model (every nn.Dropout at p 0)
    out["disable_dropout"] = need_bool(rep, name, v)
    rep.use(name, "disable_dropout")


_FIELDS = {
    "per_device_train_batch_size": _batch, "gradient_accumulation_steps": _accum,
    "gradient_checkpointing": _gc, "bf16": _bf16, "fp16": _bf16, "optim": _optim, "weight_decay": _number("weight_decay"),
    "label_smoothing_factor": _number("label_smoothing"),
    "fsdp": _fsdp, "fsdp_config": _fsdp_config, "deepspeed": deepspeed_config,
    "max_seq_length": _seq, "max_length": _seq, "use_peft": _lora,
    "model_init_kwargs": _model_init_kwargs, "optim_target_modules": _optim_target_modules,
    "optim_args": _optim_args, "neftune_noise_alpha": _neftune, "packing": _packing, "padding_free": _packing,
    "disable_dropout": _disable_dropout,
}

# Fields only TRL's configs have (trl/trainer/*_config.py): the file is a TRL config.
_TRL_ONLY = ("model_init_kwargs", "dataset_text_field", "max_seq_length", "beta", "num_generations",
             "max_prompt_length", "max_completion_length", "use_peft", "completion_only_loss", "packing",
             "disable_dropout")

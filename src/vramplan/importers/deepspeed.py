"""DeepSpeed JSON config -> spec overrides (deepspeed/runtime/config.py and
runtime/zero/config.py field names). "auto" values are resolved from the other inputs the
way HF Trainer does (transformers/integrations/deepspeed.py, trainer_config_process /
trainer_config_finalize); bucket sizes left "auto" are resolved from the model's hidden
size by vramplan.parallel.layout."""
from __future__ import annotations

from vramplan.importers.report import ImportError_, ImportReport, flatten

_ZERO_KNOBS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
               "stage3_max_live_parameters", "stage3_param_persistence_threshold",
               "overlap_comm", "contiguous_gradients", "stage3_max_reuse_distance")
_NO_MEMORY = ("steps_per_print", "wall_clock_breakdown", "gradient_clipping", "optimizer", "scheduler",
              "zero_allow_untested_optimizer", "train_batch_size", "flops_profiler", "tensorboard",
              "wandb", "comms_logger", "zero_optimization.round_robin_gradients",
              "zero_optimization.reduce_scatter", "zero_optimization.allgather_partitions",
              "zero_optimization.stage3_gather_16bit_weights_on_model_save", "fp16.loss_scale",
              "fp16.loss_scale_window", "fp16.initial_scale_power", "fp16.hysteresis",
              "fp16.min_loss_scale", "fp16.auto_cast", "zero_optimization.sub_group_size",
              "zero_optimization.offload_optimizer.pin_memory", "zero_optimization.offload_param.pin_memory",
              "gradient_accumulation_dtype", "data_types")


def from_deepspeed(cfg: dict, context: dict | None = None, source: str = "deepspeed") -> tuple[dict, ImportReport]:
    """`context` holds values already known (micro_batch_size, grad_accum_steps, precision
    from TrainingArguments) that "auto" fields take."""
    if not isinstance(cfg, dict):
        raise ImportError_(f"{source}: expected a JSON object")
    ctx = context or {}
    rep = ImportReport(source)
    out: dict = {}
    par: dict = {}
    extras: dict = {}
    flat = flatten(cfg)
    _auto(flat, "train_micro_batch_size_per_gpu", "micro_batch_size", ctx, out, rep)
    _auto(flat, "gradient_accumulation_steps", "grad_accum_steps", ctx, out, rep)
    zero = cfg.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise ImportError_(f"{source}: zero_optimization must be an object")
    if "stage" in zero:
        stage = zero["stage"]
        if stage not in (0, 1, 2, 3):
            raise ImportError_(f"{source}: zero_optimization.stage must be 0-3, got {stage!r}")
        par["zero_stage"] = stage
        rep.use("zero_optimization.stage", "parallel.zero_stage")
    for which, key in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_params")):
        dev = (zero.get(which) or {}).get("device") if isinstance(zero.get(which), dict) else None
        if dev:
            if dev not in ("cpu", "nvme", "none"):
                raise ImportError_(f"{source}: zero_optimization.{which}.device must be cpu, nvme or none")
            par[key] = dev
            rep.use(f"zero_optimization.{which}.device", f"parallel.{key}")
    for knob in _ZERO_KNOBS:
        if knob in zero:
            extras[knob] = zero[knob]
            rep.use(f"zero_optimization.{knob}", f"parallel.extras.{knob}")
    _precision(cfg, ctx, out, rep)
    if "activation_checkpointing" in cfg:
        rep.ignored.append("activation_checkpointing (Megatron/DeepSpeed API; set gradient_checkpointing)")
    for name in flat:
        if name in rep.used or name in rep.unresolved or any(name == k or name.startswith(k + ".") for k in rep.used):
            continue
        if name.startswith(("bf16", "fp16", "zero_optimization.stage", "zero_optimization.offload")):
            continue
        if name not in rep.ignored:
            rep.ignored.append(name)
    if extras:
        par["extras"] = extras
    if par:
        out["parallel"] = par
    return out, rep


def _auto(flat: dict, name: str, key: str, ctx: dict, out: dict, rep: ImportReport) -> None:
    if name not in flat:
        return
    value = flat[name]
    if value == "auto":
        if key in ctx:
            out[key] = ctx[key]
            rep.use(name, f"{key} (auto = {ctx[key]})")
        else:
            rep.unresolved[name] = f'"auto" needs {key} from TrainingArguments or the command line'
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ImportError_(f"{rep.source}: {name} must be a positive integer or \"auto\", got {value!r}")
    out[key] = value
    rep.use(name, key)


def _precision(cfg: dict, ctx: dict, out: dict, rep: ImportReport) -> None:
    """DeepSpeed bf16/fp16 keep 16-bit weights and gradients with fp32 master weights and
    optimizer states in the ZeRO optimizer: the word bf16/fp16 on the deepspeed stack
    (components/dtypes.py)."""
    out["stack"] = "deepspeed"
    for kind in ("bf16", "fp16"):
        sec = cfg.get(kind)
        if not isinstance(sec, dict) or "enabled" not in sec:
            continue
        enabled = sec["enabled"]
        if enabled == "auto":
            hint = ctx.get("precision", "")
            enabled = kind in str(hint)
            if not hint:
                rep.unresolved[f"{kind}.enabled"] = '"auto" needs bf16/fp16 from TrainingArguments'
                continue
        if enabled is True:
            out["precision"] = kind
            rep.use(f"{kind}.enabled", f"precision = {kind} (DeepSpeed: 16-bit weights, fp32 master)")
        elif enabled is not False:
            raise ImportError_(f"{rep.source}: {kind}.enabled must be true, false or \"auto\"")

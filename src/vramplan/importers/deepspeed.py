"""DeepSpeed JSON config -> spec overrides (deepspeed/runtime/config.py and
runtime/zero/config.py field names). "auto" values are resolved from the other inputs the
way HF Trainer does (transformers/integrations/deepspeed.py, trainer_config_process /
trainer_config_finalize); bucket sizes left "auto" are resolved from the model's hidden
size by vramplan.parallel.layout."""
from __future__ import annotations

from vramplan.importers.fp8 import GPU_ONLY
from vramplan.importers.report import ImportError_, ImportReport, flatten, need_bool, need_int, need_mapping

_ZERO_KNOBS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
               "stage3_max_live_parameters", "stage3_param_persistence_threshold",
               "overlap_comm", "contiguous_gradients", "stage3_max_reuse_distance", "zero_hpz_partition_size",
               "sub_group_size")
_NO_MEMORY = ("steps_per_print", "wall_clock_breakdown", "gradient_clipping", "optimizer", "scheduler",
              "zero_allow_untested_optimizer", "train_batch_size", "flops_profiler", "tensorboard",
              "wandb", "comms_logger", "zero_optimization.round_robin_gradients",
              "zero_optimization.reduce_scatter", "zero_optimization.allgather_partitions",
              "zero_optimization.stage3_gather_16bit_weights_on_model_save", "fp16.loss_scale",
              "fp16.loss_scale_window", "fp16.initial_scale_power", "fp16.hysteresis",
              "fp16.min_loss_scale", "fp16.auto_cast",
              "zero_optimization.offload_optimizer.pin_memory", "zero_optimization.offload_param.pin_memory",
              "gradient_accumulation_dtype", "data_types")


def from_deepspeed(cfg: dict, context: dict | None = None, source: str = "deepspeed") -> tuple[dict, ImportReport]:
    """`context` holds values already known (micro_batch_size, grad_accum_steps, precision
    from TrainingArguments) that "auto" fields take."""
    if not isinstance(cfg, dict):
        raise ImportError_(source, "config", "expected a JSON object at the top level")
    ctx = context or {}
    rep = ImportReport(source)
    out: dict = {}
    par: dict = {}
    extras: dict = {}
    flat = flatten(cfg)
    _auto(flat, "train_micro_batch_size_per_gpu", "micro_batch_size", ctx, out, rep)
    _auto(flat, "gradient_accumulation_steps", "grad_accum_steps", ctx, out, rep)
    _batch_product(flat, out, rep)
    zero = need_mapping(rep, "zero_optimization", cfg.get("zero_optimization"))
    if "stage" in zero:
        stage = need_int(rep, "zero_optimization.stage", zero["stage"], minimum=0)
        if stage > 3:
            raise ImportError_(source, "zero_optimization.stage", f"must be 0, 1, 2 or 3, got {stage!r}")
        par["zero_stage"] = stage
        rep.use("zero_optimization.stage", "parallel.zero_stage")
    for which, key in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_params")):
        dev = need_mapping(rep, f"zero_optimization.{which}", zero.get(which)).get("device")
        if dev is not None:
            if not isinstance(dev, str) or dev not in ("cpu", "nvme", "none"):
                raise ImportError_(source, f"zero_optimization.{which}.device",
                                   f"expected cpu, nvme or none, got {dev!r}")
            par[key] = dev
            rep.use(f"zero_optimization.{which}.device", f"parallel.{key}")
    for knob in _ZERO_KNOBS:
        if knob in zero:
            extras[knob] = _knob(rep, knob, zero[knob])
            rep.use(f"zero_optimization.{knob}", f"parallel.extras.{knob}")
    if "sequence_parallel_size" in cfg:
        # Ulysses SP: deepspeed/runtime/config.py divides the data-parallel world by it.
        par["ulysses"] = need_int(rep, "sequence_parallel_size", cfg["sequence_parallel_size"], minimum=1)
        rep.use("sequence_parallel_size", "parallel.ulysses")
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


def _knob(rep: ImportReport, knob: str, value):
    """A ZeRO knob: a switch (overlap_comm, contiguous_gradients) or a size ("auto" allowed;
    DeepSpeed also takes floats like 5e8 in JSON)."""
    name = f"zero_optimization.{knob}"
    if knob in ("overlap_comm", "contiguous_gradients"):
        return need_bool(rep, name, value)
    if value == "auto":
        return value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return need_int(rep, name, value, minimum=0)


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
        raise ImportError_(rep.source, name, f'expected a positive integer or "auto", got {value!r}')
    out[key] = value
    rep.use(name, key)


def _batch_product(flat: dict, out: dict, rep: ImportReport) -> None:
    """deepspeed/runtime/config.py _batch_assertion: train_batch_size == micro batch x
    gradient accumulation x world size, so it must be a multiple of the first two."""
    total = flat.get("train_batch_size")
    if total is None or total == "auto" or "micro_batch_size" not in out:
        return
    if not isinstance(total, int) or isinstance(total, bool) or total < 1:
        raise ImportError_(rep.source, "train_batch_size", f'expected a positive integer or "auto", got {total!r}')
    per_rank = out["micro_batch_size"] * out.get("grad_accum_steps", 1)
    if total % per_rank:
        raise ImportError_(rep.source, "train_batch_size", f"{total} is not micro batch x gradient accumulation "
                           f"({per_rank}) x a number of GPUs; DeepSpeed refuses it (_batch_assertion)")


def _precision(cfg: dict, ctx: dict, out: dict, rep: ImportReport) -> None:
    """DeepSpeed bf16/fp16 keep 16-bit weights and gradients with fp32 master weights and
    optimizer states in the ZeRO optimizer: the word bf16/fp16 on the deepspeed stack
    (components/dtypes.py)."""
    out["stack"] = "deepspeed"
    msamp = cfg.get("msamp")
    if isinstance(msamp, dict) and msamp.get("enabled"):
        # accelerate's DeepSpeedPlugin.set_mixed_precision writes `msamp: {enabled: true}` for
        # MS-AMP fp8, which msamp.deepspeed.initialize (MS-AMP's DeepSpeed fork) reads
        raise ImportError_(rep.source, "msamp.enabled", f"MS-AMP: {GPU_ONLY}; drop msamp (bf16)")
    both = [k for k in ("bf16", "fp16") if isinstance(cfg.get(k), dict) and cfg[k].get("enabled") is True]
    if len(both) == 2:  # deepspeed/runtime/config.py: "bfloat16 and fp16 modes cannot be simultaneously enabled"
        raise ImportError_(rep.source, "bf16.enabled", "bf16 and fp16 cannot both be enabled; keep one")
    for kind in ("bf16", "fp16"):
        sec = need_mapping(rep, kind, cfg.get(kind)) if kind in cfg else {}
        if "enabled" not in sec:
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
            raise ImportError_(rep.source, f"{kind}.enabled", f'expected true, false or "auto", got {enabled!r}')

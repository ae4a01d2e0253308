"""A layout as something to paste: the vramplan command line that estimates it, a DeepSpeed
config, or a TrainingArguments fragment. Each is the inverse of the importer that reads it
(importers/deepspeed.py `from_deepspeed`, importers/hf_args.py `from_training_args`), so
importing what is emitted gives the same spec fields back (tests/test_cli_emit.py)."""
from __future__ import annotations

import shlex

from vramplan.spec import JobSpec, SpecError, load_spec
from vramplan.spec.stack import RELEASE_OF, Framework

# Top-level spec keys a flag of the same name sets (cli._SPEC_FLAGS), in the order printed.
_FLAG_KEYS = ("task", "method", "precision", "optimizer", "optimizer_impl", "micro_batch_size", "seq_len",
              "grad_accum_steps", "loss_impl", "gradient_checkpointing", "attention", "backend", "gpu",
              "num_gpus", "reference_model", "teacher", "reward_model", "critic_model", "num_generations",
              "max_new_tokens", "num_labels")
_PARALLEL_KEYS = ("zero_stage", "fsdp", "fsdp_version", "tp", "sp", "cp", "ulysses", "pp", "ep", "offload_optimizer",
                  "offload_params")


def command_line(spec: JobSpec) -> str:
    """`vramplan estimate MODEL --flag value ...` for every field that differs from the
    defaults; sections without flags (generation, models, vision, extras) need --spec."""
    data = spec.to_dict(as_given=True)
    if not isinstance(data.get("model"), str):
        raise SpecError("model", "an inline model config has no command-line form; use --save-spec")
    # the task's own defaults (GRPO's micro-batch, a diffusion section) are not printed; the task is
    plain = load_spec({"model": data["model"]})
    base = {**load_spec({"model": data["model"], "task": data.get("task")}).to_dict(), "task": plain.task.value}
    words = ["vramplan", "estimate", data["model"]]
    for key in _FLAG_KEYS:
        if data.get(key) is not None and data.get(key) != base.get(key):
            words += ["--" + key.replace("_", "-"), str(data[key])]
    par, par0 = data.get("parallel") or {}, plain.parallel.to_dict()
    for key in _PARALLEL_KEYS:
        if key in par and par[key] != par0.get(key):
            words += ["--" + key.replace("_", "-"), str(par[key]).lower()]
    lora, lora0 = data.get("lora") or {}, base.get("lora") or {}
    for key in ("r", "alpha", "dropout"):
        if key in lora and lora[key] != lora0.get(key):
            words += [f"--lora-{key}", str(lora[key])]
    if lora.get("target_modules") and lora.get("target_modules") != lora0.get("target_modules"):
        tm = lora["target_modules"]
        words += ["--lora-target-modules", tm if isinstance(tm, str) else ",".join(tm)]
    words += _stack_and_quant(data, base)
    diff, diff0 = data.get("diffusion") or {}, base.get("diffusion") or {}
    for key, value in diff.items():
        if value != diff0.get(key):
            words += ["--" + key.replace("_", "-"), str(value).lower() if isinstance(value, bool) else str(value)]
    return shlex.join(words)


# quantization keys with a flag (cli/flags.py _SECTION_FLAGS), in that order
_QUANT_FLAGS = (("type", "--quant"), ("bits", "--quant-bits"), ("group_size", "--quant-group-size"),
                ("double_quant", "--double-quant"), ("kernel", "--quant-kernel"), ("prepare", "--quant-prepare"))


def _stack_and_quant(data: dict, base: dict) -> list[str]:
    """--stack, --load-dtype and the quantization flags of a spec: what decides what bf16
    means and how a quantized base is held. Library releases other than the defaults have no
    flag (SpecError: the caller says to use --save-spec)."""
    words: list[str] = []
    stack, stack0 = data.get("stack") or {}, base.get("stack") or {}
    releases = [k for k in stack if k != "framework" and stack[k] != stack0.get(k)]
    framework = stack.get("framework", "plain")
    own = RELEASE_OF.get(Framework.parse(framework, "stack"))
    if own in releases and stack.get(own):  # `--stack trl@1.9`
        words += ["--stack", f"{framework}@{stack[own]}"]
        releases.remove(own)
    elif framework != "plain":
        words += ["--stack", framework]
    if releases:
        raise SpecError("stack", f"stack.{releases[0]} has no command-line flag; use --save-spec for this job")
    if data.get("load_dtype") is not None:
        words += ["--load-dtype", str(data["load_dtype"])]
    quant = data.get("quantization") or {}
    if quant:
        # the defaults of this quantization type, as the spec fills them in
        quant0 = load_spec({"model": data["model"], "method": data.get("method", "qlora"),
                            "quantization": {"type": quant["type"]}}).to_dict().get("quantization") or {}
        default_type = load_spec({"model": data["model"], "method": "qlora"}).quantization.type.value
        if data.get("method") != "qlora" or quant["type"] != default_type:
            words += ["--quant", quant["type"]]
        for key, flag in _QUANT_FLAGS[1:]:
            if key in quant and quant[key] != quant0.get(key):
                value = quant[key]
                words += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
        rest = [k for k in quant if k not in dict(_QUANT_FLAGS) and quant[k] != quant0.get(k)]
        if rest:
            raise SpecError("quantization", f"quantization.{rest[0]} has no command-line flag; use --save-spec")
    return words


def deepspeed_config(spec: JobSpec) -> dict:
    """The DeepSpeed JSON of a ZeRO layout (bf16/fp16 there mean fp32 master weights:
    vramplan's mixed-bf16/mixed-fp16, importers/deepspeed.py `_precision`)."""
    par = spec.parallel
    if par.fsdp != "none":
        raise SpecError("emit", "this layout uses FSDP, not DeepSpeed: use --emit training-args")
    if par.tp > 1 or par.pp > 1 or par.cp > 1:
        raise SpecError("emit", "tensor/pipeline/context parallelism is set in Megatron or torchtitan, "
                                "not in a DeepSpeed JSON: use the command line")
    zero: dict = {"stage": par.zero_stage}
    for key, ds in (("offload_optimizer", "offload_optimizer"), ("offload_params", "offload_param")):
        device = getattr(par, key)
        if device != "none":
            zero[ds] = {"device": device, "pin_memory": True}
    out = {"train_micro_batch_size_per_gpu": spec.micro_batch_size,
           "gradient_accumulation_steps": spec.grad_accum_steps, "zero_optimization": zero}
    dtype = spec.precision.value
    if dtype in ("mixed-bf16", "mixed-fp16"):
        out[dtype.split("-")[1]] = {"enabled": True}
    elif dtype in ("bf16", "fp16", "amp-bf16", "amp-fp16"):
        raise SpecError("emit", f"precision {dtype} has no DeepSpeed form: DeepSpeed's bf16/fp16 keep fp32 "
                                f"master weights (mixed-bf16/mixed-fp16); estimate that precision first")
    return out


def training_args(spec: JobSpec) -> dict:
    """The TrainingArguments fields of the layout (names of transformers TrainingArguments)."""
    from vramplan.importers.hf_args import OPTIM
    if spec.parallel.model_parallel > 1:
        raise SpecError("emit", "the Trainer has no tensor/pipeline/context parallelism: "
                                "use the command line (Megatron, torchtitan)")
    out: dict = {"per_device_train_batch_size": spec.micro_batch_size,
                 "gradient_accumulation_steps": spec.grad_accum_steps}
    ckpt = spec.gradient_checkpointing.value
    if ckpt in ("selective", "op-selective") or spec.checkpoint_every > 1:
        raise SpecError("emit", "TrainingArguments has no selective checkpointing (Megatron's, torchtitan's); "
                                "use full or none")
    out["gradient_checkpointing"] = ckpt == "full"
    precision = spec.precision.value
    if precision.startswith("amp-"):
        out[precision[4:]] = True
    same = [(k, impl) for k, (o, impl) in OPTIM.items() if o == spec.optimizer.value]
    optim = next((k for k, impl in same if impl == spec.optimizer_impl.value), None) or \
        next((k for k, impl in same if impl is None), None)
    if optim:
        out["optim"] = optim
    par = spec.parallel
    if par.fsdp != "none":
        mode = par.fsdp.replace("-", "_")
        offload = " offload" if par.offload_params == "cpu" else ""
        out["fsdp"] = f"{mode} auto_wrap{offload}"
        out["fsdp_config"] = {"version": par.fsdp_version}
    elif par.zero_stage or par.offload_optimizer != "none":
        out["deepspeed"] = "ds_config.json"
    return out


def paste_forms(spec: JobSpec) -> dict:
    """{"command", "deepspeed", "training_args"}: the layout in each form that can express
    it, None where it cannot (fit's JSON carries them for each layout)."""
    out: dict = {}
    for key, emit in (("command", command_line), ("deepspeed", deepspeed_config), ("training_args", training_args)):
        try:
            out[key] = emit(spec)
        except SpecError:
            out[key] = None
    return out

"""ms-swift (ModelScope SWIFT) training arguments -> spec overrides.

Two ways in, both of which `swift` itself accepts:
- the YAML / JSON file `swift sft config.yaml` reads (swift/cli/main.py `parse_yaml_args`:
  each key becomes `--key value`), given as `--recipe config.yaml`;
- the command line, or the shell script that holds it (`--recipe train.sh`):
  `NPROC_PER_NODE=2 swift sft --model Qwen/Qwen2.5-7B-Instruct --tuner_type lora ...`.

Field names and defaults are ms-swift 4.6.0's (swift/arguments/sft_args.py SftArguments,
tuner_args.py, base_args/*.py, trainers/arguments.py TrainArgumentsMixin), read from the
installed package; 3.x's `train_type` is read as 4.x's `tuner_type`. What each default does
to memory, and where ms-swift differs from a plain HF Trainer script:
- `gradient_checkpointing` defaults to true (TrainArgumentsMixin), reentrant on one process
  (trainers/mixin.py `_fix_gradient_checkpointing`);
- `optim` defaults to adamw_torch_fused and `weight_decay` to 0.1;
- `gradient_accumulation_steps` unset is ceil(16 / per_device_train_batch_size / world size);
- `torch_dtype` unset is the checkpoint's dtype; bf16 loads train under bf16 autocast,
  fp16 and fp32 loads under fp16 autocast (model_args.py `_init_mixed_precision`);
- LoRA: rank 8, alpha 32, dropout 0.05 on all-linear, adapters in PEFT's dtype (fp32 on a
  16-bit base) unless `lora_dtype`; no kbit preparation of a quantized base
  (components/qlora_prep.py);
- `quant_bits` quantizes only with a `quant_method` (quant_args.py get_quantization_config
  returns None without one).
`swift rlhf` is imported for DPO (its ipo loss too) and reward models, the trainers measured.
"""
from __future__ import annotations

import math

from vramplan.importers.hf_args import OPTIM, deepspeed_config, from_training_args
from vramplan.importers.report import ImportError_, ImportReport, need_int
from vramplan.importers.shell import COMMANDS
from vramplan.spec import SpecError
from vramplan.spec.stack import parse_dtype

__all__ = ["from_swift", "is_swift"]
# swift/arguments base_args.py `tuner_type` choices that are not LoRA or full
_OTHER_TUNERS = ("longlora", "adalora", "llamapro", "adapter", "vera", "boft", "fourierft", "reft", "bone",
                 "lisa")
# the DeepSpeed presets swift ships (swift/config/*.json): zero stage and offload
_DS_PRESETS = {"zero0": (0, None), "zero1": (1, None), "zero2": (2, None), "zero3": (3, None),
               "zero2_offload": (2, "optimizer"), "zero3_offload": (3, "both")}
_ATTN = {"flash_attn": "flash", "flash_attention_2": "flash", "flash_attention_3": "flash",
         "sdpa": "sdpa", "eager": "eager"}
_MARKERS = ("tuner_type", "train_type", "rlhf_type", "quant_method", "quant_bits", "torch_dtype", "attn_impl")


def is_swift(cfg: dict) -> bool:
    """A mapping of ms-swift's arguments: one of its own field names, or `model` with no
    other framework's model key."""
    return any(k in cfg for k in _MARKERS) or ("model" in cfg and "base_model" not in cfg
                                               and not isinstance(cfg.get("model"), dict))


def from_swift(cfg: dict, source: str = "ms-swift", *, command: str = "sft",
               env: dict | None = None) -> tuple[dict, ImportReport]:
    """Spec overrides for `swift <command>` run with the arguments `cfg` (and the launcher's
    environment `env`: NPROC_PER_NODE is the number of processes, one per GPU)."""
    rep = ImportReport(f"{source} (ms-swift)")
    if command not in COMMANDS:
        raise ImportError_(rep.source, "command", f"expected swift {' | '.join(COMMANDS)}, got {command!r}")
    out: dict = {"stack": "ms-swift"}
    if command == "pt":
        out["task"] = "pretrain"
    if command == "rlhf":
        _rlhf(cfg, out, rep)
    if cfg.get("model"):
        out["model"] = str(cfg["model"])
        rep.use("model", "model")
    if cfg.get("use_cpu") is True:  # TrainingArguments.use_cpu: the step runs on the CPU
        out["backend"] = "cpu"
        rep.use("use_cpu", "backend")
    gpus = _gpus(env or {}, rep)
    if gpus > 1:
        out["num_gpus"] = gpus
    _task(cfg, out, rep)
    _tuner(cfg, out, rep)
    _precision(cfg, out, rep)
    _batch(cfg, out, rep, gpus)
    _trainer(cfg, out, rep)
    _parallel(cfg, out, rep)
    used = {k.split(".", 1)[0] for k in (*rep.used, *rep.unresolved)}
    rep.ignored.extend(k for k in cfg if k not in used)
    return out, rep


def _rlhf(cfg: dict, out: dict, rep: ImportReport) -> None:
    """`swift rlhf`: DPO (rlhf_type's default; loss_type ipo as task ipo; a full fine-tune gets
    a reference copy, LoRA its policy with the adapter off) and rm. The rest: refused."""
    kind = cfg.get("rlhf_type", "dpo")
    if kind == "rm":  # RewardTrainer: chosen and rejected rows through a one-output classifier
        out["task"] = "reward-model"
        rep.use("rlhf_type", "task")
        return
    if kind != "dpo":
        raise ImportError_(rep.source, "rlhf_type", f"swift rlhf --rlhf_type {kind} is not imported (ms-swift's "
                           f"{kind} trainer was not measured; dpo is); write the spec's task by hand")
    losses = cfg.get("loss_type") or ["sigmoid"]
    losses = [losses] if isinstance(losses, str) else list(losses)
    out["task"] = "ipo" if losses == ["ipo"] else "dpo"
    rep.use("rlhf_type", "task")
    if "loss_type" in cfg:
        rep.use("loss_type", f"task ({', '.join(map(str, losses))}: the same log-probs)")
    if cfg.get("ref_model"):
        out["reference_model"] = str(cfg["ref_model"])
        rep.use("ref_model", "reference_model")
    if cfg.get("ref_adapters"):
        rep.unresolved["ref_adapters"] = "a reference with its own adapters is not imported"


def _gpus(env: dict, rep: ImportReport) -> int:
    """NPROC_PER_NODE processes (GPUs) on each of NNODES nodes (swift's launcher variables)."""
    total = 1
    for name in ("NPROC_PER_NODE", "NNODES"):
        value = env.get(name)
        if value is None:
            continue
        if not str(value).isdigit() or int(value) < 1:
            unset = " (a variable the script does not set; write the number)" if str(value).startswith("$") else ""
            raise ImportError_(rep.source, name, f"expected a number >= 1, got {value!r}{unset}")
        total *= int(value)
        rep.use(name, "num_gpus")
    return total


def _task(cfg: dict, out: dict, rep: ImportReport) -> None:
    task = cfg.get("task_type")
    if task in (None, "causal_lm"):
        return
    if task == "seq_cls":
        out["task"] = "sequence-classification"
        rep.use("task_type", "task")
        if cfg.get("num_labels") is not None:
            out["num_labels"] = need_int(rep, "num_labels", cfg["num_labels"])
            rep.use("num_labels", "num_labels")
        return
    raise ImportError_(rep.source, "task_type", f"{task!r} is not modelled; vramplan takes causal_lm and seq_cls")


def _tuner(cfg: dict, out: dict, rep: ImportReport) -> None:
    key = "tuner_type" if "tuner_type" in cfg else "train_type"
    tuner = str(cfg.get(key) or "lora")
    if tuner in _OTHER_TUNERS:
        raise ImportError_(rep.source, key, f"the {tuner} tuner is not modelled; vramplan takes lora and full")
    if tuner not in ("lora", "full"):
        raise ImportError_(rep.source, key, f"expected lora or full, got {tuner!r}")
    rep.use(key, "method")
    quant = _quantization(cfg, rep)
    if tuner == "full":
        if quant:
            raise ImportError_(rep.source, "quant_bits", "a quantized base trains adapters only; "
                               "set tuner_type: lora or drop quant_method")
        out["method"] = "full"
        for name in ("freeze_parameters", "freeze_parameters_ratio", "trainable_parameters"):
            if cfg.get(name):
                rep.unresolved[name] = "partly frozen full training is not imported; set freeze in the spec"
        return
    out["method"] = "qlora" if quant else "lora"
    if quant:
        out["quantization"] = quant
    targets = cfg.get("target_modules", ["all-linear"])
    targets = [targets] if isinstance(targets, str) else list(targets or ["all-linear"])
    lora = {"r": need_int(rep, "lora_rank", cfg.get("lora_rank", 8)), "alpha": cfg.get("lora_alpha", 32),
            "dropout": cfg.get("lora_dropout", 0.05),
            "target_modules": "all-linear" if targets == ["all-linear"] else targets}
    for name in ("use_dora", "use_rslora"):
        if name in cfg:
            lora[name] = cfg[name]
    if cfg.get("modules_to_save"):
        saved = cfg["modules_to_save"]
        lora["modules_to_save"] = [saved] if isinstance(saved, str) else list(saved)
    out["lora"] = lora
    for name in ("lora_rank", "lora_alpha", "use_dora", "use_rslora", "modules_to_save"):
        if name in cfg:
            rep.use(name, "lora")
    for name, default in (("lora_dropout", "0.05"), ("target_modules", "all-linear")):
        rep.use(name if name in cfg else f"{name} (ms-swift's default, {default})", "lora")
    if cfg.get("lora_dtype") is not None:
        rep.unresolved["lora_dtype"] = "adapters in a dtype other than PEFT's are not modelled (fp32 counted)"
    if cfg.get("target_regex"):
        rep.unresolved["target_regex"] = "a regex of targets is not imported; list target_modules"


def _quantization(cfg: dict, rep: ImportReport) -> dict | None:
    method, bits = cfg.get("quant_method"), cfg.get("quant_bits")
    if method is None:
        if bits is not None:
            rep.unresolved["quant_bits"] = "no quant_method, so ms-swift loads the model unquantized"
        return None
    rep.use("quant_method", "quantization")
    if method in ("gptq", "awq", "gptq_v2"):
        return {"bits": need_int(rep, "quant_bits", bits or 4), "type": "awq" if method == "awq" else "gptq"}
    if method == "hqq":
        return {"bits": need_int(rep, "quant_bits", bits), "type": "hqq"}
    if method != "bnb":
        raise ImportError_(rep.source, "quant_method", f"{method!r} is not modelled; use bnb, hqq, gptq or awq")
    if bits not in (4, 8) or isinstance(bits, bool):
        raise ImportError_(rep.source, "quant_bits", f"bnb quantizes to 4 or 8 bits, got {bits!r}")
    rep.use("quant_bits", "quantization.bits")
    if bits == 8:
        return {"bits": 8, "type": "int8"}
    kind = cfg.get("bnb_4bit_quant_type", "nf4")
    if kind not in ("nf4", "fp4"):
        raise ImportError_(rep.source, "bnb_4bit_quant_type", f"expected nf4 or fp4, got {kind!r}")
    double = cfg.get("bnb_4bit_use_double_quant", True)
    for name in ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant"):
        if name in cfg:
            rep.use(name, "quantization")
    return {"bits": 4, "type": kind, "double_quant": double}


def _precision(cfg: dict, out: dict, rep: ImportReport) -> None:
    """torch_dtype is what from_pretrained loads; bf16 / fp16 left unset follow it
    (model_args.py `_init_mixed_precision`): the Trainer's autocast over those weights."""
    dtype = cfg.get("torch_dtype")
    auto = "bf16"  # the autocast swift turns on when bf16 and fp16 are left unset
    if dtype is not None:
        try:
            load = parse_dtype(dtype, "torch_dtype")
        except SpecError:
            load = None
        if load is None:  # "auto" too: swift reads torch_dtype as a torch dtype's name
            raise ImportError_(rep.source, "torch_dtype", f"expected bfloat16, float16 or float32, got {dtype!r}")
        auto = "bf16" if load == "bf16" else "fp16"
        out["load_dtype"] = load
        rep.use("torch_dtype", "load_dtype")
    flags = {p: cfg.get(p) for p in ("bf16", "fp16")}
    for name, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise ImportError_(rep.source, name, f"expected true or false, got {value!r}")
    # an unset flag is filled from torch_dtype first; TrainingArguments then refuses both on
    resolved = {p: (auto == p) if v is None else v for p, v in flags.items()}
    if resolved["bf16"] and resolved["fp16"]:
        unset = next((p for p, v in flags.items() if v is None), None)
        why = f" (ms-swift sets {unset} from torch_dtype {dtype}; set {unset} false)" if unset else ""
        raise ImportError_(rep.source, "bf16", f"bf16 and fp16 cannot both be true{why}")
    chosen = next((p for p in ("bf16", "fp16") if resolved[p]), None)
    if dtype is None and all(v is None for v in flags.values()):
        rep.use("torch_dtype (unset: the checkpoint's dtype)", f"precision = {auto} (autocast)")
    out["precision"] = chosen or "fp32"
    for name, value in flags.items():
        if value is not None:
            rep.use(name, "precision")


def _batch(cfg: dict, out: dict, rep: ImportReport, gpus: int) -> None:
    batch = need_int(rep, "per_device_train_batch_size", cfg.get("per_device_train_batch_size", 1))
    out["micro_batch_size"] = batch
    rep.use("per_device_train_batch_size", "micro_batch_size")
    accum = cfg.get("gradient_accumulation_steps")
    if accum is None:
        # trainers/arguments.py TrainArgumentsMixin.__post_init__
        accum = max(1, math.ceil(16 / batch / gpus))
        rep.use("gradient_accumulation_steps (unset: ceil(16 / batch / world size))", "grad_accum_steps")
    else:
        rep.use("gradient_accumulation_steps", "grad_accum_steps")
    out["grad_accum_steps"] = need_int(rep, "gradient_accumulation_steps", accum)
    if cfg.get("max_length") is not None:
        out["seq_len"] = need_int(rep, "max_length", cfg["max_length"])
        rep.use("max_length", "seq_len")
    else:
        rep.unresolved["max_length"] = "unset: ms-swift truncates at the model's max length; give max_length"
    for name in ("packing", "padding_free"):
        if cfg.get(name):
            out["packing"] = True
            rep.use(name, "packing")


def _trainer(cfg: dict, out: dict, rep: ImportReport) -> None:
    gc = cfg.get("gradient_checkpointing", True)
    if not isinstance(gc, bool):
        raise ImportError_(rep.source, "gradient_checkpointing", f"expected true or false, got {gc!r}")
    out["gradient_checkpointing"] = "full" if gc else "none"
    rep.use("gradient_checkpointing" if "gradient_checkpointing" in cfg else
            "gradient_checkpointing (ms-swift's default, true)", "gradient_checkpointing")
    optim = str(cfg.get("optim") or "adamw_torch_fused").lower()
    if optim not in OPTIM:
        raise ImportError_(rep.source, "optim", f"optimizer {optim!r} is not modelled; use one of "
                           f"{', '.join(sorted(OPTIM))}")
    sub, _ = from_training_args({"optim": optim}, source=rep.source, file_defaults=False)
    out.update({k: v for k, v in sub.items() if k != "stack"})
    rep.use("optim" if "optim" in cfg else "optim (ms-swift's default, adamw_torch_fused)", "optimizer")
    decay = cfg.get("weight_decay", 0.1)
    if isinstance(decay, bool) or not isinstance(decay, (int, float)):
        raise ImportError_(rep.source, "weight_decay", f"expected a number, got {decay!r}")
    out["weight_decay"] = float(decay)
    rep.use("weight_decay" if "weight_decay" in cfg else "weight_decay (ms-swift's default, 0.1)", "weight_decay")
    attn = cfg.get("attn_impl")
    if attn is not None:
        if attn not in _ATTN:
            raise ImportError_(rep.source, "attn_impl", f"expected one of {', '.join(_ATTN)}, got {attn!r}")
        out["attention"] = _ATTN[attn]
        rep.use("attn_impl", "attention")
    if cfg.get("use_logits_to_keep") is False:
        rep.unresolved["use_logits_to_keep"] = "off: logits at every position; give no prompt_len"
    if cfg.get("use_liger_kernel"):
        out["loss_impl"] = "fused-linear-cross-entropy"
        rep.use("use_liger_kernel", "loss_impl")
    if cfg.get("neftune_noise_alpha") is not None:
        out["neftune_noise_alpha"] = cfg["neftune_noise_alpha"]
        rep.use("neftune_noise_alpha", "neftune_noise_alpha")


def _parallel(cfg: dict, out: dict, rep: ImportReport) -> None:
    ds = cfg.get("deepspeed")
    if ds in _DS_PRESETS:
        stage, offload = _DS_PRESETS[ds]
        par = out.setdefault("parallel", {})
        par["zero_stage"] = stage
        if offload:
            par["offload_optimizer"] = "cpu"
        if offload == "both":
            par["offload_params"] = "cpu"
        rep.use("deepspeed", "parallel (ms-swift's preset)")
    elif ds:
        deepspeed_config(ds, out, rep, "deepspeed")
    if cfg.get("fsdp"):
        sub, _ = from_training_args({"fsdp": cfg["fsdp"], "fsdp_config": cfg.get("fsdp_config") or {}},
                                    source=rep.source, file_defaults=False)
        out.setdefault("parallel", {}).update(sub.get("parallel", {}))
        rep.use("fsdp", "parallel.fsdp")
    sp = cfg.get("sequence_parallel_size")
    if sp not in (None, 1):
        out.setdefault("parallel", {})["ulysses"] = need_int(rep, "sequence_parallel_size", sp)
        rep.use("sequence_parallel_size", "parallel.ulysses")

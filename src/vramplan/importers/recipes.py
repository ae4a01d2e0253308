"""Training recipes (YAML) of axolotl, LLaMA-Factory, torchtune and ms-swift -> spec overrides.
Field names from axolotl's docs/config.qmd, LLaMA-Factory's hparams/*_args.py and
torchtune's recipes/configs/*.yaml; ms-swift's in importers/ms_swift.py."""
from __future__ import annotations

from vramplan.importers.fp8 import refuse_fp8_switch
from vramplan.importers.ms_swift import from_swift, is_swift
from vramplan.importers.hf_args import OPTIM, deepspeed_config, from_training_args
from vramplan.importers.report import ImportError_, ImportReport, need_int, need_mapping


def detect(cfg: dict, source: str = "recipe") -> str:
    if any(isinstance(v, dict) and "_component_" in v for v in cfg.values()):
        return "torchtune"
    if "finetuning_type" in cfg or "model_name_or_path" in cfg or "cutoff_len" in cfg:
        return "llama-factory"
    if is_swift(cfg):
        return "ms-swift"
    if "base_model" in cfg or "sequence_len" in cfg or "adapter" in cfg:
        return "axolotl"
    raise ImportError_(source, "config", "not an axolotl, LLaMA-Factory, torchtune or ms-swift recipe "
                       "(no base_model / model_name_or_path / _component_ / model fields)")


def from_recipe(cfg: dict, source: str = "recipe") -> tuple[dict, ImportReport]:
    if not isinstance(cfg, dict):
        raise ImportError_(source, "config", "expected a mapping at the top level")
    kind = detect(cfg, source)
    if kind == "ms-swift":
        return from_swift(cfg, source)
    return {"axolotl": _axolotl, "llama-factory": _llama_factory, "torchtune": _torchtune}[kind](cfg, f"{source} ({kind})")


def _common(cfg: dict, names: dict, rep: ImportReport, out: dict) -> None:
    """Fields that map one to one: recipe name -> spec key."""
    for name, key in names.items():
        if name in cfg and cfg[name] is not None:
            value = cfg[name]
            if key in ("micro_batch_size", "grad_accum_steps", "seq_len"):
                need_int(rep, name, value)
            out[key] = value
            rep.use(name, key)


def _axolotl(cfg: dict, source: str) -> tuple[dict, ImportReport]:
    rep = ImportReport(source)
    out: dict = {"stack": "axolotl"}
    _common(cfg, {"base_model": "model", "micro_batch_size": "micro_batch_size",
                  "gradient_accumulation_steps": "grad_accum_steps", "sequence_len": "seq_len",
                  "sample_packing": "packing"}, rep, out)
    if _switch(rep, "gradient_checkpointing", cfg.get("gradient_checkpointing")):
        out["gradient_checkpointing"] = "full"
        rep.use("gradient_checkpointing", "gradient_checkpointing")
    for p in ("bf16", "fp16"):
        if cfg.get(p) == "auto" or _switch(rep, p, cfg.get(p)):
            out["precision"] = p  # the HF Trainer's flag: autocast over the load dtype
            rep.use(p, "precision")
    # axolotl `fp8` (monkeypatch/trainer_accelerator_args.py: accelerate's AO recipe)
    refuse_fp8_switch(rep, "fp8", _switch(rep, "fp8", cfg.get("fp8")))
    adapter = cfg.get("adapter")
    if adapter in ("lora", "qlora"):
        out["method"] = "qlora" if adapter == "qlora" or cfg.get("load_in_4bit") else "lora"
        lora = {"r": need_int(rep, "lora_r", cfg.get("lora_r", 8)), "alpha": cfg.get("lora_alpha", 16),
                "dropout": cfg.get("lora_dropout", 0.0)}
        if cfg.get("lora_target_linear"):
            lora["target_modules"] = "all-linear"
        elif cfg.get("lora_target_modules"):
            lora["target_modules"] = cfg["lora_target_modules"]
        out["lora"] = lora
        # axolotl's config schema: peft_use_dora / peft_use_rslora, passed to PEFT's LoraConfig
        _lora_switches(cfg, rep, lora, {"peft_use_dora": "use_dora", "peft_use_rslora": "use_rslora"})
        for k in ("adapter", "lora_r", "lora_alpha", "lora_dropout", "lora_target_linear", "lora_target_modules", "load_in_4bit"):
            if k in cfg:
                rep.use(k, "method/lora")
    if cfg.get("flash_attention"):
        out["attention"] = "flash"
        rep.use("flash_attention", "attention")
    if "optimizer" in cfg:
        _optimizer(cfg["optimizer"], out, rep, "optimizer")
    if cfg.get("deepspeed"):  # a path or an inline mapping, as TrainingArguments.deepspeed
        deepspeed_config(cfg["deepspeed"], out, rep, "deepspeed")
    if cfg.get("fsdp"):
        sub, _ = from_training_args({"fsdp": cfg["fsdp"], "fsdp_config": cfg.get("fsdp_config") or {}},
                                    source=rep.source)
        out.setdefault("parallel", {}).update(sub.get("parallel", {}))
        rep.use("fsdp", "parallel.fsdp")
    _rest(cfg, rep)
    return out, rep


def _llama_factory(cfg: dict, source: str) -> tuple[dict, ImportReport]:
    rep = ImportReport(source)
    out: dict = {"stack": "llama-factory"}
    _common(cfg, {"model_name_or_path": "model", "per_device_train_batch_size": "micro_batch_size",
                  "gradient_accumulation_steps": "grad_accum_steps", "cutoff_len": "seq_len",
                  "packing": "packing"}, rep, out)
    # hparams Fp8Arguments: fp8, fp8_backend auto | torchao | te | msamp (train/fp8_utils.py)
    refuse_fp8_switch(rep, "fp8", _switch(rep, "fp8", cfg.get("fp8")), cfg.get("fp8_backend"))
    ft = cfg.get("finetuning_type", "lora")
    quant = cfg.get("quantization_bit")
    if quant is not None and quant not in (4, 8) or isinstance(quant, bool):
        raise ImportError_(rep.source, "quantization_bit", f"vramplan models 4 or 8, got {quant!r}")
    if ft not in _LF_FINETUNING:  # hparams/finetuning_args.py: Literal["lora", "oft", "freeze", "full"]
        from vramplan.spec.sections import did_you_mean
        raise ImportError_(rep.source, "finetuning_type", f"expected one of {', '.join(_LF_FINETUNING)}, got "
                           f"{ft!r}{did_you_mean(str(ft), _LF_FINETUNING)}")
    if quant is not None and ft not in ("lora", "oft"):
        # hparams/parser.py _verify_model_args: "Quantization is only compatible with the LoRA
        # or OFT method." (a frozen quantized base takes adapters only)
        raise ImportError_(rep.source, "quantization_bit", f"LLaMA-Factory quantizes only for finetuning_type lora, "
                           f"not {ft}; set finetuning_type: lora or drop quantization_bit")
    if ft == "lora":
        out["method"] = "qlora" if quant else "lora"
        target = cfg.get("lora_target", "all")
        rank = need_int(rep, "lora_rank", cfg.get("lora_rank", 8))
        out["lora"] = {"r": rank, "alpha": cfg.get("lora_alpha") or 2 * rank,
                       "dropout": cfg.get("lora_dropout", 0.0),
                       "target_modules": "all-linear" if target == "all" else [t.strip() for t in str(target).split(",")]}
        # hparams/finetuning_args.py LoraArguments: use_dora, use_rslora (passed to PEFT's LoraConfig)
        _lora_switches(cfg, rep, out["lora"], {"use_dora": "use_dora", "use_rslora": "use_rslora"})
        if quant:
            out["quantization"] = {"bits": int(quant), "type": "nf4" if int(quant) == 4 else "int8"}
            if _switch(rep, "upcast_layernorm", cfg.get("upcast_layernorm")):
                # model_utils/checkpointing.py prepare_model_for_training: the norm weights in
                # fp32, the only preparation LLaMA-Factory gives a quantized base
                out["quantization"]["prepare"] = "norms-fp32"
                rep.use("upcast_layernorm", "quantization.prepare")
        for k in ("finetuning_type", "lora_rank", "lora_alpha", "lora_dropout", "lora_target", "quantization_bit"):
            if k in cfg:
                rep.use(k, "method/lora")
    elif ft == "full":
        out["method"] = "full"
        rep.use("finetuning_type", "method")
    elif ft == "freeze":
        _llama_factory_freeze(cfg, out, rep)
    else:
        rep.unresolved["finetuning_type"] = f"{ft!r}: OFT adapters are not modelled"
    for p in ("bf16", "fp16"):
        if _switch(rep, p, cfg.get(p)):
            out["precision"] = p  # the HF Trainer's flag: autocast over the load dtype
            rep.use(p, "precision")
    _llama_factory_dtype(cfg, out, rep)
    _llama_factory_stage(cfg, out, rep)
    if "optim" not in cfg:
        # no `optim`: transformers' TrainingArguments default, adamw_torch_fused with torch
        # >= 2.8 (transformers/training_args.py `default_optim`; LLaMA-Factory 0.9.5 pins
        # transformers >= 4.55 and its create_custom_optimizer returns None without
        # GaLore / APOLLO / BAdam / Muon ..., so the Trainer builds it)
        out["optimizer"], out["optimizer_impl"] = "adamw", "fused"
    # model_utils/checkpointing.py prepare_model_for_training: gradient checkpointing is on
    # unless `disable_gradient_checkpointing` (ModelArguments default False)
    if _switch(rep, "disable_gradient_checkpointing", cfg.get("disable_gradient_checkpointing")):
        out["gradient_checkpointing"] = "none"
    else:
        out["gradient_checkpointing"] = "full"
    if "disable_gradient_checkpointing" in cfg:
        rep.use("disable_gradient_checkpointing", "gradient_checkpointing")
    if cfg.get("flash_attn") in ("fa2", "auto"):
        out["attention"] = "flash" if cfg["flash_attn"] == "fa2" else "sdpa"
        rep.use("flash_attn", "attention")
    if cfg.get("deepspeed"):  # a path or an inline mapping, as TrainingArguments.deepspeed
        deepspeed_config(cfg["deepspeed"], out, rep, "deepspeed")
    if "optim" in cfg:
        _optimizer(cfg["optim"], out, rep, "optim")
    if _switch(rep, "upcast_lmhead_output", cfg.get("upcast_lmhead_output")):
        # model_utils/checkpointing.py prepare_model_for_training: a forward hook returns the
        # lm_head output `.to(torch.float32)`, so the 16-bit logits are freed at once
        out["stack"] = {"framework": "llama-factory", "fp32_logits": True}
        rep.use("upcast_lmhead_output", "stack.fp32_logits")
    _rest(cfg, rep)
    return out, rep


def _llama_factory_freeze(cfg: dict, out: dict, rep: ImportReport) -> None:
    """finetuning_type freeze (llamafactory/model/adapter.py `_setup_freeze_tuning`): the last
    `freeze_trainable_layers` layers (default 2; negative: the first ones) train whole when
    `freeze_trainable_modules` is `all` (its default), plus the parameters whose names
    contain a `freeze_extra_modules` entry (a substring match, as the spec's)."""
    n = need_int(rep, "freeze_trainable_layers", cfg.get("freeze_trainable_layers", 2), minimum=-(2**31))
    modules = [m.strip() for m in str(cfg.get("freeze_trainable_modules", "all")).split(",")]
    if cfg.get("use_llama_pro") or modules != ["all"]:
        field = "use_llama_pro" if cfg.get("use_llama_pro") else "freeze_trainable_modules"
        rep.unresolved[field] = "parts of layers trained are not imported; set freeze in the spec"
        return
    extra = [m.strip() for m in str(cfg.get("freeze_extra_modules") or "").split(",") if m.strip()]
    layers = list(range(-n, 0)) if n > 0 else list(range(-n))
    out["method"] = "freeze"
    out["freeze"] = {"trainable_layers": layers, "trainable_modules": extra}
    for k in ("finetuning_type", "freeze_trainable_layers", "freeze_trainable_modules", "freeze_extra_modules"):
        if k in cfg:
            rep.use(k, "method/freeze")


# LLaMA-Factory `stage` (hparams/finetuning_args.py) and `pref_loss` -> the spec's task.
# hinge and kto_pair losses hold what sigmoid DPO holds (two models' log-probs of pairs).
_LF_STAGES = {"pt": "pretrain", "sft": "sft", "kto": "kto"}
_LF_FINETUNING = ("lora", "oft", "freeze", "full")
_LF_PREF_LOSS = {"sigmoid": "dpo", "hinge": "dpo", "kto_pair": "dpo", "ipo": "ipo", "orpo": "orpo",
                 "simpo": "simpo"}


def _llama_factory_stage(cfg: dict, out: dict, rep: ImportReport) -> None:
    """Its DPO and KTO trainers (train/dpo/trainer.py, train/kto/trainer.py
    `concatenated_forward`) take `model(...).logits.to(torch.float32)` and its own
    `get_batch_logps`: the full-logits head, which `stack: llama-factory` selects."""
    stage = str(cfg.get("stage", "sft"))
    if stage == "dpo":
        loss = str(cfg.get("pref_loss", "sigmoid"))
        if loss not in _LF_PREF_LOSS:
            raise ImportError_(rep.source, "pref_loss", f"expected one of {', '.join(_LF_PREF_LOSS)}, got {loss!r}")
        out["task"] = _LF_PREF_LOSS[loss]
        if "pref_loss" in cfg:
            rep.use("pref_loss", "task")
    elif stage in _LF_STAGES:
        out["task"] = _LF_STAGES[stage]
    elif stage not in ("rm", "ppo"):  # hparams/finetuning_args.py: Literal["pt", "sft", "rm", "ppo", "dpo", "kto"]
        from vramplan.spec.sections import did_you_mean
        raise ImportError_(rep.source, "stage", f"expected one of pt, sft, rm, ppo, dpo, kto, got {stage!r}"
                           f"{did_you_mean(stage, ('pt', 'sft', 'rm', 'ppo', 'dpo', 'kto'))}")
    else:
        # rm and ppo wrap the model in TRL's AutoModelForCausalLMWithValueHead (full LM logits
        # beside the value head), which the reward-model and ppo tasks do not model
        rep.unresolved["stage"] = (f"{stage!r}: LLaMA-Factory's value-head model is not modelled; "
                                   "give task (reward-model, ppo) in the spec")
        return
    if "stage" in cfg:
        rep.use("stage", "task")


def _llama_factory_dtype(cfg: dict, out: dict, rep: ImportReport) -> None:
    """LLaMA-Factory's precision and the dtypes it loads and trains in.

    - No bf16 / fp16 / pure_bf16: its TrainingArguments defaults (bf16 = fp16 = False), so
      no autocast: precision fp32 over the weights as loaded.
    - It loads with `torch_dtype="auto"` (model/loader.py `load_model`): the checkpoint's own
      dtype, on any transformers release and whatever the precision flag; the estimate takes
      it from the model's config (load_dtype left unset, components/dtypes.py).
    - It then upcasts every trainable parameter to fp32 unless `pure_bf16` or BAdam is set
      (model/adapter.py `init_adapter`: cast_trainable_params_to_fp32; LoRA's adapters are
      fp32 anyway): a full fine-tune holds fp32 weights (load_dtype fp32), LoRA keeps the
      frozen base in the checkpoint's dtype. `pure_bf16` trains in bf16 with no autocast."""
    badam = bool(cfg.get("use_badam"))
    if cfg.get("pure_bf16") or (badam and "precision" in out):
        # hparams/parser.py: pure_bf16 sets compute_dtype bf16 with or without the bf16 flag
        out["precision"] = "pure-bf16"
        rep.use("pure_bf16" if cfg.get("pure_bf16") else "use_badam", "precision = pure-bf16")
        return
    out.setdefault("precision", "fp32")
    if out.get("method") == "full" and not badam:
        out["load_dtype"] = "fp32"
        if out["precision"] in cfg:  # the bf16 / fp16 flag that was read
            rep.use(out["precision"], f"precision = {out['precision']}, trainable params upcast to fp32 "
                                      "(load_dtype fp32)")


def _torchtune(cfg: dict, source: str) -> tuple[dict, ImportReport]:
    rep = ImportReport(source)
    out: dict = {"stack": "torchtune"}
    _common(cfg, {"batch_size": "micro_batch_size", "gradient_accumulation_steps": "grad_accum_steps"}, rep, out)
    # recipes/full_finetune_distributed.py `enable_fp8_training` with `fp8_recipe_name`
    refuse_fp8_switch(rep, "enable_fp8_training", _switch(rep, "enable_fp8_training", cfg.get("enable_fp8_training")))
    model = need_mapping(rep, "model", cfg.get("model"))
    comp = str(model.get("_component_", ""))
    if comp:
        out["model"] = comp.rsplit(".", 1)[-1]
        rep.use("model._component_", "model (torchtune builder name; map to a catalog model)")
        if "lora" in comp:
            out["method"] = "qlora" if "qlora" in comp else "lora"
            attn = model.get("lora_attn_modules") or ["q_proj", "v_proj"]
            if not isinstance(attn, list) or not all(isinstance(a, str) for a in attn):
                raise ImportError_(source, "model.lora_attn_modules", f"expected a list of module names like "
                                   f"[q_proj, v_proj, output_proj], got {attn!r}")
            names = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
            targets = [names.get(a, a) for a in attn]
            if model.get("apply_lora_to_mlp"):
                targets += ["gate_proj", "up_proj", "down_proj"]
            out["lora"] = {"r": model.get("lora_rank", 8), "alpha": model.get("lora_alpha", 16),
                           "dropout": model.get("lora_dropout", 0.0), "target_modules": targets}
            # the lora builders' use_dora (torchtune/modules/peft/dora.py DoRALinear): read, so
            # the spec can say it is not modelled rather than estimate plain LoRA
            _lora_switches(model, rep, out["lora"], {"use_dora": "use_dora"}, prefix="model.")
            rep.use("model.lora_*", "lora")
    seq = need_mapping(rep, "tokenizer", cfg.get("tokenizer")).get("max_seq_len")
    if seq:
        out["seq_len"] = seq
        rep.use("tokenizer.max_seq_len", "seq_len")
    if _switch(rep, "enable_activation_checkpointing", cfg.get("enable_activation_checkpointing")):
        out["gradient_checkpointing"] = "full"
        rep.use("enable_activation_checkpointing", "gradient_checkpointing")
    if cfg.get("dtype") in ("bf16", "fp32", "fp16"):
        out["precision"] = cfg["dtype"]
        rep.use("dtype", "precision (torchtune trains in pure dtype)")
    opt = need_mapping(rep, "optimizer", cfg.get("optimizer"))
    comp = str(opt.get("_component_", "")).lower()
    if comp:
        name = comp.rsplit(".", 1)[-1]
        mapping = {"adamw": "adamw", "adam": "adam", "sgd": "sgd", "adamw8bit": "adamw-8bit",
                   "pagedadamw8bit": "paged-adamw-8bit", "adafactor": "adafactor"}
        if name in mapping:
            out["optimizer"] = mapping[name]
            if opt.get("fused"):
                out["optimizer_impl"] = "fused"
            rep.use("optimizer._component_", "optimizer")
        else:
            rep.unresolved["optimizer._component_"] = f"{comp!r} is not modelled"
    loss = str(need_mapping(rep, "loss", cfg.get("loss")).get("_component_", ""))
    if "Chunked" in loss:
        out["loss_impl"] = "chunked"
        rep.use("loss._component_", "loss_impl = chunked")
    _torchtune_switches(cfg, out, rep)
    _rest(cfg, rep)
    return out, rep


# torchtune recipe switches (recipes/full_finetune_single_device.py, lora_finetune_*.py) and
# the spec fields they set.
_TORCHTUNE_SWITCHES = {"enable_activation_offloading": "activation_offloading",
                       "optimizer_in_bwd": "optimizer_in_backward", "compile": "compile"}


def _torchtune_switches(cfg: dict, out: dict, rep: ImportReport) -> None:
    for key, field in _TORCHTUNE_SWITCHES.items():
        if key in cfg:
            out[field] = _switch(rep, key, cfg[key])
            rep.use(key, field)
    dataset = cfg.get("dataset")
    if isinstance(dataset, dict) and "packed" in dataset:
        out["packing"] = _switch(rep, "dataset.packed", dataset["packed"])
        rep.use("dataset.packed", "packing")
    model = cfg.get("model")
    if isinstance(model, dict) and "quantize_base" in model:
        # the lora_* builders take quantize_base=True for an NF4 base (torchao NF4Tensor)
        if _switch(rep, "model.quantize_base", model["quantize_base"]):
            out["method"] = "qlora"
        rep.use("model.quantize_base", "method = qlora")
    if out.get("method") == "qlora":
        out.setdefault("quantization", {"bits": 4, "type": "nf4", "double_quant": True, "block_size": 64})


def _lora_switches(cfg: dict, rep: ImportReport, lora: dict, names: dict, prefix: str = "") -> None:
    """A recipe's DoRA / rsLoRA switches into the lora section as written (null: off); the
    spec takes only a real true/false (spec.sections.boolean names lora.use_dora)."""
    for key, field in names.items():
        if key in cfg:
            lora[field] = False if cfg[key] is None else cfg[key]
            rep.use(prefix + key, f"lora.{field}")


def _switch(rep: ImportReport, name: str, value) -> bool:
    """A recipe switch: true/false (or absent); "false" written as a string is refused, since
    it would read as on. Other strings are a recipe's named modes (axolotl's
    gradient_checkpointing: unsloth) and mean on."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() not in ("true", "false", "yes", "no", "on", "off", ""):
        return True
    raise ImportError_(rep.source, name, f"expected true or false, got {value!r}; write it without quotes")


def _optimizer(value, out: dict, rep: ImportReport, name: str) -> None:
    key = str(value).lower()
    if key in OPTIM:
        opt, impl = OPTIM[key]
        out["optimizer"] = opt
        if impl:
            out["optimizer_impl"] = impl
        rep.use(name, "optimizer")
    else:
        rep.unresolved[name] = f"optimizer {value!r} is not modelled"


def _rest(cfg: dict, rep: ImportReport) -> None:
    used_roots = {k.split(".", 1)[0] for k in rep.used} | {k.split(".", 1)[0] for k in rep.unresolved}
    rep.ignored.extend(k for k in cfg if k not in used_roots)

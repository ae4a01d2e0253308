"""Build the real model and optimizer for a job, the way HF Trainer would.

Input is the job dict of /work/shared/validation/cpu-dev-truth.jsonl (or a
``vramplan.spec.JobSpec``; see ``job_dict``).  Weights are random
(``from_config``); nothing is downloaded; ``trust_remote_code`` only if the job
asks for it.

Decisions that mirror transformers 5.23 / peft 0.21 (checked in the installed
sources):
  * gradient checkpointing: Trainer calls ``model.activation_checkpointing_enable``
    (transformers/trainer.py ~l.1503) whose default kwargs are
    ``{"use_reentrant": False}`` (modeling_utils.py ``_activation_checkpointing_enable``).
    Non-reentrant checkpointing needs no ``enable_input_require_grads``, and
    neither Trainer nor ``get_peft_model`` calls it for LoRA (peft only does in
    ``prepare_model_for_kbit_training`` and for prompt learning), so we do not.
  * LoRA: ``get_peft_model`` keeps ``autocast_adapter_dtype=True``, which casts
    adapter weights to fp32 on a bf16/fp16 base (peft/tuners/tuners_utils.py).
  * Adafactor: Trainer's ``optim="adafactor"`` is
    ``transformers.optimization.Adafactor(scale_parameter=False,
    relative_step=False)`` (transformers/trainer_optimizer.py ``_get_adafactor``),
    so that is what we build (with Trainer's default lr).
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any

import torch

# Tasks whose training step run.py reproduces (causal-LM loss on labels=input_ids,
# or a sequence-classification head on one label per row).
MEASURED_TASKS = {"sft", "pretrain", "sequence-classification"}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------ job input
def job_dict(job: Any) -> dict:
    """The job as the plain dict of ``JobSpec.to_dict()``.

    Everything goes through ``vramplan.load_spec`` (validation, defaults such
    as ``weight_decay``), so a dev-truth job dict, a JobSpec and a spec file
    all measure the same way."""
    from vramplan import load_spec

    if hasattr(job, "to_dict") and not isinstance(job, dict):
        return dict(job.to_dict())
    return dict(load_spec(job).to_dict())


def hf_config_dict(model_field: Any) -> dict:
    """The HF config dict of the job's ``model`` field (vramplan.sources
    resolves catalog names, paths, hub ids and inline dicts)."""
    from vramplan.sources import resolve_hf_config

    _, config = resolve_hf_config(model_field)
    return dict(config)


def norm_precision(p: str) -> str:
    """'amp_bf16' / 'AMP-BF16' -> 'amp-bf16'."""
    return str(p or "fp32").lower().replace("_", "-")


@dataclass
class Built:
    """What a training step needs."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    precision: str
    autocast_dtype: torch.dtype | None = None
    # mixed-*: fp32 master params (what the optimizer steps), paired with the
    # 16-bit model params they are copied to after each step.
    master_pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # tensors alive before metering that are not the model's (set by the runner)
    resident: list[torch.Tensor] = field(default_factory=list)


# ----------------------------------------------------------------- the model
def build_model(job: dict, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Random-weight HF model in ``dtype``.

    The dtype is given to ``from_config`` rather than applied with ``.to()``
    afterwards: under FakeTensorMode, ``Module._apply`` swaps parameters with
    ``torch.utils.swap_tensors`` (torch/nn/modules/module.py), which refuses
    tensors that FakeTensorMode holds weak references to."""
    from transformers import (
        AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSequenceClassification,
    )

    task = job.get("task", "sft")
    if job.get("activation_offloading"):
        raise ValueError("activation_offloading: measured with torchtune's own code by "
                         "bench/torchtune/run.py, not by `vramplan measure` yet")
    if job.get("loss_impl", "standard") != "standard":
        raise ValueError(f"loss_impl: only 'standard' is measured, got {job['loss_impl']!r}")
    if task not in MEASURED_TASKS:
        raise ValueError(f"task: measuring {task!r} is not implemented yet (measured: "
                         f"{', '.join(sorted(MEASURED_TASKS))})")
    cfg = hf_config_dict(job["model"])
    if task == "sequence-classification":
        cfg.setdefault("num_labels", int(job.get("num_labels", 2)))
    model_type = cfg.pop("model_type")
    from .standin_remote import STANDINS, build_standin
    if model_type in STANDINS:  # repository-code families: written-here stand-ins, never the repo's code
        # Built on the device, as from_pretrained(device_map=...) builds it: the repository
        # code keeps its rotary tables as plain attributes (not buffers) that .to() would
        # leave on the CPU.
        with torch.device(device):
            return build_standin(model_type, cfg, job, dtype)
    remote = bool(job.get("trust_remote_code", False))
    config = AutoConfig.for_model(model_type, **cfg)
    attn = job.get("attention", "sdpa") or "sdpa"
    attn = {"flash": "flash_attention_2", "flash2": "flash_attention_2"}.get(attn, attn)
    from vramplan.catalog.runtime import no_sdpa_model_types
    if attn == "sdpa" and model_type in no_sdpa_model_types():
        attn = "eager"  # what transformers runs when none is named (validity.resolve_attention)
    if attn.startswith("flash") and device != "cuda":
        raise ValueError("attention: flash attention needs device='cuda'")
    auto = (AutoModelForSequenceClassification if task == "sequence-classification"
            else AutoModelForCausalLM)
    if getattr(config, "is_encoder_decoder", False) and task != "sequence-classification":
        # T5/mT5: labels go in, the model shifts them right into decoder_input_ids
        # (T5ForConditionalGeneration._shift_right); the target length is the input's.
        auto = AutoModelForSeq2SeqLM
    # Built on the device, as from_pretrained(device_map=...) places each weight there: no
    # host copy first, and a 7B model's random init runs on the GPU (on 16 CPU cores it took
    # minutes, longer than a device check has).
    with torch.device(device) if device != "cpu" else contextlib.nullcontext():
        model = auto.from_config(config, attn_implementation=attn, trust_remote_code=remote, dtype=dtype)
    if getattr(model.config, "pad_token_id", None) is None and auto is AutoModelForSequenceClassification:
        model.config.pad_token_id = 0
    model.config.use_cache = False  # Trainer trains without a KV cache
    return model


def precision_dtypes(precision: str) -> tuple[torch.dtype, torch.dtype | None]:
    """(model dtype, autocast dtype or None) of a precision name.

    fp32/bf16/fp16: pure, the model in that dtype.  amp-*: fp32 model with
    torch.autocast around forward+loss.  mixed-*: 16-bit model, fp32 master
    copy made in ``build`` after the method is applied."""
    kind, _, width = precision.partition("-")
    if kind in DTYPES and not width:
        return DTYPES[kind], None
    if kind == "pure" and width in DTYPES:
        return DTYPES[width], None
    if kind == "amp" and width in DTYPES:
        return torch.float32, DTYPES[width]
    if kind == "mixed" and width in DTYPES:
        return DTYPES[width], None
    raise ValueError(f"precision: unknown value {precision!r}")


def apply_method(model: torch.nn.Module, job: dict, device: str) -> torch.nn.Module:
    method = job.get("method", "full")
    if method == "full":
        return model
    if method == "lora":
        task = job.get("task", "sft")
        if getattr(model.config, "is_encoder_decoder", False) and task != "sequence-classification":
            task = "seq2seq"
        return _apply_lora(model, job.get("lora") or {}, task)
    if method == "freeze":
        return _apply_freeze(model, job.get("freeze") or {})
    if method == "qlora":
        from .quantized import prepare, quantize_base

        model = prepare(quantize_base(model, job, device))
        return _apply_lora(model, job.get("lora") or {}, job.get("task", "sft"))
    raise ValueError(f"method: unknown value {method!r}")


def _apply_lora(model, lora: dict, task: str):
    from peft import get_peft_model

    return get_peft_model(model, lora_config(lora, task))


def lora_config(lora: dict, task: str):
    """PEFT's LoraConfig of the spec's lora section (what `get_peft_model` or a TRL trainer's
    `peft_config` receives)."""
    from peft import LoraConfig

    return LoraConfig(
        r=int(lora.get("r", 8)), lora_alpha=lora.get("alpha", 16),
        lora_dropout=float(lora.get("dropout", 0.0)),
        target_modules=lora.get("target_modules") or None,
        modules_to_save=lora.get("modules_to_save") or None,
        use_dora=bool(lora.get("use_dora", False)), use_rslora=bool(lora.get("use_rslora", False)),
        # a reward model is a sequence classifier (TRL's RewardTrainer takes one; a CAUSAL_LM
        # PeftModel over it fails at `prepare_inputs_for_generation`)
        task_type={"sequence-classification": "SEQ_CLS", "reward-model": "SEQ_CLS",
                   "seq2seq": "SEQ_2_SEQ_LM"}.get(task, "CAUSAL_LM"),
    )


def _apply_freeze(model, freeze: dict):
    """Train only the layers in ``trainable_layers`` (negative counts from
    the end) and parameters whose name contains one of ``trainable_modules``
    (vramplan.spec.sections.FreezeConfig)."""
    total = int(getattr(model.config, "num_hidden_layers", 0) or 0)
    layers = {i % total for i in freeze.get("trainable_layers", [])} if total else set()
    patterns = [f".{i}." for i in sorted(layers)]
    modules = list(freeze.get("trainable_modules", []))
    if not patterns and not modules:
        raise ValueError("freeze: name trainable_layers or trainable_modules")
    layer_word = re.compile(r"\.(layers|h|blocks|layer)\.(\d+)\.")
    for name, p in model.named_parameters():
        m = layer_word.search(name)
        in_layer = m is not None and int(m.group(2)) in layers
        p.requires_grad_(in_layer or any(mod in name for mod in modules))
    return model


def convert_float8(model, float8: dict) -> None:
    """torchao float8 training as torchtitan and accelerate apply it
    (torchao.float8.convert_to_float8_training with the recipe's Float8LinearConfig); the
    filter keeps what Float8Linear can run (both dimensions multiples of 16, torchtitan's
    `_is_linear_float8_compatible`) and leaves the output head alone unless asked."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    recipe = str(float8.get("recipe", "tensorwise")).replace("-", "_")
    config = Float8LinearConfig.from_recipe_name(recipe)
    if float8.get("fsdp_float8_all_gather"):
        from dataclasses import replace
        config = replace(config, enable_fsdp_float8_all_gather=True)
    head = bool(float8.get("convert_lm_head", False))
    heads = {"lm_head", "score", "classifier"}

    def keep(module, fqn: str) -> bool:
        if fqn.rsplit(".", 1)[-1] in heads and not head:
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, config=config, module_filter_fn=keep)


def apply_checkpointing(model, job: dict) -> None:
    gc = job.get("gradient_checkpointing", "none")
    every = int(job.get("checkpoint_every", 1) or 1)
    if gc in (None, False, "none", "off"):
        return
    if gc == "selective" and _framework(job) == "torchtitan":
        gc = "op-selective"
    if gc == "op-selective":
        from .torchtitan_ac import apply_op_selective
        return apply_op_selective(model)
    if gc not in (True, "full", "on"):
        raise ValueError(f"gradient_checkpointing: unsupported value {gc!r}")
    if every > 1:
        from .torchtitan_ac import apply_every_nth
        return apply_every_nth(model, every)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def _framework(job: dict) -> str | None:
    stack = job.get("stack")
    return stack.get("framework") if isinstance(stack, dict) else stack


# ------------------------------------------------------------- the optimizer
# torch.optim.AdamW's default weight decay, applied to every optimizer unless
# the job sets ``weight_decay``.  It matters for memory: SGD/Adam with a
# non-zero decay build a parameter-sized temporary
# (torch/optim/sgd.py _multi_tensor_sgd: ``torch._foreach_add(grads, params,
# alpha=weight_decay)``); AdamW decays in place.  The dev-truth SGD row's
# optimizer peak (params + grads + momentum + one parameter-sized list) is
# reproduced only with a non-zero decay.
WEIGHT_DECAY_DEFAULT = 0.01

def build_optimizer(params: list[torch.Tensor], job: dict, model=None) -> torch.optim.Optimizer:
    """The job's optimizer over `params`; with `optimizer_in_backward`, one per parameter
    stepped in a post-accumulate-grad hook (measure/optimizers.py)."""
    name = str(job.get("optimizer", "adamw")).lower()
    if job.get("optimizer_in_backward") and name not in ("lomo", "adalomo"):
        from .optimizers import in_backward

        if name in ("galore-adamw", "apollo-adamw", "muon", "adam-mini"):
            raise ValueError(f"optimizer_in_backward: measured for per-parameter optimizers, not {name}")

        plain = {k: v for k, v in job.items() if k != "optimizer_in_backward"}
        return in_backward(lambda ps: build_optimizer(ps, plain, model), params)
    return _build_one(name, params, job, model)


def _build_one(name: str, params: list[torch.Tensor], job: dict, model) -> torch.optim.Optimizer:
    # A job without optimizer_impl takes the spec's default (spec/job.py, torch's
    # _default_to_fused_or_foreach): foreach on CUDA, the per-parameter loop on CPU.
    default = "foreach" if str(job.get("backend", "cpu")).lower() == "cuda" else "forloop"
    impl = str(job.get("optimizer_impl") or default).lower()
    lr = float(job.get("learning_rate", 1e-4))
    wd = float(job.get("weight_decay", WEIGHT_DECAY_DEFAULT))
    flags = {"foreach": impl == "foreach", "fused": impl == "fused"}
    if impl == "forloop":
        flags = {"foreach": False, "fused": False}
    if name in ("adamw", "adam"):
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        return cls(params, lr=lr, weight_decay=wd, **flags)
    if name == "sgd":
        momentum = float(job.get("momentum", 0.0) or 0.0)
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=wd, **flags)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False, weight_decay=wd)
    if name == "lion":
        if not hasattr(torch.optim, "Lion"):
            raise ValueError("optimizer: lion is not in torch.optim of this torch; install lion-pytorch")
        return torch.optim.Lion(params, lr=lr, weight_decay=wd)
    from .optimizers import build_named

    if name in ("galore-adamw", "apollo-adamw", "muon", "adam-mini", "lomo", "adalomo") and model is None:
        raise ValueError(f"optimizer: {name} is measured on single-model jobs only (it needs the model)")
    built = build_named(name, model, params, job, lr, wd)
    if built is not None:
        return built
    raise ValueError(f"optimizer: unknown value {name!r}")


def job_dtypes(job: dict):
    """The estimator's effective dtypes of the job (vramplan.components.dtypes: the
    precision word read on the job's stack, over the load dtype the stack would use for
    this config), so a measurement runs the precision the estimate assumes."""
    from vramplan import load_spec
    from vramplan.catalog.hf_config import checkpoint_dtype
    from vramplan.components.dtypes import dtypes_of, resolve_load_dtype

    spec = resolve_load_dtype(load_spec(job), checkpoint_dtype(hf_config_dict(job["model"])))
    return dtypes_of(spec)


def build(job: Any, device: str = "cpu") -> Built:
    """Model + optimizer for ``job`` on ``device`` (under FakeTensorMode if active)."""
    job = job_dict(job)
    precision = norm_precision(job.get("precision", "fp32"))
    dt = job_dtypes(job)
    model_dtype, autocast_dtype = DTYPES[dt.weights], DTYPES[dt.autocast] if dt.autocast else None
    model = build_model(job, device, model_dtype)
    model = apply_method(model, job, device)
    if job.get("float8"):
        convert_float8(model, job["float8"])
    if job.get("neftune_noise_alpha"):
        # what Trainer does when neftune_noise_alpha is set (transformers/integrations/neftune.py
        # activate_neftune: a forward hook on the input embeddings)
        from transformers.integrations.neftune import activate_neftune
        activate_neftune(model, float(job["neftune_noise_alpha"]))
    if job.get("method") == "lora" and dt.adapters != "fp32":
        # frameworks that cast the whole module (DeepSpeed's engine, torchtune's builder)
        # keep the adapters in the model's dtype instead of PEFT's fp32 upcast
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(DTYPES[dt.adapters])
    apply_checkpointing(model, job)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    pairs = []
    if dt.master_weights:
        # DeepSpeed-style: the optimizer steps fp32 masters; 16-bit copies run.
        pairs = [(p.detach().float().requires_grad_(False), p) for p in trainable]
        trainable = [m for m, _ in pairs]
    optimizer = build_optimizer(trainable, job, None if pairs else model)
    return Built(model, optimizer, precision, autocast_dtype, pairs)

"""The `stack` section of the job spec: which training framework runs the job, and the
library versions whose behaviour changes memory; and `load_dtype`, the dtype the weights
are loaded in.

The precision words of the spec (`bf16`, `fp16`) mean what the stack's own flag means
(HF Trainer's `bf16=True` turns on autocast; DeepSpeed's `bf16.enabled` keeps 16-bit
weights over an fp32 master copy; torchtune's `dtype: bf16` trains in pure bf16). What
each framework does with them is derived once, in `vramplan.components.dtypes`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Mapping

from vramplan.spec.enums import Backend, Optimizer, OptimizerImpl, SpecError, _Choice
from vramplan.spec.sections import boolean


class Framework(_Choice):
    PLAIN = "plain"
    """No framework named (the default): the precision words mean what they say. `bf16` is
    pure bf16 (weights, gradients and optimizer states in bf16; PEFT's adapters fp32), as it
    has always meant in vramplan specs and in the validation sets they are scored on (torchtune
    and litgpt runs, the exact CPU measurements). Name the stack (`--stack hf-trainer`), or
    import its config (TrainingArguments, DeepSpeed JSON, a recipe), for its own meaning."""
    HF_TRAINER = "hf-trainer"
    """transformers' Trainer (with PEFT for adapters): `bf16=True` is torch.autocast over
    the weights as loaded (transformers/trainer.py `autocast_smart_context_manager`)."""
    TRL = "trl"
    """TRL's trainers (SFT, DPO, GRPO, ...): HF Trainer subclasses, so the same precision
    rules; the model is loaded through `model_init_kwargs` (its `dtype`)."""
    DEEPSPEED = "deepspeed"
    """A DeepSpeed engine (directly or under HF Trainer): `bf16.enabled` casts the module to
    16-bit and keeps fp32 master weights and fp32 optimizer states
    (deepspeed/runtime/bf16_optimizer.py, fp16/fused_optimizer.py)."""
    ACCELERATE_FSDP = "accelerate-fsdp"
    """accelerate with FSDP: `mixed_precision: bf16` is autocast over the loaded weights, as
    under HF Trainer (accelerate/accelerator.py `autocast`)."""
    TORCHTUNE = "torchtune"
    """torchtune recipes: the model is built in `dtype` (bf16) and trained in it: weights,
    gradients and optimizer states all bf16, no autocast (torchtune/training/precision.py)."""
    AXOLOTL = "axolotl"
    """axolotl: builds an HF Trainer; `bf16: true` is the Trainer's autocast."""
    LLAMA_FACTORY = "llama-factory"
    """LLaMA-Factory: builds an HF Trainer; `bf16: true` is the Trainer's autocast."""
    MS_SWIFT = "ms-swift"
    """ModelScope SWIFT: builds an HF Trainer; `--torch_dtype` loads, `bf16` autocasts."""
    LITGPT = "litgpt"
    """litgpt (Lightning Fabric): `bf16-true` is pure bf16; `bf16-mixed` is autocast over
    fp32 weights (lightning/fabric/plugins/precision)."""
    TORCHTITAN = "torchtitan"
    """torchtitan: parameters stay fp32 and compute runs in `mixed_precision_param` (bf16):
    FSDP2's MixedPrecisionPolicy when sharded, torch.autocast on one device
    (torchtitan/distributed/utils.py `maybe_enable_amp`)."""
    MEGATRON = "megatron"
    """Megatron-LM / Megatron-Core: `--bf16` keeps bf16 weights and gradients with an fp32
    main copy in the distributed optimizer (megatron/core/optimizer)."""
    DIFFUSERS_SCRIPTS = "diffusers-scripts"
    """diffusers' example training scripts: accelerate autocast; frozen parts (VAE, text
    encoders, and the denoiser's base under LoRA) cast to `weight_dtype`, LoRA adapters in
    it too (fp32 only under fp16); a fully trained model kept in fp32."""


# How each framework turns the precision word into dtypes (components/dtypes.py).
AUTOCAST_FRAMEWORKS = frozenset({Framework.HF_TRAINER, Framework.TRL, Framework.ACCELERATE_FSDP,
                                 Framework.AXOLOTL, Framework.LLAMA_FACTORY, Framework.MS_SWIFT,
                                 Framework.DIFFUSERS_SCRIPTS})
MASTER_FRAMEWORKS = frozenset({Framework.DEEPSPEED, Framework.MEGATRON})
PURE_FRAMEWORKS = frozenset({Framework.TORCHTUNE, Framework.LITGPT})
FP32_PARAM_FRAMEWORKS = frozenset({Framework.TORCHTITAN})
# Whose step is transformers' Trainer.training_step with its (or TRL's) collators: the loss
# returned detached, packed batches flattened to one row (step/build.py, components/arch.py).
TRAINER_STEP_FRAMEWORKS = frozenset({Framework.HF_TRAINER, Framework.TRL})
# Whose step returns the loss detached (transformers' Trainer.training_step): the frameworks
# above, and LLaMA-Factory, whose trainers (llamafactory/train/{pt,sft,dpo,kto}/trainer.py)
# keep Trainer.training_step. It is not in TRAINER_STEP_FRAMEWORKS: its packing concatenates
# rows into cutoff_len blocks (data/processor/pretrain.py, supervised.py), not the
# padding-free one-row flattening that set also means. ms-swift too: its Seq2SeqTrainer's
# training_step calls Trainer.training_step inside the template's forward_context
# (swift/trainers/seq2seq_trainer.py; measured, bench/stack/ms_swift.py).
LOSS_DETACHED_FRAMEWORKS = TRAINER_STEP_FRAMEWORKS | {Framework.LLAMA_FACTORY, Framework.MS_SWIFT}
# Tasks whose step is a TRL trainer's whatever the stack names (DPOTrainer, KTOTrainer,
# RewardTrainer, GRPOTrainer, GKDTrainer, ORPOTrainer, CPOTrainer: transformers.Trainer
# subclasses, so Trainer.training_step returns the loss detached); what measure/trainers.py
# runs for them.
TRL_TRAINER_TASKS = frozenset({"dpo", "ipo", "kto", "reward-model", "grpo", "rloo", "distill", "orpo", "simpo"})


# Whose optimizer transformers' Trainer builds from TrainingArguments.optim (the TRL trainers'
# tasks too, whatever the stack): with no optim named, `adamw_torch_fused` since transformers
# 4.54 with torch >= 2.8 (training_args.py `default_optim`, transformers#37358; axolotl's own
# default since axolotl#2293), `adamw_torch` before.
TRAINER_OPTIM_FRAMEWORKS = frozenset({Framework.HF_TRAINER, Framework.TRL, Framework.AXOLOTL,
                                      Framework.LLAMA_FACTORY, Framework.MS_SWIFT})
FUSED_DEFAULT_SINCE = (4, 54)


def default_optimizer_impl(spec):
    """The optimizer implementation a spec that names none runs. torch.optim
    `_default_to_fused_or_foreach`: foreach when every tensor is on a CUDA device, the
    per-parameter loop otherwise (CPU). On CUDA a Trainer-built AdamW is transformers' default
    adamw_torch_fused: a Trainer-built stack (or a TRL trainer's task) at transformers 4.54 or
    later (an unstated version is a current one). The CPU runs that measure the trainers hand
    them the spec's own optimizer (measure/trainers.py), so the CPU keeps torch's default."""
    if spec.backend is not Backend.CUDA:
        return OptimizerImpl.FORLOOP
    trainer = spec.stack.framework in TRAINER_OPTIM_FRAMEWORKS or spec.task.value in TRL_TRAINER_TASKS
    release = spec.stack.minor("transformers")
    if spec.optimizer is Optimizer.ADAMW and trainer and (release is None or release >= FUSED_DEFAULT_SINCE):
        return OptimizerImpl.FUSED
    return OptimizerImpl.FOREACH


def loss_detached_before_step(spec) -> bool:
    """Whether the step frees the loss's graph before optimizer.step(): transformers'
    Trainer.training_step returns `loss.detach()` (HF Trainer, TRL, and the TRL trainers'
    tasks); a plain loop keeps `loss` (and its graph) until after the step."""
    return spec.stack.framework in LOSS_DETACHED_FRAMEWORKS or spec.task.value in TRL_TRAINER_TASKS

_LABELS = {
    Framework.PLAIN: "no framework named", Framework.HF_TRAINER: "HF Trainer", Framework.TRL: "TRL", Framework.DEEPSPEED: "DeepSpeed",
    Framework.ACCELERATE_FSDP: "accelerate FSDP", Framework.TORCHTUNE: "torchtune",
    Framework.AXOLOTL: "axolotl", Framework.LLAMA_FACTORY: "LLaMA-Factory",
    Framework.MS_SWIFT: "ms-swift", Framework.LITGPT: "litgpt", Framework.TORCHTITAN: "torchtitan",
    Framework.MEGATRON: "Megatron", Framework.DIFFUSERS_SCRIPTS: "diffusers scripts",
}

_VERSION = re.compile(r"^\d{1,4}(\.\d{1,4}){0,2}$")
"""A release: up to three parts of at most four digits (transformers: 10**30 read as a major release)."""

# Torch dtype words -> the spec's dtype names.
_DTYPE_WORDS = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "torch.float": "fp32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16", "torch.half": "fp16",
}


def parse_dtype(value: object, field_name: str) -> str | None:
    """A dtype as the spec spells it (fp32, bf16, fp16) from itself or a torch dtype word
    (`float32`, `bfloat16`, `torch.float16`, ...); None and "auto" mean the stack's default."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text == "auto":
        return None
    if text in _DTYPE_WORDS:
        return _DTYPE_WORDS[text]
    raise SpecError(field_name, f"unknown dtype {value!r}; use fp32, bf16 or fp16 (or float32, "
                                "bfloat16, float16, torch.bfloat16), or auto for the stack's default")


CUDA_MAJORS = (7, 99)
"""CUDA runtime majors taken: PyTorch's first CUDA builds ran on 7.5 (0.1, 2017); CUDA 0 or
1.5, or a major of many digits, is a slip that would silently read as the newest runtime."""


def parse_cuda_version(value: object) -> str:
    """The spec's `cuda_version`: a version like 12.4 (ASCII digits: components/runtime.py
    compares it as integers)."""
    text = str(value).strip()
    parts = text.split(".")
    if (isinstance(value, bool) or not 1 <= len(parts) <= 3
            or not all(p.isascii() and p.isdigit() for p in parts)):
        raise SpecError("cuda_version", f"expected a version like 12.4, got {value!r}")
    low, high = CUDA_MAJORS
    if not low <= int(parts[0]) <= high:
        raise SpecError("cuda_version", f"CUDA {text} is no runtime PyTorch runs on; give the job's CUDA "
                                        "runtime, e.g. 12.4 (torch.version.cuda)")
    return text


def _version(value: object, field_name: str) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    if isinstance(value, bool) or not text.isascii() or not _VERSION.match(text):
        raise SpecError(field_name, f"expected a release like '5.24' or '0.21.0', got {value!r}")
    if isinstance(value, float) and len(text.partition(".")[2]) == 1:
        # YAML and JSON read an unquoted 4.50 as the number 4.5: release 4.50 became 4.5, silently
        raise SpecError(field_name, f"the number {text} may be a release like {text}0 read as a number; "
                        f"write it in quotes ('{text}0' or '{text}')")
    return text


@dataclass(frozen=True, kw_only=True, slots=True)
class StackConfig:
    """The framework that runs the training step and the library releases that matter.
    The default names no framework (`plain`: the words mean what they say, bf16 = pure bf16)
    with current releases of transformers, PEFT and TRL; the importers set the framework of
    the file they read."""

    framework: Framework = Framework.PLAIN
    """Which framework's meaning of bf16/fp16 (and of its other defaults) applies."""
    transformers: str | None = "5.24"
    """transformers release: from 5.0 `from_pretrained` loads the checkpoint's own dtype
    (`dtype="auto"` default); 4.x loads fp32 unless `torch_dtype` is given."""
    trl: str | None = "1.16"
    """TRL release (its log-prob heads and config defaults change by release)."""
    peft: str | None = "0.21"
    """PEFT release: LoRA adapters on a 16-bit base are upcast to fp32
    (`autocast_adapter_dtype=True`, PEFT >= 0.12)."""
    fp32_logits: bool = False
    """The output head's logits are cast to fp32 as the head returns, so the 16-bit ones go at
    once: LLaMA-Factory's `upcast_lmhead_output` (a forward hook returning `output.to(float32)`,
    model_utils/checkpointing.py); torchtune does it always (components/activations.py)."""

    def __post_init__(self):
        object.__setattr__(self, "framework", Framework.parse(self.framework, "stack.framework"))
        for name in ("transformers", "trl", "peft"):
            object.__setattr__(self, name, _version(getattr(self, name), f"stack.{name}"))
        object.__setattr__(self, "fp32_logits", boolean("stack.fp32_logits", self.fp32_logits))

    @property
    def label(self) -> str:
        return _LABELS[self.framework]

    def major(self, library: str) -> int | None:
        version = getattr(self, library)
        return None if version is None else int(version.split(".")[0])

    def minor(self, library: str) -> tuple[int, int] | None:
        version = getattr(self, library)
        if version is None:
            return None
        parts = [int(x) for x in version.split(".")] + [0]
        return parts[0], parts[1]

    def to_dict(self) -> dict:
        out = {"framework": self.framework.value, "transformers": self.transformers,
               "trl": self.trl, "peft": self.peft}
        return out | ({"fp32_logits": True} if self.fp32_logits else {})


RELEASE_OF = {Framework.TRL: "trl", Framework.HF_TRAINER: "transformers"}
"""The library whose release `FRAMEWORK@RELEASE` names (`--stack trl@1.9`)."""


def parse_stack(value: object) -> StackConfig:
    """`stack: torchtune` (a framework name), `trl@1.9` (TRL or the HF Trainer with the release
    of its library) or a mapping of StackConfig fields."""
    if value is None:
        return StackConfig()
    if isinstance(value, StackConfig):
        return value
    if isinstance(value, str) and "@" in value:
        name, _, release = value.partition("@")
        framework = Framework.parse(name.strip(), "stack")
        if framework not in RELEASE_OF:
            raise SpecError("stack", f"{framework.value} takes no release after '@' (only "
                            f"{' and '.join(f.value + '@RELEASE' for f in RELEASE_OF)}); "
                            "give stack as a mapping to set library releases")
        return StackConfig(framework=framework, **{RELEASE_OF[framework]: _version(release.strip(), "stack")})
    if isinstance(value, str):
        return StackConfig(framework=value)
    if not isinstance(value, Mapping):
        raise SpecError("stack", f"expected a framework name or a mapping, got {value!r}")
    known = {"framework", "transformers", "trl", "peft", "fp32_logits"}
    for key in value:
        if key not in known:
            raise SpecError(f"stack.{key}", f"unknown key; choose from {', '.join(sorted(known))}")
    return StackConfig(**dict(value))


__all__ = ["Framework", "StackConfig", "parse_cuda_version", "parse_dtype", "parse_stack", "RELEASE_OF",
           "AUTOCAST_FRAMEWORKS", "MASTER_FRAMEWORKS", "PURE_FRAMEWORKS", "FP32_PARAM_FRAMEWORKS",
           "TRAINER_STEP_FRAMEWORKS", "TRL_TRAINER_TASKS", "loss_detached_before_step"]

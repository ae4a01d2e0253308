"""The effective dtypes of a job: weights, gradients, optimizer states, master weights and
compute, derived once from the precision word, the stack and the load dtype.

The precision words `bf16` and `fp16` mean what the stack's own flag means:

- HF Trainer, TRL, accelerate, axolotl, LLaMA-Factory, ms-swift, diffusers scripts:
  torch.autocast over the weights as loaded (transformers/trainer.py
  `autocast_smart_context_manager` -> accelerate `Accelerator.autocast`). The optimizer
  works on the parameters themselves, so with a bf16 checkpoint (transformers 5 loads the
  checkpoint's own dtype) weights, gradients and AdamW states are all bf16 with no fp32
  master; loaded in float32 they are all fp32 and only compute is bf16.
- DeepSpeed, Megatron: 16-bit weights and gradients with an fp32 master copy and fp32
  optimizer states (deepspeed/runtime/bf16_optimizer.py `BF16_Optimizer`,
  megatron/core/optimizer `Float16OptimizerWithFloat16Params`).
- torchtune, litgpt (`bf16-true`): the model is built in the dtype and trained in it,
  no autocast, no master (torchtune/training/precision.py `set_default_dtype`).
- torchtitan: fp32 parameters (and so fp32 gradients and states) with bf16 compute,
  FSDP2's MixedPrecisionPolicy(param_dtype=bf16) when sharded and torch.autocast on one
  device (torchtitan/distributed/utils.py `maybe_enable_amp`).

The explicit words keep one meaning on every stack: `amp-*` autocast over the load dtype
(fp32 unless `load_dtype` says otherwise), `mixed-*` fp32 master weights, `pure-*` pure
16-bit, `fp32` no autocast over the load dtype (fp32 unless told).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from vramplan.i18n import Msg
from vramplan.spec import JobSpec, Method, Precision, SpecError
from vramplan.spec.job import copy_with
from vramplan.spec.stack import (
    Framework, AUTOCAST_FRAMEWORKS, FP32_PARAM_FRAMEWORKS, MASTER_FRAMEWORKS, PURE_FRAMEWORKS, StackConfig,
    parse_dtype,
)

_AUTOCAST, _MASTER, _PURE, _FP32_PARAMS = "autocast", "master", "pure", "fp32-params"


@dataclass(frozen=True, slots=True)
class Dtypes:
    """What the job stores and computes in."""

    policy: str
    """autocast | master | pure | fp32-params | fp32: how the precision word was applied."""
    weights: str
    """Storage dtype of the (non-quantized) model parameters."""
    gradients: str
    """dtype of the trained base parameters' .grad."""
    optimizer_states: str
    """dtype of the optimizer's per-parameter states (Adam's exp_avg, exp_avg_sq)."""
    master_weights: str | None
    """fp32 master copy of 16-bit weights, or None."""
    compute: str
    """dtype matmuls produce (activations)."""
    autocast: str | None
    """torch.autocast dtype, or None when the step runs without autocast."""
    adapters: str
    """LoRA adapter storage dtype (and so their gradients' and states')."""
    source: str
    """The framework flag this came from, in the user's words."""
    trains_adapters: bool = False
    """A LoRA view (for_adapters): gradients and states are the adapters'."""

    def for_adapters(self) -> "Dtypes":
        """The view of a LoRA job: what is trained are the adapters, so their dtype is that
        of the gradients and (without an fp32 master) of the optimizer states."""
        grads = self.gradients if self.master_weights else self.adapters
        states = self.optimizer_states if self.master_weights else self.adapters
        return replace(self, gradients=grads, optimizer_states=states, trains_adapters=True)

    def describe(self, optimizer_states: bool = True, training: bool = True) -> str:
        """Plain words: 'weights bf16, autocast bf16, gradients bf16, optimizer states bf16
        (HF Trainer bf16=True)'."""
        # Msg: English text the report edge can print translated (vramplan.i18n.tr)
        parts = [Msg("weights {dtype}", dtype=self.weights)]
        if self.trains_adapters:
            parts.append(Msg("adapters {dtype}", dtype=self.adapters))
        parts.append(Msg("autocast {dtype}", dtype=self.autocast) if self.autocast
                     else Msg("compute {dtype}", dtype=self.compute))
        if not training:  # inference: nothing else is held in a dtype of its own
            return Msg("{parts} ({source})", parts=Msg.join(", ", parts), source=self.source)
        parts.append(Msg("gradients {dtype}", dtype=self.gradients))
        if optimizer_states:
            parts.append(Msg("optimizer states {dtype}", dtype=self.optimizer_states))
        if self.master_weights:
            parts.append(Msg("master weights {dtype}", dtype=self.master_weights))
        return Msg("{parts} ({source})", parts=Msg.join(", ", parts), source=self.source)

    def to_dict(self) -> dict:
        return {"weights": self.weights, "gradients": self.gradients,
                "optimizer_states": self.optimizer_states, "master_weights": self.master_weights,
                "compute": self.autocast or self.compute, "autocast": self.autocast is not None,
                "adapters": self.adapters, "policy": self.policy, "source": self.source}


def _word_dtype(precision: Precision) -> str:
    return "fp32" if precision is Precision.FP32 else precision.value.split("-")[-1]


def _policy(precision: Precision, stack: StackConfig) -> str:
    if precision is Precision.FP32:
        return "fp32"
    if precision.is_autocast:
        return _AUTOCAST
    if precision.has_master_weights:
        return _MASTER
    if precision in (Precision.PURE_BF16, Precision.PURE_FP16):
        return _PURE
    fw = stack.framework
    if fw is Framework.PLAIN:  # no framework named: bf16 is pure bf16 (spec/stack.py)
        return _PURE
    if fw in MASTER_FRAMEWORKS:
        return _MASTER
    if fw in PURE_FRAMEWORKS:
        return _PURE
    if fw in FP32_PARAM_FRAMEWORKS:
        return _FP32_PARAMS
    assert fw in AUTOCAST_FRAMEWORKS, fw
    return _AUTOCAST


def default_load_dtype(spec: JobSpec, checkpoint_dtype: str | None) -> str:
    """The dtype `from_pretrained` (or the framework's builder) loads the weights in when the
    job does not say. transformers >= 5 loads the checkpoint's own dtype (`dtype="auto"`
    default, modeling_utils.py `_get_dtype`); 4.x loads fp32 unless told. A config that
    states no dtype is taken to be loaded in the dtype the precision word names."""
    word, policy = _word_dtype(spec.precision), _policy(spec.precision, spec.stack)
    if spec.task.value == "inference":  # no trainer: the model is run in the named dtype
        return word
    if upcasts_trainable(spec):
        # LLaMA-Factory loads with torch_dtype="auto" whatever its flags and the transformers
        # release (llamafactory/model/loader.py `load_model`): the checkpoint's dtype; a full
        # fine-tune then has every parameter upcast (upcasts_trainable)
        return "fp32" if spec.method is Method.FULL else (checkpoint_dtype or word)
    if policy in ("fp32", _FP32_PARAMS) or (policy == _AUTOCAST and spec.precision.is_autocast):
        return "fp32"
    if policy != _AUTOCAST:
        return word
    major = spec.stack.major("transformers")
    if major is not None and major < 5:
        return "fp32"
    return checkpoint_dtype or word


def upcasts_trainable(spec: JobSpec) -> bool:
    """Whether the stack casts every trainable parameter to fp32 after loading: LLaMA-Factory
    does (llamafactory/model/adapter.py `init_adapter`: cast_trainable_params_to_fp32 in
    `_setup_full_tuning` / `_setup_freeze_tuning` / `_setup_lora_tuning`) unless `pure_bf16`
    or BAdam (precision pure-*), the frozen ones keeping the dtype they were loaded in."""
    return (spec.stack.framework is Framework.LLAMA_FACTORY and spec.task.value != "inference"
            and _policy(spec.precision, spec.stack) in (_AUTOCAST, "fp32"))


def resolve_load_dtype(spec: JobSpec, checkpoint_dtype: str | None) -> JobSpec:
    """The spec with `load_dtype` filled in (what the answer then states)."""
    if spec.load_dtype is not None:
        return spec
    # load_dtype is validated by parse_dtype alone (spec/job.py __post_init__)
    return copy_with(spec, load_dtype=parse_dtype(default_load_dtype(spec, checkpoint_dtype), "load_dtype"))


def stated_dtypes(spec: JobSpec) -> Dtypes:
    """What an answer states: for LoRA/QLoRA the adapters' gradients and states."""
    dt = dtypes_of(spec)
    return dt.for_adapters() if spec.method in (Method.LORA, Method.QLORA) else dt


_LAST: list = [None]


def dtypes_of(spec: JobSpec) -> Dtypes:
    """The effective dtypes of the job (memoized: many components ask, per parameter; the
    last spec is kept by identity, JobSpec being frozen, so those calls skip hashing it)."""
    last = _LAST[0]
    if last is not None and last[0] is spec:
        return last[1]
    d = _dtypes_of(spec)
    _LAST[0] = (spec, d)
    return d


def _dtypes_of(spec: JobSpec) -> Dtypes:
    return _derive(spec.precision, spec.stack, spec.load_dtype, spec.method, spec.quantization is not None,
                   spec.task.value)


@lru_cache(maxsize=256)
def _derive(precision: Precision, stack: StackConfig, load_dtype: str | None, method: Method,
            quantized: bool, task: str) -> Dtypes:
    word, policy = _word_dtype(precision), _policy(precision, stack)
    if policy == _PURE and stack.framework is Framework.PLAIN and load_dtype not in (None, word):
        # no framework named, but weights loaded in another dtype than the word: the word
        # can only be an autocast flag over them (what every trainer's bf16 flag does)
        policy = _AUTOCAST
    load = load_dtype or ("fp32" if policy in ("fp32", _FP32_PARAMS) or precision.is_autocast else word)
    source = _source(precision, stack, policy)
    if policy == _MASTER:
        # DeepSpeed's engine casts the module to 16-bit (`module.bfloat16()` / `.half()`),
        # whatever it was loaded in; gradients are 16-bit, the optimizer sees fp32 copies.
        adapters = word if stack.framework in MASTER_FRAMEWORKS else "fp32"
        return Dtypes(policy, word, word, "fp32", "fp32", word, None, adapters, source)
    if policy == _PURE:
        return Dtypes(policy, word, word, word, None, word, None, _adapter_dtype(stack, word), source)
    if policy == _FP32_PARAMS:
        return Dtypes(policy, "fp32", "fp32", "fp32", None, word, word, "fp32", source)
    if policy == "fp32":
        return Dtypes(policy, load, load, load, None, load, None, _adapter_dtype(stack, load), source)
    _check_fp16_grads(precision, stack, load, method, task)
    autocast = word
    return Dtypes(policy, load, load, load, None, word, autocast, _adapter_dtype(stack, load), source)


def _adapter_dtype(stack: StackConfig, base: str) -> str:
    """PEFT upcasts adapters of a 16-bit base to fp32 (`autocast_adapter_dtype=True`,
    peft/tuners/tuners_utils.py `_cast_adapter_dtype`, PEFT >= 0.12). torchtune and litgpt
    build their own LoRA modules in the model's dtype; DeepSpeed and Megatron cast the
    whole module (adapters included) to 16-bit; diffusers' scripts keep them in the weight
    dtype except under fp16."""
    if stack.framework in PURE_FRAMEWORKS or stack.framework in MASTER_FRAMEWORKS:
        return base
    if stack.framework is Framework.DIFFUSERS_SCRIPTS:
        # `add_adapter` gives the adapters the base layer's dtype; the scripts upcast them
        # only under fp16 (`cast_training_params`, jobs/diffusion_scripts.adapter_dtype)
        return "fp32" if base == "fp16" else base
    version = stack.minor("peft")
    if version is not None and version < (0, 12):
        return base
    return "fp32"


def _check_fp16_grads(precision: Precision, stack: StackConfig, load: str, method: Method, task: str) -> None:
    """HF Trainer's fp16 runs a GradScaler, whose unscale refuses fp16 gradients
    (torch/amp/grad_scaler.py `_unscale_grads_`: "Attempting to unscale FP16 gradients.").
    Full or partial training of an fp16-loaded model therefore cannot run; LoRA can (PEFT's
    adapters are fp32)."""
    if (precision is Precision.FP16 and load == "fp16" and method in (Method.FULL, Method.FREEZE)
            and task != "inference"):
        raise SpecError("precision", f"fp16 under {stack.label} with weights loaded in fp16 trains fp16 "
                        "gradients, which torch's GradScaler refuses ('Attempting to unscale FP16 "
                        "gradients'); load in float32 (load_dtype: float32) or use bf16")


def _source(precision: Precision, stack: StackConfig, policy: str) -> str:
    word = precision.value
    if precision in (Precision.BF16, Precision.FP16):
        flags = {_AUTOCAST: f"{stack.label} {word}=True", _MASTER: f"{stack.label} {word}.enabled",
                 _PURE: f"{stack.label} dtype {word}", _FP32_PARAMS: f"{stack.label} mixed_precision_param {word}"}
        return flags[policy]
    return {"fp32": "no mixed precision", _AUTOCAST: "torch.autocast", _MASTER: "fp32 master weights",
            _PURE: "pure 16-bit"}[policy] + f", precision {word}"

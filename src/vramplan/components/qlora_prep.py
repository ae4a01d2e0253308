"""How the job's stack prepares a quantized base for adapter training: the dtype of the
parameters the quantizer left as they were (embeddings, norms, the output head, biases) and
of the trained adapters. Stacks differ, and the difference is the fp32 residual stream:

* `PEFT_KBIT`, PEFT's `prepare_model_for_kbit_training` (peft/utils/other.py: every 16-bit
  parameter that is not a quantized weight cast to fp32), then `get_peft_model`, which
  keeps the adapters of a quantized base in fp32 (`autocast_adapter_dtype=True`). The recipe
  of PEFT's and transformers' QLoRA docs, so what a script under the HF Trainer (and a spec
  that names no stack) runs; axolotl calls it too, then restores some dtypes (`AXOLOTL`).
* `TRL_KBIT`, TRL's trainers before 0.26 (trl/trainer/sft_trainer.py `_prepare_peft_model`,
  later trl/models/utils.py `prepare_peft_model`) and the experimental ORPO and CPO trainers
  of TRL 1.x (trl/experimental/orpo/orpo_trainer.py, cpo/cpo_trainer.py `__init__`): PEFT's
  preparation, then under `bf16=True` `peft_module_casting_to_bf16`, which leaves norms in
  fp32 and casts the modules named lm_head, embed_tokens, wte or wpe back to bf16. Before
  0.26 a base whose 4-bit weights are not on a GPU (`is_sharded_qlora`: FSDP or ZeRO-3
  loading, or a CPU run) skips it: `TRL_SHARDED`, the rest as loaded and the adapters in the
  dtype PEFT creates them in (`autocast_adapter_dtype=False`), the base's; TRL 0.25.1 on CPU
  measured so (bf16 adapters and norms on a bf16 load).
* `TRL_BF16`, TRL 0.26 and later (trl#4577, "Clean up model preparation": SFT, DPO, KTO,
  GRPO, RLOO, reward and distillation trainers `__init__`): no preparation; every trainable
  parameter of a quantized model is cast to bf16 (`param.data.to(torch.bfloat16)`), the
  DoRA magnitude excepted.
* `NONE`: torchtune's QLoRA builders (torchao NF4 base linears, the rest and the adapters in
  the model's dtype), litgpt (Fabric's BitsandbytesPrecision replaces the linears; the rest is
  built in the precision's dtype, adapters included) and LLaMA-Factory (no kbit preparation:
  llamafactory/model/model_utils/checkpointing.py `prepare_model_for_training` upcasts norms
  only with `upcast_layernorm`, default False; its adapters follow its own
  `cast_trainable_params_to_fp32`, model/adapter.py, which the stack's dtypes say). ms-swift
  too: no call of prepare_model_for_kbit_training in its tree (ms-swift 3602360a5, read, not
  run here); its adapters keep PEFT's cast unless `lora_dtype` is set (swift/tuners/peft.py).
* `AXOLOTL`: axolotl (src/axolotl/loaders/model.py, read at 067b021c8, not run here): PEFT's
  preparation, then for an adapter (`needs_fa2_dtype`) the modules named "norm" and the
  embedding layers (loaders/utils.py get_linear_embedding_layers: embed_tokens and lm_head;
  GPT-NeoX embed_in/embed_out) back to the load dtype (`_convert_embedding_modules_dtype`);
  what else the preparation upcast (biases) stays fp32. Not with FSDP (`is_qlora_and_fsdp`,
  no preparation either) or ZeRO-3.
* `NORMS_FP32`: LLaMA-Factory with `upcast_layernorm: true` (which it recommends for quantized
  training): the 1-D parameters named with "norm" or "ln" (extras/constants.py
  LAYERNORM_NAMES) in fp32, the rest as loaded. The norms' fp32 outputs then make the whole
  residual stream fp32, since a bitsandbytes 4-bit linear returns its input's dtype.
"""
from __future__ import annotations

from dataclasses import replace
from enum import Enum

from vramplan.components.dtypes import dtypes_of
from vramplan.i18n import Msg, N_
from vramplan.spec import Backend, JobSpec, Method, QuantType
from vramplan.spec.stack import TRL_TRAINER_TASKS, Framework


class Prep(Enum):
    """The preparations, valued by the spec's words for them (quantization.prepare)."""
    PEFT_KBIT = "peft"
    TRL_KBIT = "peft-bf16"
    TRL_BF16 = "bf16-trainable"
    NORMS_FP32 = "norms-fp32"
    TRL_SHARDED = "unprepared"
    AXOLOTL = "peft-restored"
    NONE = "none"


TRL_BF16_SINCE = (0, 26)
"""trl#4577 (v0.26.0): the trainers stop calling prepare_model_for_kbit_training."""
# TRL's experimental trainers that kept the old preparation in 1.x
_TRL_KBIT_TASKS = frozenset({"orpo", "simpo"})
# trl/trainer/utils.py peft_module_casting_to_bf16: `any(x in name for x in [...])`
_BF16_BACK = ("lm_head", "embed_tokens", "wte", "wpe")
_LAYERNORM_NAMES = ("norm", "ln")
# axolotl loaders/utils.py get_linear_embedding_layers (Llama-likes, GPT-NeoX, Falcon)
_AXOLOTL_EMBEDDINGS = ("embed_tokens", "lm_head", "embed_in", "embed_out", "word_embeddings")
_NO_PREP = frozenset({Framework.TORCHTUNE, Framework.LITGPT, Framework.LLAMA_FACTORY, Framework.MS_SWIFT})


def preparation(spec: JobSpec) -> Prep:
    """Which preparation a QLoRA job's base goes through: the spec's `quantization.prepare`,
    or the one the stack's trainer runs for the job's task."""
    if spec.quantization is not None and spec.quantization.prepare != "auto":
        return Prep(spec.quantization.prepare)
    if spec.stack.framework in _NO_PREP:
        return Prep.NONE
    if spec.stack.framework is Framework.AXOLOTL and spec.task.value not in TRL_TRAINER_TASKS:
        return Prep.NONE if _sharded(spec) else Prep.AXOLOTL
    trl_runs = spec.task.value in TRL_TRAINER_TASKS or (spec.stack.framework is Framework.TRL
                                                        and spec.task.value == "sft")
    if not trl_runs:
        return Prep.PEFT_KBIT
    release = spec.stack.minor("trl")
    if spec.task.value not in _TRL_KBIT_TASKS and (release is None or release >= TRL_BF16_SINCE):
        return Prep.TRL_BF16
    if spec.task.value not in _TRL_KBIT_TASKS and (_sharded(spec) or spec.backend is not Backend.CUDA):
        return Prep.TRL_SHARDED   # is_sharded_qlora: neither preparation nor the bf16 cast
    return Prep.TRL_KBIT


def _sharded(spec: JobSpec) -> bool:
    """The base's weights loaded sharded (ZeRO-3's zero.Init, FSDP): what TRL's
    `is_sharded_qlora` and axolotl's `is_qlora_and_fsdp` skip the preparation for."""
    return spec.parallel.zero_stage == 3 or spec.parallel.fsdp != "none"


_SAYS = {
    Prep.PEFT_KBIT: N_("QLoRA base prepared by PEFT's prepare_model_for_kbit_training: embeddings, norms and "
                       "head in fp32, adapters fp32 (quantization.prepare: {word})"),
    Prep.TRL_KBIT: N_("QLoRA base prepared as TRL before 0.26 (and its experimental ORPO/CPO) do: "
                      "prepare_model_for_kbit_training, then under bf16 embeddings and head back to bf16 "
                      "(quantization.prepare: {word})"),
    Prep.TRL_BF16: N_("QLoRA base as TRL 0.26 and later leave it: no kbit preparation, the rest in the load "
                      "dtype, adapters cast to bf16 (quantization.prepare: {word})"),
    Prep.NORMS_FP32: N_("QLoRA base with its norm weights upcast to fp32 (LLaMA-Factory's upcast_layernorm), "
                        "the rest as loaded (quantization.prepare: {word})"),
    Prep.TRL_SHARDED: N_("QLoRA base as TRL before 0.26 leaves one not on a GPU (FSDP, ZeRO-3 or CPU): no kbit "
                         "preparation, adapters in the base's dtype (quantization.prepare: {word})"),
    Prep.AXOLOTL: N_("QLoRA base prepared as axolotl does: prepare_model_for_kbit_training, then norms and "
                     "embeddings back to the load dtype, adapters fp32 (quantization.prepare: {word})"),
    Prep.NONE: N_("QLoRA base not prepared: the rest of the model and the adapters in the model's dtype "
                   "(quantization.prepare: {word})"),
}


def notes(spec: JobSpec) -> list[Msg]:
    """What the answer says of a QLoRA job's preparation, and how to state another."""
    if spec.quantization is None or spec.method is not Method.QLORA:
        return []
    prep = preparation(spec)
    if prep in (Prep.PEFT_KBIT, Prep.TRL_KBIT) and not _peft_upcasts(spec):
        return [Msg("QLoRA base prepared by PEFT's prepare_model_for_kbit_training, which leaves a {type} "
                    "model's other parameters in their dtype (quantization.prepare: {word})",
                    type=spec.quantization.type.value, word=prep.value)]
    said = [Msg(_SAYS[prep], word=prep.value)]
    if prep is Prep.PEFT_KBIT and spec.stack.framework is Framework.PLAIN and not dtypes_of(spec).autocast:
        # no trainer's autocast over the upcast base: fp32 residual stream and attention inputs
        said.append(Msg("QLoRA under no named stack runs without a trainer's autocast, so its residual stream "
                        "is fp32; name the stack (--stack hf-trainer, trl, ...) for the trainer's bf16"))
    return said


def resolved(spec: JobSpec) -> JobSpec:
    """The spec with its QLoRA preparation stated (`quantization.prepare`), so that a model
    of the job seen apart from its trainer (jobs/trained.py single_spec: task sft) keeps it."""
    q = spec.quantization
    if q is None or q.prepare != "auto":
        return spec
    return replace(spec, quantization=replace(q, prepare=preparation(spec).value))


def _peft_upcasts(spec: JobSpec) -> bool:
    """prepare_model_for_kbit_training casts the other parameters to fp32 except for GPTQ,
    AQLM, EETQ, HQQ and torchao models (its `is_gptq_quantized` ... checks)."""
    return spec.quantization.type not in (QuantType.GPTQ, QuantType.HQQ, QuantType.TORCHAO_INT8,
                                          QuantType.TORCHAO_INT4, QuantType.TORCHAO_FP8)


def rest_dtype(spec: JobSpec, module: str, wdtype: str) -> str:
    """The dtype of a base parameter the quantizer left alone (`module` its module's name),
    loaded in `wdtype`."""
    prep = preparation(spec)
    if prep is Prep.NORMS_FP32:
        # `param.ndim == 1 and any(ln_name in name ...)`: the weights of the norm modules
        leaf = module.rsplit(".", 1)[-1]
        return "fp32" if any(n in leaf for n in _LAYERNORM_NAMES) else wdtype
    if prep in (Prep.NONE, Prep.TRL_BF16, Prep.TRL_SHARDED) or not _peft_upcasts(spec):
        return wdtype
    if prep is Prep.AXOLOTL and ("norm" in module or any(n in module for n in _AXOLOTL_EMBEDDINGS)):
        return wdtype
    if prep is Prep.TRL_KBIT and dtypes_of(spec).autocast == "bf16" and any(w in module for w in _BF16_BACK):
        return "bf16"
    return "fp32"


def adapter_dtype(spec: JobSpec, default: str) -> str:
    """The LoRA adapters' dtype on a quantized base; `default` is the stack's adapter dtype
    without one (dtypes.py). An engine that casts the whole module (DeepSpeed's 16-bit engine,
    a master-weights policy) decides it there."""
    prep = preparation(spec)
    if prep is Prep.TRL_BF16:
        return "bf16"
    if prep is Prep.TRL_SHARDED:
        return dtypes_of(spec).weights
    if prep in (Prep.NONE, Prep.NORMS_FP32) or dtypes_of(spec).master_weights:
        return default
    return "fp32"


def magnitude_dtype(spec: JobSpec, adapter: str) -> str:
    """DoRA's magnitude vector: with the adapters (`adapter`), except that TRL's bf16 cast of a
    quantized model's trainable parameters skips it (trl#7268), leaving PEFT's fp32."""
    return "fp32" if preparation(spec) is Prep.TRL_BF16 else adapter


def saved_copy_dtype(spec: JobSpec, module: str, wdtype: str) -> str:
    """A modules_to_save copy of a quantized job: a copy of the (prepared) original, then
    cast with the trainable parameters where TRL does so."""
    if preparation(spec) is Prep.TRL_BF16:
        return "bf16"
    return rest_dtype(spec, module, wdtype)


__all__ = ["Prep", "preparation", "resolved", "notes", "rest_dtype", "adapter_dtype", "magnitude_dtype", "saved_copy_dtype", "TRL_BF16_SINCE"]

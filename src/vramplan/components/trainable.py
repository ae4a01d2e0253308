"""Which parameters exist and which are trained, per the job's method.

The result lists every parameter tensor the job holds (base weights, LoRA adapters, PEFT
`modules_to_save` copies) with its storage dtype and whether it gets a gradient, matched
against module names the way PEFT matches them (peft/tuners/tuners_utils.py,
`check_target_module_exists`: a target equals the module name or is a `.`-suffix of it).
"""
from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass, field

from vramplan.components import moe_lora, qlora_prep
from vramplan.components.dtypes import dtypes_of, upcasts_trainable
from vramplan.catalog.runtime import peft_lora_targets
from vramplan.components.quant import code_dtype
from vramplan.model import ModelDesc, ParamEntry
from vramplan.spec import JobSpec, Method, QuantType
from vramplan.spec.sections import ALL_LINEAR
from vramplan.spec.stack import Framework

# Output heads that PEFT's "all-linear" leaves out (peft/tuners/tuners_utils.py,
# `_maybe_include_all_linear_layers` excludes the model's output embedding).
_HEADS = ("lm_head", "score", "classifier", "qa_outputs", "output")  # InternLM2's head is `output`
_EMBED_WORDS = ("embed", "wte", "wpe")


class HeldParam(namedtuple("_HeldFields", "name shape dtype trainable kind layer full_shape numel")):
    """One parameter tensor a rank holds: name, shape, storage dtype, whether it trains,
    kind (base | lora | saved_copy, a modules_to_save copy), decoder layer (None: outside
    the layers), full_shape (the unsharded shape when `shape` is one rank's flat partition,
    parallel/shard.py) and numel (elements of `shape`, computed once: a 70B layout reads it
    ~7,000 times per estimate). Immutable; a named tuple rather than a frozen dataclass
    because a search builds tens of thousands of them (per-rank shards of every layout),
    and a tuple is made three times faster."""
    __slots__ = ()

    def __new__(cls, name: str, shape: tuple[int, ...], dtype: str, trainable: bool, kind: str,
                layer: int | None = None, full_shape: tuple[int, ...] = ()):
        return tuple.__new__(cls, (name, shape, dtype, trainable, kind, layer, full_shape, math.prod(shape)))

    def __getnewargs__(self):   # the constructor's arguments: every field but the derived numel
        return tuple(self)[:-1]

    def _replace(self, **changes) -> "HeldParam":
        """namedtuple's _replace builds the tuple without __new__; this recomputes numel."""
        return HeldParam(**{**dict(zip(self._fields[:-1], self)), **changes})


@dataclass(frozen=True, slots=True)
class ParamSet:
    params: tuple[HeldParam, ...]
    unmatched_targets: tuple[str, ...] = ()
    """LoRA targets or modules_to_save names that match no module (PEFT would ignore them)."""
    trained: tuple[HeldParam, ...] = field(init=False, repr=False, compare=False)
    """The trainable params, selected once (an estimate asks for them many times)."""
    _counts: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "trained", tuple(p for p in self.params if p.trainable))
        object.__setattr__(self, "_counts", {})

    def trainable(self) -> tuple[HeldParam, ...]:
        return self.trained

    def numel(self, trainable: bool | None = None) -> int:
        n = self._counts.get(trainable)
        if n is None:
            n = self._counts[trainable] = sum(p.numel for p in self.params
                                              if trainable is None or p.trainable == trainable)
        return n


def is_linear(p: ParamEntry) -> bool:
    leaf = p.module.rsplit(".", 1)[-1]
    return p.is_linear_weight and not any(w in leaf for w in _EMBED_WORDS)


def linear_in_out(desc: ModelDesc, p: ParamEntry) -> tuple[int, int]:
    """(in_features, out_features); GPT-2's Conv1D stores its weight as (in, out)."""
    if desc.model_type == "gpt2" and p.module.rsplit(".", 1)[-1].startswith("c_"):
        return p.shape[0], p.shape[1]
    return p.shape[1], p.shape[0]


def _matches(module: str, target: str) -> bool:
    return module == target or module.endswith("." + target)


def targets_module(module: str, targets: tuple[str, ...] | str) -> bool:
    """Whether LoRA targets (names, or all-linear) take this linear module, as PEFT matches.
    (A list holding all-linear beside names is ms-swift's: `_lora_targets` expands it.)"""
    return targets == ALL_LINEAR or any(_matches(module, t) for t in targets)


_TARGETS: dict[tuple, tuple] = {}

# The frameworks whose own LoRA default is every linear layer: LLaMA-Factory's
# FinetuningArguments `lora_target` defaults to "all", ms-swift's TunerArguments
# `target_modules` to ['all-linear'] (swift/llm/argument/tuner_args.py).
_ALL_LINEAR_DEFAULT = frozenset({Framework.LLAMA_FACTORY, Framework.MS_SWIFT})
# What a Llama-layout attention calls its query and value projections: assumed, with a
# note, for a model type PEFT has no default for (validity.py says so).
LLAMA_TARGETS = ("q_proj", "v_proj")


def peft_default_targets(model_type: str) -> tuple[str, ...] | None:
    """PEFT's `target_modules` when LoraConfig names none, per `config.model_type`
    (catalog/peft_lora_targets.json, with its source); None when PEFT has no default."""
    targets = peft_lora_targets().get(model_type)
    return None if targets is None else tuple(targets)


def default_lora_targets(desc: ModelDesc, spec: JobSpec) -> tuple[tuple[str, ...] | str, bool]:
    """The targets of a spec that names none: (targets, assumed). `assumed` is True when
    neither the stack nor PEFT has a default for this model and Llama's q_proj/v_proj stand
    in (PEFT itself would refuse the config)."""
    if spec.stack.framework in _ALL_LINEAR_DEFAULT:
        return ALL_LINEAR, False
    targets = peft_default_targets(desc.model_type)
    return (LLAMA_TARGETS, True) if targets is None else (targets, False)


def resolved_lora_targets(desc: ModelDesc, spec: JobSpec) -> tuple[str, ...] | str:
    """The spec's `lora.target_modules`, or its stack's default for this model."""
    targets = spec.lora.target_modules
    return default_lora_targets(desc, spec)[0] if targets is None else targets


def lora_targets(desc: ModelDesc, spec: JobSpec) -> tuple[list[ParamEntry], tuple[str, ...]]:
    """Linear weights LoRA wraps, and target names that matched nothing (memoized on the
    frozen ModelDesc and the targets, like param_set: validity and the ParamSet both ask)."""
    targets = resolved_lora_targets(desc, spec)
    fused = not per_expert_linears(spec)
    key = (id(desc), targets, fused)
    hit = _TARGETS.get(key)
    if hit is None or hit[0] is not desc:
        if len(_TARGETS) >= _CACHE_SIZE:
            _TARGETS.pop(next(iter(_TARGETS)))
        hit = _TARGETS[key] = (desc, _lora_targets(desc, targets, fused))
    return list(hit[1][0]), hit[1][1]


def _lora_targets(desc: ModelDesc, targets, fused: bool = True) -> tuple[tuple[ParamEntry, ...], tuple[str, ...]]:
    routers = _routers(desc) if fused else set()  # transformers 4.x: the router was an nn.Linear
    linears = [p for p in desc.params if is_linear(p) and p.name not in routers]
    if targets != ALL_LINEAR and ALL_LINEAR in targets:
        # ms-swift's `--target_modules all-linear lm_head`: its get_target_modules
        # (swift/pipelines/train/tuner.py) puts every linear's name in all-linear's place
        leaves = {p.module.rsplit(".", 1)[-1] for p in linears}
        targets = tuple(sorted(leaves - set(_HEADS) | set(targets) - {ALL_LINEAR}))
    moe = _moe_targets(desc, targets) if fused else None
    if moe is not None:  # PEFT moves the expert and router names onto parameters (moe_lora.py)
        names, params = moe
        plain = {id(p) for p in linears}
        hit = tuple(p for p in desc.params if moe_lora.wrapped(p.name, params)
                    or (id(p) in plain and any(_matches(p.module, t) for t in names)))
        unmatched = () if targets == ALL_LINEAR else tuple(
            t for t in targets if t in names and not any(_matches(p.module, t) for p in linears))
        return hit, unmatched
    if targets == ALL_LINEAR:
        return tuple(p for p in linears if p.module.rsplit(".", 1)[-1] not in _HEADS), ()
    hit = tuple(p for p in linears if any(_matches(p.module, t) for t in targets))
    unmatched = tuple(t for t in targets if not any(_matches(p.module, t) for p in linears))
    return hit, unmatched


def _routers(desc: ModelDesc) -> set[str]:
    """The routers of transformers 5's fused-expert blocks: their own nn.Module holding a weight
    (Qwen2MoeTopKRouter, MixtralTopKRouter, DeepseekV3TopkRouter, JambaTopKRouter ...), not an
    nn.Linear, so PEFT's all-linear and module targets pass them by; Llama 4's router subclasses
    nn.Linear (models/llama4/modeling_llama4.py Llama4Router)."""
    if desc.model_type.startswith("llama4"):
        return set()
    blocks = {p.name.split(".experts.", 1)[0] for p in desc.params if is_fused_experts(p)}
    return {p.name for p in desc.params if p.module.rsplit(".", 1)[0] in blocks
            and p.module.rsplit(".", 1)[-1] in ("gate", "router")}


def _moe_targets(desc: ModelDesc, targets) -> tuple[set[str], dict[str, int]] | None:
    """PEFT's rewrite of the targets for transformers 5's fused experts (components/moe_lora.py):
    all-linear resolved to leaf names first (`_resolve_string_target_modules`), as PEFT does."""
    if not any(is_fused_experts(p) for p in desc.params):
        return None
    if targets == ALL_LINEAR:
        routers = _routers(desc)
        names = {p.module.rsplit(".", 1)[-1] for p in desc.params if is_linear(p) and p.name not in routers
                 and p.module.rsplit(".", 1)[-1] not in _HEADS} | moe_lora.expert_names(desc.model_type)
    else:
        names = set(targets)
    return moe_lora.convert_targets(desc.model_type, names)


def _freeze_trainable(desc: ModelDesc, spec: JobSpec, p: ParamEntry) -> bool:
    cfg = spec.freeze
    layers = {i % desc.num_layers for i in cfg.trainable_layers}
    return (p.layer is not None and p.layer in layers) or any(m in p.name for m in cfg.trainable_modules)


_CACHE: dict[tuple, tuple[ModelDesc, ParamSet]] = {}
_CACHE_SIZE = 64


def param_set(desc: ModelDesc, spec: JobSpec) -> ParamSet:
    """Memoized on the model and the spec fields that decide it (a search re-estimates the
    same model under many layouts); ParamSet is immutable, so sharing it is safe."""
    key = (id(desc), spec.task, spec.method, spec.lora, spec.quantization, spec.freeze, dtypes_of(spec))
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is desc:
        return hit[1]
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    result = _param_set(desc, spec)
    _CACHE[key] = (desc, result)
    return result


def _param_set(desc: ModelDesc, spec: JobSpec) -> ParamSet:
    wdtype = dtypes_of(spec).weights
    if spec.task.value == "inference":
        q = spec.quantization
        return ParamSet(tuple(
            HeldParam(p.name, p.shape, code_dtype(q) if is_quantized(spec, p) else wdtype,
                      False, "base", p.layer) for p in desc.params))
    if spec.method in (Method.FULL, Method.FREEZE):
        full = spec.method is Method.FULL
        # the trained parameters of a frozen-in-part model upcast to fp32 (LLaMA-Factory)
        tdtype = "fp32" if upcasts_trainable(spec) else wdtype
        held = []
        for p in desc.params:
            trains = full or _freeze_trainable(desc, spec, p)
            held.append(HeldParam(p.name, p.shape, tdtype if trains and not full else wdtype, trains, "base", p.layer))
        return ParamSet(tuple(held))
    return _lora_set(desc, spec, wdtype)


def _lora_set(desc: ModelDesc, spec: JobSpec, wdtype: str) -> ParamSet:
    targets, unmatched = lora_targets(desc, spec)
    target_names = {p.name for p in targets}
    # transformers 4.x (stack.transformers) built an nn.Linear per expert: no rewrite there
    moe = _moe_targets(desc, resolved_lora_targets(desc, spec)) if not per_expert_linears(spec) else None
    if moe is not None and moe[1]:
        moe_lora.check_wrapper_options(spec.lora)
    held: list[HeldParam] = []
    qlora = spec.method is Method.QLORA
    adapter_dtype = _adapter_dtype(spec)
    for p in desc.params:
        quantized = qlora and is_quantized(spec, p)
        dtype = code_dtype(spec.quantization) if quantized else wdtype
        if qlora and not quantized:
            # what the stack's QLoRA preparation makes of the rest (qlora_prep.py)
            dtype = qlora_prep.rest_dtype(spec, p.module, wdtype)
        held.append(HeldParam(p.name, p.shape, dtype, False, "base", p.layer))
        mult = moe_lora.wrapped(p.name, moe[1]) if moe else 0
        if mult:
            # lora.ParamWrapper: lora_A Linear(in, r * E), lora_B Linear(r * E, out), the rank
            # times the names fused into the parameter (PEFT's rank_pattern)
            fan_in, fan_out, experts = moe_lora.in_out_experts(p.shape)
            rank = spec.lora.r * mult * experts
            held.append(HeldParam(p.name + ".lora_A", (rank, fan_in), adapter_dtype, True, "lora", p.layer))
            held.append(HeldParam(p.name + ".lora_B", (fan_out, rank), adapter_dtype, True, "lora", p.layer))
        elif p.name in target_names:
            fan_in, fan_out = linear_in_out(desc, p)
            held.append(HeldParam(p.module + ".lora_A", (spec.lora.r, fan_in), adapter_dtype, True, "lora", p.layer))
            held.append(HeldParam(p.module + ".lora_B", (fan_out, spec.lora.r), adapter_dtype, True, "lora", p.layer))
            if spec.lora.use_dora:
                # DoRA's magnitude vector, one per output row, cast with the adapters
                # (peft/tuners/lora/dora.py DoraLinearLayer.update_layer: nn.Parameter(weight_norm))
                magnitude = qlora_prep.magnitude_dtype(spec, adapter_dtype) if qlora else adapter_dtype
                held.append(HeldParam(p.module + ".lora_magnitude_vector", (fan_out,), magnitude, True, "lora",
                                      p.layer))
    saved, unmatched_save = _modules_to_save(desc, spec, wdtype)
    return ParamSet(tuple(held) + saved, unmatched + unmatched_save)


def _adapter_dtype(spec: JobSpec) -> str:
    # PEFT upcasts adapter weights of a 16-bit base to fp32 (LoraModel with the default
    # autocast_adapter_dtype=True: peft/tuners/tuners_utils.py `_cast_adapter_dtype`);
    # frameworks that cast the whole module (DeepSpeed, torchtune) do not (dtypes.py).
    # On a quantized base the stack's preparation decides (qlora_prep.py).
    dt = dtypes_of(spec)
    if spec.method is Method.QLORA:
        return qlora_prep.adapter_dtype(spec, dt.adapters)
    return dt.adapters


def is_quantized(spec: JobSpec, p: ParamEntry) -> bool:
    """Whether the quantizer replaced this weight's linear. bitsandbytes, HQQ and torchao
    (transformers' quantizers) convert every linear but the output head
    (`modules_to_not_convert`, get_keys_to_not_convert); GPTQ and AWQ quantize the decoder
    blocks' linears only (optimum/gptq/quantizer.py `block_name_to_quantize`; AutoAWQ
    quantizes each block's linears)."""
    q = spec.quantization
    if q is None or _is_head(p):
        return False
    if is_fused_experts(p):
        return per_expert_linears(spec) and not any(_matches(p.module, n) for n in q.modules_to_not_convert)
    if not is_linear(p):
        return False
    if q.type in (QuantType.GPTQ, QuantType.AWQ) and p.layer is None:
        return False
    return not any(_matches(p.module, name) for name in q.modules_to_not_convert)


def is_fused_experts(p: ParamEntry) -> bool:
    """transformers 5's MoE experts: one 3-D parameter (E, out, in) per projection
    (e.g. models/mixtral/modeling_mixtral.py MixtralExperts.gate_up_proj / down_proj)."""
    return len(p.shape) == 3 and ".experts." in p.name


def per_expert_linears(spec: JobSpec) -> bool:
    """Whether the stack's transformers builds each expert as its own nn.Linear (4.x:
    MixtralBlockSparseTop2MLP w1/w2/w3, Qwen2MoeMLP per expert), which the bitsandbytes,
    HQQ and torchao quantizers replace like any linear; 5.x's fused 3-D expert parameters
    are not nn.Linear and stay in the load dtype."""
    major = spec.stack.major("transformers")
    return major is not None and major < 5


def _is_head(p: ParamEntry) -> bool:
    return p.module.rsplit(".", 1)[-1] in _HEADS


# A sequence classifier (a reward model too) trains under PEFT's SEQ_CLS PeftModel, the one
# that runs it (a CAUSAL_LM PeftModel calls `prepare_inputs_for_generation`, which the
# classifier lacks), and that adds its head to modules_to_save: peft/peft_model.py
# PeftModelForSequenceClassification.__init__ (`classifier_module_names = ["classifier",
# "score"]`, extended into `peft_config.modules_to_save`); a name that matches nothing is no error.
PEFT_CLASSIFIER_HEADS = ("classifier", "score")


def _modules_to_save(desc: ModelDesc, spec: JobSpec, wdtype: str):
    """PEFT's ModulesToSaveWrapper keeps the original frozen and trains a full copy."""
    names = spec.lora.modules_to_save
    copies, unmatched = [], []
    heads = ()
    if desc.num_labels and spec.stack.framework is not Framework.TORCHTUNE:
        heads = tuple(n for n in PEFT_CLASSIFIER_HEADS if n not in names)
    for name in names + heads:
        hit = [p for p in desc.params if _matches(p.module, name)]
        if not hit and name not in heads:
            unmatched.append(name)
        copies += [HeldParam(p.name + "#copy", p.shape,
                             qlora_prep.saved_copy_dtype(spec, p.module, wdtype) if spec.method is Method.QLORA
                             else wdtype, True, "saved_copy", p.layer) for p in hit]
    return tuple(copies), tuple(unmatched)


def grad_dtype(spec: JobSpec, p: HeldParam) -> str:
    """Gradients take the parameter's dtype (autograd accumulates into param.grad); under
    an fp32 master policy the parameters the model holds are the 16-bit ones."""
    dt = dtypes_of(spec)
    if dt.master_weights:
        return dt.gradients
    return p.dtype

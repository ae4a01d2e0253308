"""Nested sections of the job spec: LoRA, quantization, freezing, parallel layout."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from collections.abc import Mapping

from vramplan.spec.enums import QuantType, SpecError


MAX_COUNT = 2**53
"""Largest count a spec field takes (floats are exact up to here); far beyond any GPU."""


def _show(value: object) -> str:
    text = repr(value)
    kind = "" if isinstance(value, (int, float, str)) else f" (a {type(value).__name__})"
    return (text if len(text) <= 60 else text[:57] + "...") + kind


def string_keys(prefix: str, data: object) -> None:
    """The keys of a spec mapping are field names (strings)."""
    for key in data:
        if not isinstance(key, str):
            raise SpecError(f"{prefix}{key}", f"keys are field names, got {key!r} (a {type(key).__name__})")


def required_keys(section: str, cls, data: Mapping) -> None:
    """A section's fields without a default are given (else the dataclass raises TypeError)."""
    for f in dataclasses.fields(cls):
        if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SpecError(f"{section}.{f.name}", f"required in the {section} section; add {f.name}: <value>")


def did_you_mean(key: str, known, cutoff: float = 0.6) -> str:
    import difflib  # on a bad key only: not at every start
    hint = difflib.get_close_matches(key, list(known), n=1, cutoff=cutoff)
    return f"; did you mean {hint[0]!r}?" if hint else ""


MAX_GPUS = 1 << 20
"""The most GPUs a job may name: past any cluster built (the largest hold a few hundred
thousand); a count like 1e12 is a slip, and sharding over it would print a tiny number."""


def count_field(name: str, value: object) -> int:
    """A top-level count of the spec (micro_batch_size, num_gpus, ...): positive_int, and
    num_gpus at most MAX_GPUS."""
    number = positive_int(name, value)
    if name == "num_gpus" and number > MAX_GPUS:
        raise SpecError(name, f"{number:,} GPUs are past any cluster built; use at most {MAX_GPUS:,}")
    return number


def positive_int(name: str, value: object, *, minimum: int = 1, maximum: int = MAX_COUNT) -> int:
    """Accept ints (and integral floats/strings like '4'); anything else names the field."""
    want = f"expected an integer >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SpecError(name, f"{want}, got {_show(value)}")
    number = value
    if not isinstance(value, int):
        try:
            number = float(value)
        except ValueError:
            raise SpecError(name, f"{want}, got {_show(value)}") from None
        if not math.isfinite(number) or number != int(number):
            raise SpecError(name, f"{want}, got {_show(value)}")
        number = int(number)
    if number < minimum:
        raise SpecError(name, f"{want}, got {_show(value)}")
    if number > maximum:
        raise SpecError(name, f"{value!r} is too large (at most {maximum:,}); beyond any GPU")
    return number


def number(name: str, value: object, *, low: float = 0.0, high: float = 1.0) -> float:
    """A finite real number in [low, high]; booleans, strings of words and lists name the field."""
    want = f"expected a number in [{low:g}, {high:g}]"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SpecError(name, f"{want}, got {_show(value)}")
    try:
        result = float(value)
    except ValueError:
        raise SpecError(name, f"{want}, got {_show(value)}") from None
    if not math.isfinite(result) or not low <= result <= high:
        raise SpecError(name, f"{want}, got {_show(value)}")
    return result


fraction = number


def boolean(name: str, value: object) -> bool:
    """Only a real true/false: YAML's quoted 'no' or JSON's "false" is a string, and a
    string is true to Python, so it is refused instead of being read the wrong way."""
    if isinstance(value, bool):
        return value
    hint = " (a string; write true or false without quotes)" if isinstance(value, str) else ""
    raise SpecError(name, f"expected true or false, got {_show(value)}{hint}")


def string_list(name: str, value: object) -> tuple[str, ...]:
    """Module names. An empty name is refused: a slip that the libraries read as a
    substring of every name (`"" in key`: freeze trains every parameter, bitsandbytes'
    modules_to_not_convert converts nothing, a GaLore list projects every linear)."""
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise SpecError(name, f"expected a list of module names, got {_show(value)}")
    if any(not v.strip() for v in value):
        raise SpecError(name, "holds an empty name; drop it, or name modules (e.g. q_proj, lm_head)")
    return tuple(value)


def choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """One of `choices` (case and _/- insensitive)."""
    text = value.strip().lower().replace("_", "-") if isinstance(value, str) else None
    if text not in choices:
        raise SpecError(name, f"expected one of {', '.join(choices)}, got {_show(value)}")
    return text


ALL_LINEAR = "all-linear"


def module_targets(name: str, value: object) -> tuple[str, ...] | str:
    """A target_modules field: "all-linear" (any spelling) or names, all-linear among them or not."""
    if isinstance(value, str) and value.replace("_", "-").lower() == ALL_LINEAR:
        return ALL_LINEAR
    targets = string_list(name, value)
    if not targets:
        raise SpecError(name, "is empty; name modules or use 'all-linear'")
    return tuple(ALL_LINEAR if t.replace("_", "-").lower() == ALL_LINEAR else t for t in targets)


FSDP_MODES = ("none", "full-shard", "shard-grad-op", "hybrid-shard", "no-shard")
PP_SCHEDULES = ("1f1b", "interleaved", "gpipe", "all-forward-all-backward")
"""Schedules vramplan.parallel.activations.pipeline_in_flight models."""


# Per quantization type: the bit widths its library stores, its default group size (None:
# the type has no groups), its kernels (the first is the default) and those with a backward.
_QUANT_FACTS = {
    # bitsandbytes Linear4bit / Linear8bitLt: one kernel family, blocks of `block_size`.
    QuantType.NF4: ((4,), None, ("bitsandbytes",), ("bitsandbytes",)),
    QuantType.FP4: ((4,), None, ("bitsandbytes",), ("bitsandbytes",)),
    QuantType.INT8: ((8,), None, ("bitsandbytes",), ("bitsandbytes",)),
    # transformers GPTQConfig (group_size=128); GPTQModel's kernels, of which TorchLinear and
    # the Triton kernel train (SUPPORTS_TRAINING), exllama/exllamav2/marlin do not.
    QuantType.GPTQ: ((2, 3, 4, 8), 128, ("torch", "triton", "exllama", "exllamav2", "marlin"), ("torch", "triton")),
    # transformers AwqConfig (bits 4, group_size 128); GPTQModel AwqGEMMLinear (CUDA) and
    # AwqTorchLinear (qlinear/torch_awq.py, the same layout in plain torch) train.
    QuantType.AWQ: ((4,), 128, ("gemm", "gemv", "marlin", "torch"), ("gemm", "torch")),
    # transformers HqqConfig (nbits 4, group_size 64); hqq's nbits 8, 4, 3, 2, 1.
    QuantType.HQQ: ((1, 2, 3, 4, 8), 64, ("hqq",), ("hqq",)),
    QuantType.TORCHAO_INT8: ((8,), None, ("torchao",), ("torchao",)),
    QuantType.TORCHAO_FP8: ((8,), None, ("torchao",), ("torchao",)),
    # torchao Int4WeightOnlyConfig(group_size=128); tinygemm takes 32, 64, 128 or 256. PEFT
    # refuses LoRA on it (peft/tuners/lora/torchao.py: "only supports int8 weights for now").
    QuantType.TORCHAO_INT4: ((4,), 128, ("torchao",), ()),
}


BNB_BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""bitsandbytes 0.50 quantize_4bit's block sizes (functional.py)."""
_GPTQ_TORCH = (-1, 16, 32, 64, 128, 256, 512, 1024)
_SMALL = (-1, 32, 64, 128)
GPTQMODEL_GROUP_SIZES = {
    # GPTQModel 7.7 SUPPORTS_GROUP_SIZE: qlinear/torch.py, tritonv2.py, exllamav2.py, marlin.py,
    # gemm_awq.py, gemv_awq.py, marlin_awq.py, torch_awq.py (exllama v1 is not listed: unchecked)
    (QuantType.GPTQ, "torch"): _GPTQ_TORCH, (QuantType.GPTQ, "triton"): _GPTQ_TORCH,
    (QuantType.GPTQ, "exllamav2"): _SMALL, (QuantType.GPTQ, "marlin"): _SMALL,
    (QuantType.AWQ, "gemm"): (-1, 16, 32, 64, 128), (QuantType.AWQ, "gemv"): (-1, 64, 128),
    (QuantType.AWQ, "marlin"): _SMALL, (QuantType.AWQ, "torch"): (-1, 16, 32, 64, 128),
}


# Quantized bases whose training step runs on CPU (bitsandbytes >= 0.49's CPU backend, GPTQModel's
# TorchLinear and AwqTorchLinear, torchao's int8/fp8 weight-only tensors, hqq's PYTORCH
# backend): measurable there.
_CPU_QUANT = (QuantType.NF4, QuantType.FP4, QuantType.INT8, QuantType.GPTQ, QuantType.AWQ, QuantType.HQQ,
              QuantType.TORCHAO_INT8, QuantType.TORCHAO_FP8)


def check_cpu_quant(q: "QuantConfig") -> None:
    """Raise SpecError unless `q`'s kernels run on CPU."""
    if q.type not in _CPU_QUANT:
        raise SpecError("backend", f"{q.type.value} kernels are modelled on cuda only; "
                        f"on cpu: {', '.join(t.value for t in _CPU_QUANT)}")
    if q.type is QuantType.AWQ and q.kernel != "torch":
        # GPTQModel's AwqGEMMLinear (gemm_awq.py) runs CUDA kernels; AwqTorchLinear runs anywhere.
        raise SpecError("quantization.kernel", f"awq's {q.kernel} kernel needs CUDA; on cpu set kernel: torch")


def quant_facts(qtype: QuantType) -> tuple[tuple[int, ...], int | None, tuple[str, ...], tuple[str, ...]]:
    """(bit widths, default group size, kernels, kernels that train) of a quantization type."""
    return _QUANT_FACTS[qtype]


QLORA_PREPARATIONS = ("auto", "peft", "peft-bf16", "peft-restored", "bf16-trainable", "norms-fp32", "unprepared", "none")
"""quantization.prepare's words (components/qlora_prep.py Prep)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class QuantConfig:
    """How the frozen base weights are quantized (QLoRA and quantized inference)."""

    type: QuantType = QuantType.NF4
    bits: int | None = None
    """Bits per weight; the type's only width when it has one (nf4 4, int8 8)."""
    double_quant: bool = True
    """bitsandbytes 4-bit: quantize the fp32 absmax constants to 8 bits (Dettmers et al. 2023, section 3)."""
    compute_dtype: str = "bf16"
    block_size: int = 64
    """bitsandbytes: elements per absmax block; its default for 4-bit weights is 64."""
    group_size: int | None = None
    """GPTQ/AWQ/HQQ/torchao-int4: input features per scale (-1: one group per row, GPTQ only);
    default the library's (128, 128, 64, 128)."""
    desc_act: bool = False
    """GPTQ act-order: g_idx permutes the groups (storage is the same)."""
    kernel: str | None = None
    """GPTQ: torch (default, GPTQModel TorchLinear), triton, exllama, exllamav2, marlin; AWQ:
    gemm (default), gemv, marlin. Decides the dequantization transients (components/quant.py)."""
    modules_to_not_convert: tuple[str, ...] = ()
    """Linear modules kept unquantized besides the library's own (lm_head; GPTQ/AWQ quantize
    only the decoder layers), as in a quantization_config's `modules_to_not_convert`."""
    prepare: str = "auto"
    """What prepares the quantized base for adapter training (components/qlora_prep.py): `peft`
    (prepare_model_for_kbit_training: the rest in fp32), `peft-bf16` (TRL < 0.26: that, then
    embeddings and head back to bf16 under bf16), `peft-restored` (axolotl: norms and embeddings
    back), `bf16-trainable` (TRL 0.26+), `norms-fp32` (LLaMA-Factory's upcast_layernorm),
    `unprepared` (TRL < 0.26 sharded), `none` (torchtune, litgpt, LLaMA-Factory), or `auto`."""

    def __post_init__(self):
        if self.prepare not in QLORA_PREPARATIONS:
            raise SpecError("quantization.prepare", f"choose one of {', '.join(QLORA_PREPARATIONS)}; "
                            f"got {_show(self.prepare)}")
        qtype = QuantType.parse(self.type, "quantization.type")
        object.__setattr__(self, "type", qtype)
        widths, group, kernels, _ = _QUANT_FACTS[qtype]
        bits = widths[0] if self.bits is None and len(widths) == 1 else self.bits
        if bits is None and qtype in (QuantType.GPTQ, QuantType.HQQ):
            bits = 4
        if isinstance(bits, bool) or bits not in widths:
            fix = ("use nf4/fp4 with 4 bits and int8 with 8 bits" if qtype.is_bitsandbytes
                   else f"{qtype.value} stores {', '.join(map(str, widths))} bits")
            # A width no bitsandbytes type stores (3, true) is the bits' fault; 4 or 8 with the
            # other bitsandbytes type is the type's.
            blame_type = qtype.is_bitsandbytes and not isinstance(bits, bool) and bits in (4, 8)
            raise SpecError("quantization.type" if blame_type else "quantization.bits",
                            f"{qtype.value} does not go with bits={_show(bits)}; {fix}")
        object.__setattr__(self, "bits", bits)
        object.__setattr__(self, "double_quant", boolean("quantization.double_quant", self.double_quant))
        object.__setattr__(self, "desc_act", boolean("quantization.desc_act", self.desc_act))
        if self.desc_act and qtype is not QuantType.GPTQ:
            raise SpecError("quantization.desc_act", f"is a GPTQ setting; {qtype.value} has no act-order")
        if not isinstance(self.compute_dtype, str) or self.compute_dtype not in ("bf16", "fp16", "fp32"):
            raise SpecError("quantization.compute_dtype", "choose bf16, fp16 or fp32")
        object.__setattr__(self, "block_size", positive_int("quantization.block_size", self.block_size))
        if qtype in (QuantType.NF4, QuantType.FP4) and self.block_size not in BNB_BLOCK_SIZES:
            # bitsandbytes/functional.py quantize_4bit: ValueError(f"invalid blocksize {blocksize}")
            raise SpecError("quantization.block_size", f"bitsandbytes quantizes 4-bit weights in blocks of "
                            f"{', '.join(map(str, BNB_BLOCK_SIZES))}; got {self.block_size} (the default is 64)")
        object.__setattr__(self, "group_size", self._group(qtype, group))
        kernel = kernels[0] if self.kernel is None else str(self.kernel).strip().lower()
        if kernel not in kernels:
            raise SpecError("quantization.kernel", f"{qtype.value} runs on {', '.join(kernels)}; got {_show(self.kernel)}")
        object.__setattr__(self, "kernel", kernel)
        sizes = GPTQMODEL_GROUP_SIZES.get((qtype, kernel))
        if sizes and self.group_size not in sizes:
            # gptqmodel/nn_modules/qlinear: each QuantLinear's SUPPORTS_GROUP_SIZE, checked in
            # validate() ("only supports [...] group_size") when the model is loaded
            raise SpecError("quantization.group_size", f"GPTQModel's {kernel} kernel for {qtype.value} takes "
                            f"group_size {', '.join(map(str, sizes))}; got {self.group_size}")
        object.__setattr__(self, "modules_to_not_convert",
                           string_list("quantization.modules_to_not_convert", self.modules_to_not_convert))

    def _group(self, qtype: QuantType, default: int | None) -> int | None:
        if default is None:
            if self.group_size is not None:
                raise SpecError("quantization.group_size", f"{qtype.value} has no groups; drop group_size "
                                "(bitsandbytes blocks are block_size)")
            return None
        if self.group_size is None:
            return default
        if self.group_size == -1 and qtype is QuantType.GPTQ:
            return -1
        group = positive_int("quantization.group_size", self.group_size)
        if qtype is QuantType.TORCHAO_INT4 and group not in (32, 64, 128, 256):
            raise SpecError("quantization.group_size", f"torchao int4 (tinygemm) takes 32, 64, 128 or 256, got {group}")
        return group

    def to_dict(self) -> dict:
        out = {"type": self.type.value, "bits": self.bits, "compute_dtype": self.compute_dtype}
        if self.type in (QuantType.NF4, QuantType.FP4):
            out.update(double_quant=self.double_quant, block_size=self.block_size)
        if self.group_size is not None:
            out["group_size"] = self.group_size
        if self.type is QuantType.GPTQ:
            out["desc_act"] = self.desc_act
        out["kernel"] = self.kernel
        if self.modules_to_not_convert:
            out["modules_to_not_convert"] = list(self.modules_to_not_convert)
        if self.prepare != "auto":
            out["prepare"] = self.prepare
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class FreezeConfig:
    """Which parts stay trainable under `method: freeze`."""

    trainable_layers: tuple[int, ...] = ()
    """Layer indices trained; negative counts from the end (-1 is the last layer)."""
    trainable_modules: tuple[str, ...] = ()
    """Parameter-name substrings trained in addition (e.g. 'lm_head', 'embed_tokens', 'norm')."""

    def __post_init__(self):
        layers = self.trainable_layers
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = (layers,)
        if not isinstance(layers, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise SpecError("freeze.trainable_layers", f"expected a list of layer indices, got {layers!r}")
        object.__setattr__(self, "trainable_layers", tuple(layers))
        object.__setattr__(self, "trainable_modules",
                           string_list("freeze.trainable_modules", self.trainable_modules))

    def to_dict(self) -> dict:
        return {"trainable_layers": list(self.trainable_layers),
                "trainable_modules": list(self.trainable_modules)}


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """Parallel layout. Data parallelism is what the other axes leave of `num_gpus`."""

    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3."""
    fsdp: str = "none"
    """none | full-shard | shard-grad-op | hybrid-shard | no-shard."""
    fsdp_version: int = 2
    tp: int = 1
    sp: bool = False
    """Megatron sequence parallelism alongside tp."""
    cp: int = 1
    ulysses: int = 1
    """DeepSpeed Ulysses sequence parallelism (ALST; ms-swift `sequence_parallel_size`): the
    sequence is split over `ulysses` ranks and attention heads are exchanged all-to-all."""
    pp: int = 1
    pp_schedule: str = "1f1b"
    ep: int = 1
    offload_optimizer: str = "none"
    """none | cpu | nvme."""
    offload_params: str = "none"
    extras: dict = field(default_factory=dict)
    """Engine settings read from config files (bucket sizes, prefetch, ...)."""

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass)
        set_("zero_stage", positive_int("parallel.zero_stage", self.zero_stage, minimum=0))
        if self.zero_stage > 3:
            raise SpecError("parallel.zero_stage", f"must be 0, 1, 2 or 3, got {self.zero_stage}")
        for name in ("tp", "cp", "ulysses", "pp", "ep"):
            set_(name, positive_int(f"parallel.{name}", getattr(self, name)))
        set_("fsdp", choice("parallel.fsdp", self.fsdp, FSDP_MODES))
        set_("fsdp_version", positive_int("parallel.fsdp_version", self.fsdp_version))
        if self.fsdp_version not in (1, 2):
            raise SpecError("parallel.fsdp_version", f"must be 1 (FullyShardedDataParallel) or 2 "
                            f"(fully_shard), got {self.fsdp_version}")
        set_("sp", boolean("parallel.sp", self.sp))
        set_("pp_schedule", choice("parallel.pp_schedule", self.pp_schedule, PP_SCHEDULES))
        for name in ("offload_optimizer", "offload_params"):
            set_(name, choice(f"parallel.{name}", getattr(self, name), ("none", "cpu", "nvme")))
        if self.zero_stage and self.fsdp != "none":
            raise SpecError("parallel.fsdp", "ZeRO and FSDP are alternatives; set one of zero_stage or fsdp")
        if self.zero_stage >= 2 and self.pp > 1:
            # deepspeed/runtime/pipe/engine.py PipelineEngine.__init__ asserts
            # zero_optimization_stage() < ZeroStageEnum.gradients.
            raise SpecError("parallel.zero_stage", f"ZeRO-{self.zero_stage} cannot run with pipeline "
                            "parallelism (DeepSpeed allows ZeRO-1 with pp); use zero_stage 1 or pp 1")
        from vramplan.spec.extras import check_extras  # it reads positive_int and friends from here
        set_("extras", check_extras(self.extras))

    @property
    def model_parallel(self) -> int:
        return self.tp * self.cp * self.pp * self.ulysses

    @property
    def is_trivial(self) -> bool:
        return (self.zero_stage == 0 and self.fsdp == "none" and self.model_parallel == 1
                and self.ep == 1 and self.offload_optimizer == "none" and self.offload_params == "none")

    def to_dict(self) -> dict:
        return {"zero_stage": self.zero_stage, "fsdp": self.fsdp, "fsdp_version": self.fsdp_version,
                "tp": self.tp, "sp": self.sp, "cp": self.cp, "ulysses": self.ulysses, "pp": self.pp,
                "pp_schedule": self.pp_schedule, "ep": self.ep,
                "offload_optimizer": self.offload_optimizer, "offload_params": self.offload_params,
                **({"extras": dict(self.extras)} if self.extras else {})}

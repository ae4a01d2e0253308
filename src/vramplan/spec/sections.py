"""Nested sections of the job spec: LoRA, quantization, freezing, parallel layout."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vramplan.spec.enums import QuantType, SpecError


def positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    """Accept ints (and integral floats/strings like '4'); anything else names the field."""
    if isinstance(value, bool):
        raise SpecError(name, f"expected an integer >= {minimum}, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise SpecError(name, f"expected an integer >= {minimum}, got {value!r}") from None
    if number != int(number) or number < minimum:
        raise SpecError(name, f"expected an integer >= {minimum}, got {value!r}")
    return int(number)


def fraction(name: str, value: Any, *, low: float = 0.0, high: float = 1.0) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise SpecError(name, f"expected a number in [{low}, {high}], got {value!r}") from None
    if not low <= number <= high:
        raise SpecError(name, f"expected a number in [{low}, {high}], got {value!r}")
    return number


def string_list(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise SpecError(name, f"expected a list of module names, got {value!r}")


ALL_LINEAR = "all-linear"


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraConfig:
    """PEFT LoraConfig fields that change memory."""

    r: int = 8
    """Adapter rank: A is (r, in), B is (out, r) per targeted linear."""
    alpha: float = 16.0
    """Scaling numerator (alpha / r); no memory effect, kept for round-tripping."""
    dropout: float = 0.0
    """lora_dropout; > 0 saves a dropout mask and a dropped copy of each adapter input."""
    target_modules: tuple[str, ...] | str = ("q_proj", "v_proj")
    """Module name suffixes (PEFT matching) or "all-linear" (every linear but the output head).
    Default is PEFT's default for Llama-family models."""
    modules_to_save: tuple[str, ...] = ()
    """Modules trained in full beside the adapters (PEFT keeps a trainable copy of each)."""

    def __post_init__(self):
        object.__setattr__(self, "r", positive_int("lora.r", self.r))
        object.__setattr__(self, "dropout", fraction("lora.dropout", self.dropout, high=0.999))
        targets = self.target_modules
        if isinstance(targets, str) and targets.replace("_", "-").lower() == ALL_LINEAR:
            targets = ALL_LINEAR
        else:
            targets = string_list("lora.target_modules", targets)
            if not targets:
                raise SpecError("lora.target_modules", "is empty; name modules or use 'all-linear'")
        object.__setattr__(self, "target_modules", targets)
        object.__setattr__(self, "modules_to_save", string_list("lora.modules_to_save", self.modules_to_save))

    def to_dict(self) -> dict:
        targets = self.target_modules
        return {"r": self.r, "alpha": self.alpha, "dropout": self.dropout,
                "target_modules": targets if isinstance(targets, str) else list(targets),
                "modules_to_save": list(self.modules_to_save)}


@dataclass(frozen=True, kw_only=True, slots=True)
class QuantConfig:
    """bitsandbytes quantization of the frozen base weights (QLoRA)."""

    bits: int = 4
    type: QuantType = QuantType.NF4
    double_quant: bool = True
    """Quantize the fp32 absmax constants to 8 bits (Dettmers et al. 2023, section 3)."""
    compute_dtype: str = "bf16"
    block_size: int = 64
    """Elements per absmax block; bitsandbytes' default for 4-bit weights is 64."""

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise SpecError("quantization.bits", f"must be 4 or 8, got {self.bits!r}")
        qtype = QuantType.parse(self.type, "quantization.type")
        if (self.bits == 8) != (qtype is QuantType.INT8):
            raise SpecError("quantization.type", f"{qtype.value} does not go with bits={self.bits}; "
                            "use nf4/fp4 with 4 bits and int8 with 8 bits")
        object.__setattr__(self, "type", qtype)
        if self.compute_dtype not in ("bf16", "fp16", "fp32"):
            raise SpecError("quantization.compute_dtype", "choose bf16, fp16 or fp32")
        object.__setattr__(self, "block_size", positive_int("quantization.block_size", self.block_size))

    def to_dict(self) -> dict:
        return {"bits": self.bits, "type": self.type.value, "double_quant": self.double_quant,
                "compute_dtype": self.compute_dtype, "block_size": self.block_size}


@dataclass(frozen=True, kw_only=True, slots=True)
class FreezeConfig:
    """Which parts stay trainable under `method: freeze`."""

    trainable_layers: tuple[int, ...] = ()
    """Layer indices trained; negative counts from the end (-1 is the last layer)."""
    trainable_modules: tuple[str, ...] = ()
    """Parameter-name substrings trained in addition (e.g. 'lm_head', 'embed_tokens', 'norm')."""

    def __post_init__(self):
        layers = self.trainable_layers
        if isinstance(layers, int):
            layers = (layers,)
        if not isinstance(layers, (list, tuple)) or not all(isinstance(i, int) for i in layers):
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
    pp: int = 1
    pp_schedule: str = "1f1b"
    ep: int = 1
    offload_optimizer: str = "none"
    """none | cpu | nvme."""
    offload_params: str = "none"
    extras: dict = field(default_factory=dict)
    """Engine settings read from config files (bucket sizes, prefetch, ...)."""

    def __post_init__(self):
        if self.zero_stage not in (0, 1, 2, 3):
            raise SpecError("parallel.zero_stage", f"must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        for name in ("tp", "cp", "pp", "ep"):
            object.__setattr__(self, name, positive_int(f"parallel.{name}", getattr(self, name)))
        fsdp = str(self.fsdp).lower().replace("_", "-")
        if fsdp not in ("none", "full-shard", "shard-grad-op", "hybrid-shard", "no-shard"):
            raise SpecError("parallel.fsdp", "choose none, full-shard, shard-grad-op, hybrid-shard or no-shard")
        object.__setattr__(self, "fsdp", fsdp)
        for name in ("offload_optimizer", "offload_params"):
            if getattr(self, name) not in ("none", "cpu", "nvme"):
                raise SpecError(f"parallel.{name}", "choose none, cpu or nvme")
        if self.zero_stage and fsdp != "none":
            raise SpecError("parallel.fsdp", "ZeRO and FSDP are alternatives; set one of zero_stage or fsdp")

    @property
    def model_parallel(self) -> int:
        return self.tp * self.cp * self.pp

    @property
    def is_trivial(self) -> bool:
        return (self.zero_stage == 0 and self.fsdp == "none" and self.model_parallel == 1
                and self.ep == 1 and self.offload_optimizer == "none" and self.offload_params == "none")

    def to_dict(self) -> dict:
        return {"zero_stage": self.zero_stage, "fsdp": self.fsdp, "fsdp_version": self.fsdp_version,
                "tp": self.tp, "sp": self.sp, "cp": self.cp, "pp": self.pp,
                "pp_schedule": self.pp_schedule, "ep": self.ep,
                "offload_optimizer": self.offload_optimizer, "offload_params": self.offload_params,
                **({"extras": dict(self.extras)} if self.extras else {})}

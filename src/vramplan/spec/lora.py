"""The spec's lora section: PEFT's LoraConfig fields, and the combinations PEFT refuses."""
from __future__ import annotations

from dataclasses import dataclass

from vramplan.spec.enums import QuantType, SpecError
from vramplan.spec.sections import boolean, fraction, module_targets, number, positive_int, string_list


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraConfig:
    """PEFT LoraConfig fields that change memory."""

    r: int = 8
    """Adapter rank: A is (r, in), B is (out, r) per targeted linear."""
    alpha: float = 16.0
    """Scaling numerator (alpha / r); no memory effect, kept for round-tripping."""
    dropout: float = 0.0
    """lora_dropout; > 0 saves a dropout mask and a dropped copy of each adapter input."""
    target_modules: tuple[str, ...] | str | None = None
    """Module name suffixes (PEFT matching) or "all-linear" (every linear but the output head).
    None (the default): the stack's default, resolved per model in
    `components.trainable.default_lora_targets` (PEFT's own per model type; all-linear
    under LLaMA-Factory and ms-swift)."""
    modules_to_save: tuple[str, ...] = ()
    """Modules trained in full beside the adapters (PEFT keeps a trainable copy of each)."""
    use_dora: bool = False
    """DoRA (Liu et al. 2024, arXiv 2402.09353; PEFT `use_dora`): a trained magnitude vector per
    adapted linear and a re-normalised output (components/dora.py models what it holds)."""
    use_rslora: bool = False
    """rsLoRA (Kalajdzievski 2023, arXiv 2312.03732; PEFT `use_rslora`): scaling alpha/sqrt(r)
    instead of alpha/r; no memory effect, kept for round-tripping."""

    def __post_init__(self):
        object.__setattr__(self, "r", positive_int("lora.r", self.r))
        object.__setattr__(self, "use_dora", boolean("lora.use_dora", self.use_dora))
        object.__setattr__(self, "use_rslora", boolean("lora.use_rslora", self.use_rslora))
        object.__setattr__(self, "alpha", number("lora.alpha", self.alpha, high=1e6))
        object.__setattr__(self, "dropout", fraction("lora.dropout", self.dropout, high=0.999))
        if isinstance(self.target_modules, str) and any(c in self.target_modules for c in ".*+?[](){}|^$\\"):
            # PEFT fullmatches a string against each module's full name (a regex); it was read as
            # one module name and refused as "match no module"
            raise SpecError("lora.target_modules", f"{self.target_modules!r} is a regex, which PEFT matches against "
                            "full module names and vramplan does not model; list the module names it matches "
                            "(e.g. [q_proj, v_proj]) or use all-linear")
        if self.target_modules is not None:
            object.__setattr__(self, "target_modules", module_targets("lora.target_modules", self.target_modules))
        object.__setattr__(self, "modules_to_save", string_list("lora.modules_to_save", self.modules_to_save))

    def to_dict(self) -> dict:
        targets = self.target_modules
        return {"r": self.r, "alpha": self.alpha, "dropout": self.dropout,
                "target_modules": targets if targets is None or isinstance(targets, str) else list(targets),
                "modules_to_save": list(self.modules_to_save),
                **({"use_dora": True} if self.use_dora else {}),
                **({"use_rslora": True} if self.use_rslora else {})}


def check_dora(lora: LoraConfig | None, quantization, framework: str, task: str) -> None:
    """DoRA where PEFT refuses it, or where it is not modelled (a framework's own DoRA, the
    diffusion denoisers' adapters)."""
    if lora is None or not lora.use_dora:
        return
    if task == "diffusion":
        raise SpecError("lora.use_dora", "DoRA is modelled on language models' linears (components/dora.py), "
                        "not on diffusion denoisers; set use_dora false")
    if quantization is not None and quantization.type in (QuantType.GPTQ, QuantType.AWQ):
        # peft/tuners/lora/gptq.py GPTQLoraLinear and awq.py AwqLoraLinear __init__:
        # "does not support DoRA yet, please set it to False"
        raise SpecError("lora.use_dora", f"PEFT's LoRA layer for {quantization.type.value} weights refuses DoRA "
                        "(peft/tuners/lora/gptq.py, awq.py); set use_dora false or quantize with "
                        "nf4, int8, hqq or torchao-int8")
    if framework == "torchtune":
        raise SpecError("lora.use_dora", "torchtune's own DoRALinear is not modelled (vramplan models "
                        "PEFT's DoRA); set use_dora false or use a PEFT-based stack")

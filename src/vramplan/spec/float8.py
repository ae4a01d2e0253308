"""The `float8` section: float8 training of the linear layers as torchao does it
(`torchao.float8.convert_to_float8_training`, torchao/float8/float8_linear.py), and the
`neftune_noise_alpha` check (a number, one idea with it: what the trainer adds to a step
without changing what autograd saves)."""
from __future__ import annotations

from dataclasses import dataclass

from vramplan.spec.enums import SpecError, _Choice
from vramplan.spec.sections import boolean, number


class Float8Recipe(_Choice):
    TENSORWISE = "tensorwise"
    """torchao's default: one dynamic scale per tensor for input, weight and gradient; every
    operand of the three matmuls is cast to float8 (e4m3, gradients e5m2)."""
    ROWWISE = "rowwise"
    """One scale per row (axiswise), e4m3 for all three, scales rounded to powers of two;
    every operand of the three matmuls is cast."""
    ROWWISE_WITH_GW_HP = "rowwise-with-gw-hp"
    """rowwise, but the weight gradient is computed in high precision: its two operands
    (the saved input and the output gradient) are not cast."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Float8Config:
    """torchao float8 training (`convert_to_float8_training(model, config=
    Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=...)`): each converted
    nn.Linear becomes a Float8Linear whose weight stays in its dtype (the optimizer and its
    states are unchanged) and whose matmuls cast their operands to float8 on the fly."""

    recipe: Float8Recipe = Float8Recipe.TENSORWISE
    """tensorwise | rowwise | rowwise-with-gw-hp (Float8LinearRecipeName)."""
    convert_lm_head: bool = False
    """Convert the output projection too. torchtitan's default `filter_fqns: ["output"]` and
    accelerate's `filter_first_and_last_linear_layers` leave it in high precision; a bare
    `convert_to_float8_training(model)` converts it."""
    fsdp_float8_all_gather: bool = False
    """Float8LinearConfig.enable_fsdp_float8_all_gather: FSDP2 all-gathers the converted
    weights already cast to float8 (torchao/float8/fsdp_utils.py
    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather), one byte per element."""

    def __post_init__(self):
        object.__setattr__(self, "recipe", Float8Recipe.parse(self.recipe, "float8.recipe"))
        for name in ("convert_lm_head", "fsdp_float8_all_gather"):
            object.__setattr__(self, name, boolean(f"float8.{name}", getattr(self, name)))
        if self.fsdp_float8_all_gather and self.recipe is not Float8Recipe.TENSORWISE:
            # torchao/float8/config.py Float8LinearConfig.__post_init__: the float8 all-gather
            # needs dynamic tensorwise scaling of the weight
            raise SpecError("float8.fsdp_float8_all_gather", "needs recipe tensorwise (torchao "
                            "casts the weight before the all-gather only with one scale per tensor)")

    def to_dict(self) -> dict:
        return {"recipe": self.recipe.value, "convert_lm_head": self.convert_lm_head,
                "fsdp_float8_all_gather": self.fsdp_float8_all_gather}


def check_all_gather(float8: Float8Config, parallel) -> None:
    """The float8 all-gather is an FSDP2 extension: torchao/float8/fsdp_utils.py
    WeightWithDynamicFloat8CastTensor implements fully_shard's fsdp_pre_all_gather /
    fsdp_post_all_gather hooks only, which FSDP1 and unsharded data parallelism never call."""
    if float8.fsdp_float8_all_gather and (parallel.fsdp in ("none", "no-shard") or parallel.fsdp_version != 2):
        raise SpecError("float8.fsdp_float8_all_gather", "needs FSDP2 sharding (parallel.fsdp full-shard, "
                        "shard-grad-op or hybrid-shard with fsdp_version 2); drop it otherwise")


def check_float8_job(float8: Float8Config, parallel, framework) -> None:
    """The float8 section against the job's layout and framework."""
    check_all_gather(float8, parallel)
    check_framework(framework)


def check_framework(framework) -> None:
    """Megatron's fp8 (`--fp8-format`) is TransformerEngine's `fp8_autocast`
    (megatron/core/fp8_utils.py get_fp8_context), not torchao's Float8Linear: refused, as TE
    fp8 is everywhere (its kernels run on NVIDIA GPUs only; no CPU measurement checks it)."""
    if framework.value == "megatron":
        raise SpecError("float8", "Megatron trains fp8 through TransformerEngine, which is not modelled "
                        "(its kernels run on NVIDIA GPUs only, so no CPU measurement can check it); "
                        "drop float8 (bf16) or use a stack that runs torchao float8")


def parse_float8(value: object) -> Float8Config | None:
    """`float8: tensorwise` (a recipe name) or a mapping of Float8Config fields; None: off."""
    if value is None or isinstance(value, Float8Config):
        return value
    if isinstance(value, str):
        return Float8Config(recipe=value)
    if not isinstance(value, dict):
        raise SpecError("float8", f"expected a recipe name (tensorwise, rowwise, rowwise-with-gw-hp) "
                        f"or a mapping, got {value!r}")
    known = {"recipe", "convert_lm_head", "fsdp_float8_all_gather"}
    for key in value:
        if key not in known:
            raise SpecError(f"float8.{key}", f"unknown key; choose from {', '.join(sorted(known))}")
    return Float8Config(**value)


def parse_neftune(value: object) -> float | None:
    """transformers TrainingArguments.neftune_noise_alpha: None (off) or a positive number."""
    if value is None:
        return None
    alpha = number("neftune_noise_alpha", value, high=1e6)
    if alpha <= 0:
        raise SpecError("neftune_noise_alpha", f"expected a positive number (5 in the NEFTune paper), got {value!r}")
    return alpha

"""What every family adapter needs: a config reader with the config class's defaults,
and the parameter entries of nn.Linear / norms, named as `named_parameters()` names them.

Shapes: nn.Linear(in, out).weight is (out, in).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from types import ModuleType

from vramplan.catalog.hf_extended import ExtendedDesc
from vramplan.components.arch_vit import VisionDesc
from vramplan.components.arch import rms_norm
from vramplan.components.graph import Param, Recorder, Sym
from vramplan.model import ModelDesc, ParamEntry


@dataclass(frozen=True, kw_only=True, slots=True)
class FamilyDesc(ExtendedDesc):
    """ExtendedDesc plus what the families in this package add."""

    buffer_bytes: int = 0
    """Registered buffers that are not parameters and live on the device with the model
    (GPTBigCodeModel's (n_positions, n_positions) bool causal-mask table)."""
    attn_implementation: str = ""
    """eager | sdpa | flash when the family's code picks its attention class from its own
    config rather than from the job (InternLM2: `config.attn_implementation`, "eager" when
    unset); "" follows the job's `attention`."""
    z_loss_weight: float = 0.0
    """Baichuan 2's z-loss weight (BaichuanForCausalLM.forward adds it, even at 0)."""

    @property
    def family_forward(self) -> ModuleType | None:
        """The family's forward.py (LAYER_PREFIX, layer, embed, head, optionally
        backward_peak), which components/ records the model through
        (components/arch_gpt2_bert.py family_forward): the description brings its forward,
        so components/ never imports a family. None without a folder for the model type."""
        from vramplan.families import FAMILY_OF, forward
        return forward(self.model_type) if self.model_type in FAMILY_OF else None


class Cfg:
    """Config lookup: explicit key, else the config class's default, else a one-line
    ValueError naming the field."""

    def __init__(self, config: dict, model_type: str, defaults: dict[str, object],
                 aliases: dict[str, str] | None = None):
        self.raw = {(aliases or {}).get(k, k): v for k, v in config.items()}
        self.model_type = model_type
        self.defaults = defaults

    def __getitem__(self, key: str) -> object:
        if key in self.raw:
            return self.raw[key]
        if key in self.defaults:
            return self.defaults[key]
        raise ValueError(f"{self.model_type} config is missing required field {key!r}")

    def get(self, key: str, default: object = None) -> object:
        value = self.raw.get(key, self.defaults.get(key, default))
        return default if value is None else value

    def int(self, key: str) -> int:
        value = self[key]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{self.model_type} config field {key!r} must be a positive "
                             f"integer, got {value!r}")
        return value


def linear(name: str, out: int, inp: int, bias: bool, layer: int | None) -> list[ParamEntry]:
    weight = [ParamEntry(f"{name}.weight", (out, inp), layer)]
    return weight + ([ParamEntry(f"{name}.bias", (out,), layer)] if bias else [])


def norm(name: str, dim: int, layernorm: bool, layer: int | None) -> list[ParamEntry]:
    """RMSNorm: weight; LayerNorm: weight and bias."""
    entries = [ParamEntry(f"{name}.weight", (dim,), layer)]
    return entries + ([ParamEntry(f"{name}.bias", (dim,), layer)] if layernorm else [])


def head(desc: ModelDesc, bias: bool = False) -> list[ParamEntry]:
    """`score` (no bias) for sequence classification, else `lm_head` when untied."""
    if desc.num_labels:
        return linear("score", desc.num_labels, desc.hidden_size, False, None)
    if desc.tie_word_embeddings:
        return []
    return linear("lm_head", desc.vocab_size, desc.hidden_size, bias, None)


def with_params(desc: ModelDesc, params: list[ParamEntry]) -> ModelDesc:
    return replace(desc, params=tuple(params))


def extend(base: ModelDesc, cls: type, **extra: object) -> ModelDesc:
    """`base` as the ModelDesc subclass `cls`, with its extra fields set."""
    return cls(**{f.name: getattr(base, f.name) for f in fields(ModelDesc)}, **extra)


@dataclass(slots=True)
class TowerCtx:
    """A vision tower's recording context: its description (`vis`: `rms` says which norm),
    its parameters by name under the tower's prefix, LoRA targets, and per-forward shared
    tensors (rotary cos/sin)."""

    vis: object
    params: dict[str, Param]
    lora: dict = field(default_factory=dict)
    shared: dict[str, Sym] = field(default_factory=dict)

    @property
    def desc(self) -> object:  # rms_norm reads ctx.desc.model_type
        return self.vis

    def p(self, name: str) -> Param:
        return self.params[name]


def tower_norm(rec: Recorder, ctx: TowerCtx, x: Sym, module: str, name: str) -> Sym:
    """nn.LayerNorm, or the Llama RMSNorm where the tower uses it (Qwen2.5-VL's
    Qwen2_5_VLRMSNorm, InternVL's norm_type rms_norm)."""
    if ctx.vis.rms:
        return rms_norm(rec, ctx, x, module, name)
    return rec.layer_norm(x, ctx.p(module + ".weight"), name)


# SiglipVisionConfig defaults (configuration_siglip.py): what an inline config leaves out.
SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                   "vision_use_head": True}


def siglip_tower(v: dict, feature_layer: int = -1, select_strategy: str = "full") -> VisionDesc:
    """A SiglipVisionModel's VisionDesc from its config (class defaults filled in)."""
    v = {**SIGLIP_DEFAULTS, **v}
    for key in ("image_size", "patch_size"):
        if isinstance(v[key], (list, tuple)):
            if v[key][0] != v[key][1]:
                raise ValueError(f"vision_config.{key}: non-square SigLIP inputs are not modelled")
            v[key] = v[key][0]
    return VisionDesc(hidden_size=v["hidden_size"], num_layers=v["num_hidden_layers"],
                      num_heads=v["num_attention_heads"], intermediate_size=v["intermediate_size"],
                      image_size=v["image_size"], patch_size=v["patch_size"], num_channels=v["num_channels"],
                      hidden_act=v["hidden_act"], class_token=False, pre_norm=False, patch_bias=True,
                      feature_layer=feature_layer,
                      select_strategy=select_strategy)

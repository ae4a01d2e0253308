"""Model families, one folder each: `adapter.py` reads the family's Hugging Face config
into a ModelDesc (exact parameter names and shapes), `forward.py` records what autograd
saves in its forward on the symbolic recorder (vramplan.components.graph).

The registry below maps a config's `model_type` to its folder; both halves are imported
only when a model of that family is built or estimated. Families added before this
package existed still live in catalog/hf*.py and components/arch*.py.
"""
from __future__ import annotations

import importlib
from types import ModuleType

FAMILY_OF: dict[str, str] = {
    "phi": "phi",
    "gpt_bigcode": "gpt_bigcode",
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
    "glm4": "glm4",
    "llama4_text": "llama4",
    "llama4": "llama4",
    "internlm3": "internlm3",
    "mamba2": "mamba2",
    "jamba": "jamba",
    "internlm2": "internlm2",
    "baichuan": "baichuan",
}
"""HF `model_type` -> folder under vramplan/families."""


def _module(model_type: str, part: str) -> ModuleType:
    return importlib.import_module(f"vramplan.families.{FAMILY_OF[model_type]}.{part}")


def adapter(model_type: str):
    """`build(config, name, num_labels) -> ModelDesc` of the family."""
    return _module(model_type, "adapter").build


def forward(model_type: str) -> ModuleType:
    """The family's forward module: LAYER_PREFIX, layer(), embed(), head()."""
    return _module(model_type, "forward")


def rotary_factor(config: dict, default: float) -> float:
    """Share of each head's channels that get rotary, as transformers' PreTrainedConfig
    .convert_rope_params_to_dict resolves it: `rope_parameters` (or the legacy
    `rope_scaling`) dict first, then a top-level `partial_rotary_factor`, then the
    config class's default."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", default)))


def step_buffers(desc, spec) -> int:
    """Bytes a family's code keeps on the device across steps that depend on the job, not
    the config (Baichuan 2 13B's cached ALiBi mask): the forward module's `step_buffers`."""
    if desc.model_type not in FAMILY_OF:
        return 0
    hook = getattr(forward(desc.model_type), "step_buffers", None)
    return hook(desc, spec) if hook else 0


__all__ = ["FAMILY_OF", "adapter", "forward", "rotary_factor", "step_buffers"]

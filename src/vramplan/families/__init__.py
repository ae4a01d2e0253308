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
}
"""HF `model_type` -> folder under vramplan/families."""


REMOTE_CODE_ONLY: dict[str, str] = {
    "internlm2": "InternLM2 (internlm/internlm2-*, InternLM2ForCausalLM in the repo's "
                 "modeling_internlm2.py) fuses q, k and v into one grouped `wqkv` and names its "
                 "modules tok_embeddings/attention/feed_forward/output, so it is not exactly the "
                 "Llama architecture",
    "baichuan": "Baichuan 2 (baichuan-inc/Baichuan2-*, the repo's modeling_baichuan.py) fuses "
                "q, k and v into `W_pack`, normalizes its LM head (NormHead) and uses ALiBi in the "
                "13B model, so it is not exactly the Llama architecture",
}
"""Families that exist only as repository code (trust_remote_code). vramplan never runs a
repository's code, and maps such a config to a known architecture only where it is exactly
that architecture; these are not, so they are refused with the reason."""


def remote_code_message(model_type: str) -> str:
    return (f"model_type {model_type!r} exists only as remote code: {REMOTE_CODE_ONLY[model_type]}; "
            "vramplan does not run repository code and does not model it yet (InternLM3 is "
            "supported by transformers itself as model_type 'internlm3', and by vramplan)")


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


__all__ = ["FAMILY_OF", "REMOTE_CODE_ONLY", "adapter", "forward", "remote_code_message", "rotary_factor"]

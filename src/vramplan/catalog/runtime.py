"""The data behind CUDA's own memory (`cuda_runtime.json`), the estimate's error bars
(`bounds.json`), PEFT's default LoRA targets (`peft_lora_targets.json`) and the families
without an SDPA path (`attention_support.json`): read lazily on
first use and cached, nothing at import."""
from __future__ import annotations

import functools

from vramplan.catalog.data_files import read_json


@functools.lru_cache(maxsize=None)
def _read(name: str) -> dict:
    return read_json(name)


def cuda_runtime() -> dict:
    """cuda_runtime.json: CUDA context, cuBLAS workspaces and NCCL buffers with their sources."""
    return _read("cuda_runtime.json")


def error_bounds() -> dict:
    """bounds.json: per metric the relative interval [lo, hi] around the estimate, built by
    bench/accuracy/bounds.py from the published measurements."""
    return _read("bounds.json")


def peft_lora_targets() -> dict:
    """peft_lora_targets.json: PEFT's default LoRA target modules per `model_type`."""
    return _read("peft_lora_targets.json")["by_model_type"]


def no_sdpa_model_types() -> frozenset[str]:
    """attention_support.json: the `model_type`s whose transformers modeling has no SDPA path."""
    return frozenset(_read("attention_support.json")["no_sdpa"])


def gpu_arch(gpu_name: str | None) -> str | None:
    """`sm90`, `gfx942`, ... for a catalog GPU name; None when unknown."""
    if not gpu_name:
        return None
    for arch, names in cuda_runtime()["architectures"].items():
        if arch != "note" and gpu_name in names:
            return arch
    return None


def peft_moe_targets(model_type: str) -> tuple[dict, dict] | None:
    """peft_moe_targets.json: for a model type whose LoRA targets PEFT moves onto fused MoE
    expert parameters under transformers 5, (transformers-4 name -> parameter suffix,
    fused parameter -> the names fused into it); None for other types."""
    data = _read("peft_moe_targets.json")
    base = data["base_of"].get(model_type)
    return None if base is None else (data["mapping"][base], data["fused"][base])

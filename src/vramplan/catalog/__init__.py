"""Built-in catalogs: models (`models/*.json`) and GPUs (`gpus.json`).

Data files, read lazily on first use and cached (nothing is read at import). Each model
file holds the model's real Hugging Face `config.json` fields under `config`; `hf.py` turns
them into a ModelDesc. Lookups match name, hub id and aliases case-insensitively.
"""
from __future__ import annotations

import difflib
import functools
import json
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

from vramplan.model import ModelDesc


class UnknownNameError(KeyError):
    """A model or GPU name that is not in the catalog; the message suggests the nearest."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True, slots=True)
class CatalogModel:
    name: str
    """Short lowercase slug, e.g. `llama-3.1-8b`."""
    hub_id: str
    """Hugging Face repository the config was taken from, e.g. `meta-llama/Llama-3.1-8B`."""
    config: dict[str, Any]
    """The model's config.json fields (for multimodal repos: as published, with text_config)."""
    aliases: tuple[str, ...] = ()
    description: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class GPU:
    name: str
    """Slug, e.g. `a100-80gb`, `h100-80gb`, `rtx-4090`."""
    vendor: str
    memory_bytes: int
    """Total device memory as the driver reports it (nvidia-smi MiB x 2^20 where known)."""
    memory_marketed: str
    """The figure on the datasheet, e.g. "80 GB"."""
    memory_unit_note: str
    """What the marketed figure means (GB = 10^9 bytes, or really GiB) and its source."""
    bf16_tflops: float | None
    """Dense tensor-core BF16 throughput (no sparsity); None where the GPU has no BF16."""
    fp16_tflops: float
    """Dense tensor-core FP16 throughput (no sparsity)."""
    fp32_tflops: float
    """Non-tensor FP32 (vector) throughput."""
    memory_bandwidth_gbps: float
    """Device memory bandwidth in GB/s (10^9 bytes per second)."""
    interconnect: str
    """`nvlink`, `pcie` or `infinity-fabric`: the fastest GPU-to-GPU link of this form factor."""
    interconnect_gbps: float
    """Per-GPU unidirectional GPU-to-GPU bandwidth of that link, GB/s."""
    aliases: tuple[str, ...] = ()
    notes: str = ""
    sources: tuple[str, ...] = field(default=())


def _key(text: str) -> str:
    return text.strip().lower()


def _loose(text: str) -> str:
    """Letters and digits only: 'RTX 4090', 'rtx4090' and 'rtx-4090' are one name."""
    return "".join(ch for ch in text.lower() if ch.isalnum())


def _lookup(kind: str, index: dict[str, Any], query: str) -> Any:
    hit = index.get(_key(query))
    if hit is not None:
        return hit
    loose = {}
    for key, value in index.items():
        loose.setdefault(_loose(key), []).append(value)
    same = {id(v): v for v in loose.get(_loose(query), [])}
    if len(same) == 1:
        return next(iter(same.values()))
    close = difflib.get_close_matches(_key(query), list(index), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UnknownNameError(f"unknown {kind} {query!r}{hint}")


# ---------------------------------------------------------------- models
@functools.lru_cache(maxsize=1)
def _models() -> tuple[CatalogModel, ...]:
    folder = resources.files(__name__).joinpath("models")
    out = []
    for item in sorted(folder.iterdir(), key=lambda p: p.name):
        if not item.name.endswith(".json"):
            continue
        data = json.loads(item.read_text(encoding="utf-8"))
        out.append(CatalogModel(name=data["name"], hub_id=data["hub_id"], config=data["config"],
                                aliases=tuple(data.get("aliases", ())),
                                description=data.get("description", "")))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _model_index() -> dict[str, CatalogModel]:
    index: dict[str, CatalogModel] = {}
    for entry in _models():
        for key in (entry.name, entry.hub_id, *entry.aliases):
            index.setdefault(_key(key), entry)
    return index


def list_models() -> list[CatalogModel]:
    return list(_models())


def find_model(name_or_hub_id: str) -> CatalogModel:
    """The catalog entry whose name, hub id or alias matches (case-insensitive)."""
    return _lookup("model", _model_index(), name_or_hub_id)


@functools.lru_cache(maxsize=None)
def model_desc(name: str) -> ModelDesc:
    """The ModelDesc of a catalog model (causal LM; BERT: sequence classification)."""
    from vramplan.catalog.hf import model_from_hf_config

    entry = find_model(name)
    return replace(model_from_hf_config(entry.config, entry.name), hub_id=entry.hub_id)


# ---------------------------------------------------------------- GPUs
@functools.lru_cache(maxsize=1)
def _gpus() -> tuple[GPU, ...]:
    data = json.loads(resources.files(__name__).joinpath("gpus.json").read_text(encoding="utf-8"))
    out = []
    for raw in data["gpus"]:
        raw = dict(raw)
        raw["aliases"] = tuple(raw.get("aliases", ()))
        raw["sources"] = tuple(raw.get("sources", ()))
        out.append(GPU(**raw))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _gpu_index() -> dict[str, GPU]:
    index: dict[str, GPU] = {}
    for gpu in _gpus():
        for key in (gpu.name, *gpu.aliases):
            index.setdefault(_key(key), gpu)
    return index


def list_gpus() -> list[GPU]:
    return list(_gpus())


def find_gpu(name: str) -> GPU:
    """The catalog GPU whose name or alias matches (case-insensitive)."""
    return _lookup("GPU", _gpu_index(), name)


__all__ = ["CatalogModel", "GPU", "UnknownNameError", "find_gpu", "find_model", "list_gpus",
           "list_models", "model_desc"]

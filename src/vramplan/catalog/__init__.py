"""Built-in catalogs: models (`models/*.json`) and GPUs (`gpus.json`).

Data files, read lazily on first use and cached (nothing is read at import). Each model
file holds the model's real Hugging Face `config.json` fields under `config`;
`vramplan.sources.model_desc` turns them into a ModelDesc. Lookups match name, hub id and
aliases case-insensitively.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field

from vramplan.catalog.data_files import has_file, json_names, read_json


class UnknownNameError(KeyError):
    """A model or GPU name that is not in the catalog; the message suggests the nearest.
    `candidates` holds the suggested catalog names."""

    def __init__(self, message: str, candidates: list[str] | tuple[str, ...] = ()):
        super().__init__(message)
        self.candidates = tuple(candidates)

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class AmbiguousNameError(UnknownNameError):
    """A name that several catalog entries answer to (`A100`: the 40 GB and the 80 GB card)."""


@dataclass(frozen=True, slots=True)
class CatalogModel:
    name: str
    """Short lowercase slug, e.g. `llama-3.1-8b`."""
    hub_id: str
    """Hugging Face repository the config was taken from, e.g. `meta-llama/Llama-3.1-8B`."""
    config: dict[str, object]
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
    fp16_tflops: float | None
    """Dense tensor-core FP16 throughput (no sparsity); None for a GPU given only by size."""
    fp32_tflops: float | None
    """Non-tensor FP32 (vector) throughput; None for a GPU given only by size."""
    memory_bandwidth_gbps: float | None
    """Device memory bandwidth in GB/s (10^9 bytes per second); None for a GPU given by size."""
    interconnect: str
    """`nvlink`, `pcie`, `infinity-fabric` or `hccs`: the fastest GPU-to-GPU link of this form
    factor (`unknown` for a GPU given by size)."""
    interconnect_gbps: float | None
    """Per-GPU unidirectional GPU-to-GPU bandwidth of that link, GB/s."""
    aliases: tuple[str, ...] = ()
    notes: str = ""
    sources: tuple[str, ...] = field(default=())

    @property
    def by_size(self) -> bool:
        """True for a GPU given only by its memory (`--gpu 64GB`): no throughput known."""
        return self.fp16_tflops is None


def _key(text: str) -> str:
    return text.strip().lower()


def _loose(text: str) -> str:
    """Letters and digits only: 'RTX 4090', 'rtx4090' and 'rtx-4090' are one name."""
    return "".join(ch for ch in text.lower() if ch.isalnum())


def _lookup(kind: str, index: dict[str, object], query: str) -> object:
    """Exact (case-insensitive) name or alias, then the same letters and digits; anything
    else asks: several entries that the query begins are listed, never guessed between."""
    hit = index.get(_key(query))
    if hit is not None:
        return hit
    loose: dict[str, dict[int, object]] = {}
    for key, value in index.items():
        loose.setdefault(_loose(key), {})[id(value)] = value
    same = loose.get(_loose(query), {})
    if len(same) == 1:
        return next(iter(same.values()))
    raise _not_found(kind, index, query, loose)


def _not_found(kind: str, index: dict[str, object], query: str, loose: dict) -> "UnknownNameError":
    q = _loose(query)
    starting = {}
    for key, values in loose.items():
        if q and key.startswith(q):
            starting.update(values)
    names = sorted({v.name for v in starting.values()})
    if len(names) > 1:
        return AmbiguousNameError(f"{kind} {query!r} is ambiguous: pass one of {', '.join(names)}", names)
    import difflib
    close = names or difflib.get_close_matches(_key(query), list(index), n=3, cutoff=0.6)
    close = list(dict.fromkeys(index[c].name if c in index else c for c in close))
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return UnknownNameError(f"unknown {kind} {query!r}{hint}", close)


# ---------------------------------------------------------------- models
def _read_json(*parts: str) -> object:
    return read_json(*parts)


@functools.lru_cache(maxsize=None)
def _model_entry(filename: str) -> CatalogModel:
    """One file of models/, read once: the whole catalog and a lookup by file share it."""
    data = _read_json("models", filename)
    return CatalogModel(name=data["name"], hub_id=data["hub_id"], config=data["config"],
                        aliases=tuple(data.get("aliases", ())), description=data.get("description", ""))


@functools.lru_cache(maxsize=1)
def _models() -> tuple[CatalogModel, ...]:
    return tuple(_model_entry(n) for n in json_names("models"))


@functools.lru_cache(maxsize=256)
def _model_file(key: str) -> CatalogModel | None:
    """The entry in models/<key>.json when its name is `key`, else None. Every file is named
    after its entry's name and no two entries share a name, hub id or alias
    (tests/test_catalog.py), so this is the entry the whole index gives for `key`: a CLI
    run reads one file instead of all of them."""
    if not key or os.path.basename(key) != key or key.startswith(".") or os.sep in key:
        return None
    if not has_file("models", key + ".json"):
        return None
    entry = _model_entry(key + ".json")
    return entry if _key(entry.name) == key else None


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
    if _models.cache_info().currsize == 0:  # the whole catalog not read yet
        hit = _model_file(_key(name_or_hub_id))
        if hit is not None:
            return hit
    return _lookup("model", _model_index(), name_or_hub_id)


# ---------------------------------------------------------------- GPUs
@functools.lru_cache(maxsize=1)
def _gpus() -> tuple[GPU, ...]:
    data = _read_json("gpus.json")
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
    """The catalog GPU whose name or alias matches (case-insensitive), or a GPU given by its
    size (`64GB`, `80GiB`, `81559MiB`): see gpu_by_size."""
    sized = gpu_by_size(name)
    return sized if sized is not None else _lookup("GPU", _gpu_index(), name)


# The unit words a size may carry, exactly: GB/MB/TB are powers of ten (datasheets), GiB/MiB/
# TiB powers of two (PyTorch, nvidia-smi's "MiB"). A bare "G" or number says neither.
_SIZE_UNITS = {"gb": 10**9, "mb": 10**6, "tb": 10**12, "gib": 2**30, "mib": 2**20, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


MAX_GPU_BYTES = 100 * 10**12
"""The largest size a GPU is given by: 100 TB, hundreds of times today's largest cards (B300: 288 GB)."""


def gpu_by_size(text: str) -> GPU | None:
    """A GPU known only by its total memory, from `64GB` (64 x 10^9 bytes) or `80GiB`
    (80 x 2^30); None when `text` is no size. The total is taken as what the driver reports,
    so the CUDA context and the allocator's reserve come out of it as for a catalog card."""
    m = _SIZE.fullmatch(str(text))
    if m is None:
        return None
    number, unit = m.group(1), m.group(2).lower()
    if unit not in _SIZE_UNITS:
        if unit and unit not in ("g", "gi", "m", "mi", "t", "ti"):
            return None  # a name that starts with digits, e.g. "4090"
        if not unit and len(number) >= 4 and "." not in number:
            return None  # "4090", "3090": card numbers, not sizes
        raise UnknownNameError(f"GPU size {text!r} needs a unit: {number}GB (10^9 bytes, as datasheets "
                               f"count) or {number}GiB (2^30 bytes, as PyTorch counts)")
    nbytes = int(float(number) * _SIZE_UNITS[unit])
    if nbytes < 2**20:
        raise UnknownNameError(f"GPU size {text!r} is too small to hold a training step")
    if nbytes > MAX_GPU_BYTES:  # 10^32 TB answered "fits" for any job
        raise UnknownNameError(f"GPU size {text!r} is past any GPU (at most {MAX_GPU_BYTES // 10**12:,} TB); "
                               "give the card's memory, e.g. 80GB or 141GB")
    label = f"{number}{m.group(2)}"
    return GPU(name=label, vendor="unknown", memory_bytes=nbytes, memory_marketed=label,
               memory_unit_note=f"given by size: {label} = {nbytes:,} bytes ({nbytes / 2**30:,.2f} GiB, "
                                f"{nbytes / 1e9:,.2f} GB), taken as the total the driver reports",
               bf16_tflops=None, fp16_tflops=None, fp32_tflops=None, memory_bandwidth_gbps=None,
               interconnect="unknown", interconnect_gbps=None)


__all__ = ["AmbiguousNameError", "CatalogModel", "GPU", "UnknownNameError", "find_gpu", "gpu_by_size", "find_model", "list_gpus",
           "list_models"]

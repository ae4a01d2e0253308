"""Parameter counts of a diffusers pipeline folder's components (catalog/model_index.py).

Where the component's weights are in the folder, the count is read from their safetensors
headers: a file opens with an 8-byte little-endian header length and a JSON table of
`name -> {dtype, shape, data_offsets}` (the safetensors format), so the count is exactly
what loading would put on the GPU, and no tensor data is read. Where only the configs are
there, the installed library's own class (a name from model_index.py's table, never code
from the folder) is built from the config on the meta device, which allocates nothing, and
its parameters are counted: diffusers `ModelMixin.from_config`, transformers
`<Model>(config_class.from_dict(config))`.
"""
from __future__ import annotations

import functools
import json
import os
import struct

from vramplan.catalog.model_index import TEXT_ENCODERS as _TRANSFORMERS
from vramplan.spec import SpecError

_FLOAT = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2")
"""safetensors dtypes of weights; integer tensors (CLIP's saved position_ids) are buffers."""

_TIED = {"T5EncoderModel": ("shared.weight", "encoder.embed_tokens.weight"),
         "UMT5EncoderModel": ("shared.weight", "encoder.embed_tokens.weight")}
"""transformers modeling_t5.py / modeling_umt5.py: the encoder's embed_tokens is `shared`
(one tensor); a checkpoint may store it under both names."""


def component_params(folder: str, component: str, cls: str, config: dict) -> int:
    """Parameters of `folder/component`: its safetensors headers, else `cls` built from
    `config` on the meta device."""
    files = weight_files(os.path.join(folder, component))
    if files:
        return header_params(files, cls)
    return meta_params(cls, json.dumps(config, sort_keys=True), component, folder)


def weight_files(path: str) -> list[str]:
    """The safetensors files of one checkpoint in `path`: a sharded index's shards or a
    single file, the plain one before a variant (`*.fp16.safetensors`); none when a shard
    is absent (a cache that holds only the configs)."""
    try:
        names = sorted(os.listdir(path), key=lambda n: (n.count("."), n))
    except OSError:
        return []
    for name in names:
        if name.endswith(".safetensors.index.json"):
            try:
                with open(os.path.join(path, name), encoding="utf-8") as fh:
                    shards = sorted(set(json.load(fh)["weight_map"].values()))
                if not all(isinstance(s, str) for s in shards):  # a shard named by a number: no index
                    raise TypeError
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
                continue
            files = [os.path.join(path, s) for s in shards]
            return files if all(os.path.isfile(f) for f in files) else []
    singles = [n for n in names if n.endswith(".safetensors") and "-of-" not in n]
    return [os.path.join(path, singles[0])] if singles else []


def header_params(files: list[str], cls: str) -> int:
    """Elements of the floating-point tensors the headers of `files` list, a tied tensor
    stored under both its names counted once. A persistent floating buffer the checkpoint
    holds (AutoencoderKLLTXVideo's latents_mean / latents_std) counts too: it loads beside
    the weights. Pickled checkpoints (*.bin) are never opened: their count comes from the
    config."""
    shapes: dict[str, list[int]] = {}
    for path in files:
        for name, info in _header(path).items():
            if name != "__metadata__" and isinstance(info, dict) and info.get("dtype") in _FLOAT:
                shape = info.get("shape")
                if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                    raise SpecError("model", f"{path}: tensor {name!r} has shape {shape!r}, not a list of sizes; "
                                    "check the download, or remove the file to count from config.json")
                shapes[name] = shape
    keep, alias = _TIED.get(cls, (None, None))
    if keep in shapes:
        shapes.pop(alias, None)
    total = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def _header(path: str) -> dict:
    try:
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            if size > 100 * 2**20:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(fh.read(size))
    except (OSError, ValueError, struct.error, RecursionError) as exc:  # RecursionError: [[[[... (exit 70)
        raise SpecError("model", f"cannot read the safetensors header of {path} ({exc}); "
                        "check the download, or remove the file to count from config.json") from None
    if not isinstance(header, dict):
        raise SpecError("model", f"{path} is not a safetensors file (its header is no table)")
    return header


@functools.lru_cache(maxsize=64)
def meta_params(cls: str, config_json: str, component: str, folder: str) -> int:
    config = json.loads(config_json)
    try:
        import torch
        lib = _library(cls)
    except ImportError:
        raise SpecError("model", f"{component}/ in {folder} has no safetensors weights to count, and "
                        f"{'diffusers' if cls not in _TRANSFORMERS else 'transformers'} (with torch) is not installed "
                        f"to count {cls} from its config.json; download the weights or install it") from None
    log = lib.utils.logging
    level = log.get_verbosity()
    log.set_verbosity_error()  # the library's notes on config keys its __init__ ignores
    try:
        with torch.device("meta"):
            if cls in _TRANSFORMERS:
                model_cls = getattr(lib, cls)
                model = model_cls(model_cls.config_class.from_dict(config))
            else:
                model = getattr(lib, cls).from_config(config)
    except Exception as exc:  # a config the library rejects: one line naming the component
        raise SpecError("model", f"{component}/config.json: {cls} cannot be built from it "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    finally:
        log.set_verbosity(level)
    return sum(p.numel() for p in model.parameters())




def _library(cls: str):
    if cls in _TRANSFORMERS:
        import transformers
        return transformers
    import diffusers
    return diffusers


__all__ = ["component_params", "header_params", "meta_params", "weight_files"]

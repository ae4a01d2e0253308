"""Where a model description comes from: catalog, config file, hub cache, inline, raw size.

This is an edge module (it reads files and the Hugging Face cache); the estimator core only
ever sees the resulting ModelDesc. Nothing here touches the network unless the user asked
(`online: true` in the spec; the CLI's --online or VRAMPLAN_ONLINE=1), and then only to
fetch one config.json; nothing executes code from a model repository.
"""
from __future__ import annotations

import functools
import json
import os

from vramplan.model import ModelDesc
from vramplan.spec import JobSpec, SpecError, Task


def _plain(exc: Exception) -> str:
    """The message without the quotes KeyError puts around it."""
    text = str(exc)
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _read_config_file(path: str) -> dict:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            folder = os.path.dirname(path)
            if os.path.isfile(os.path.join(folder, "model_index.json")):
                raise SpecError("model", f"{folder} is a diffusers pipeline (model_index.json): use --task diffusion")
            raise SpecError("model", f"folder has no config.json: {folder}")
    from vramplan.files import FileReadError, read_mapping
    try:
        return read_mapping(path, json_only=True)
    except FileReadError as exc:
        raise SpecError("model", str(exc)) from None


def looks_like_path(text: str) -> bool:
    return text.endswith(".json") or text.startswith((".", "/", "~")) or os.path.exists(text)


def _from_hub(hub_id: str, online: bool = False) -> dict:
    """config.json of a hub repo: from the local Hugging Face cache (a file lookup, no
    request), or from the hub only when the user asked (`online`)."""
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
    except ImportError:
        raise SpecError("model", f"{hub_id!r} is not in the catalog and huggingface_hub is not "
                        "installed; pip install 'vramplan[hub]' or pass a config.json path") from None
    try:
        cached = try_to_load_from_cache(hub_id, "config.json")
    except Exception:  # an id the hub client rejects (bad characters): not cached
        cached = None
    if isinstance(cached, str):
        return _read_config_file(cached)
    try:
        pipeline = try_to_load_from_cache(hub_id, "model_index.json")
    except Exception:
        pipeline = None
    if isinstance(pipeline, str):
        raise SpecError("model", f"{hub_id!r} is a diffusers pipeline (model_index.json): use --task diffusion")
    if not online:
        raise SpecError("model", f"{hub_id!r} is not in the catalog or the local Hugging Face cache; "
                        "pass --online (or online: true in the spec) to fetch its config.json from "
                        "the hub, or pass a local config.json path")
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    if constants.HF_HUB_OFFLINE:  # hf_hub_download would fail with LocalEntryNotFoundError
        raise SpecError("model", f"{hub_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
                        "set, so the hub is not asked; unset HF_HUB_OFFLINE, or pass a local config.json path "
                        "or model folder")
    try:
        # one HEAD request without retries first: offline, hf_hub_download retries for ~25 s
        # (huggingface_hub's http_backoff), printing a warning line at each try
        get_hf_file_metadata(hf_hub_url(hub_id, "config.json"), timeout=10)
        path = hf_hub_download(hub_id, "config.json")
    except Exception as exc:  # the hub client raises many types; one line for the user
        raise SpecError("model", _hub_failure(hub_id, exc)) from None
    return _read_config_file(path)


def _hub_failure(hub_id: str, exc: Exception) -> str:
    """What went wrong fetching a hub config.json, in one line with the way round it."""
    from huggingface_hub.errors import HfHubHTTPError
    kind = type(exc).__name__
    if kind in ("RepositoryNotFoundError", "GatedRepoError", "EntryNotFoundError", "RemoteEntryNotFoundError"):
        return (f"the hub has no config.json for {hub_id!r} that this machine may read ({kind}); check the id "
                "(a gated or private model needs `hf auth login`), or pass a local config.json")
    if isinstance(exc, HfHubHTTPError):
        return f"cannot get config.json for {hub_id!r} from the hub: {kind}; check the id, or pass a local config.json"
    return (f"cannot reach the hub to fetch config.json for {hub_id!r} ({kind}: no network?); pass a local "
            "config.json path or model folder, or drop --online to use the catalog and the local cache")


def resolve_hf_config(model: object, *, online: bool = False) -> tuple[str, dict]:
    """(display name, Hugging Face config dict) for a spec's `model` field; a hub id outside
    the catalog and the local cache is fetched only when `online`."""
    if isinstance(model, dict):
        if "model_type" not in model:
            raise SpecError("model.model_type", "an inline config needs model_type (e.g. 'llama')")
        return model.get("_name_or_path") or model["model_type"], dict(model)
    if not isinstance(model, str):
        raise SpecError("model", f"expected a name, path or mapping, got {model!r}")
    from vramplan import catalog
    try:
        entry = catalog.find_model(model)
        return entry.name, dict(entry.config)
    except catalog.UnknownNameError as exc:
        unknown = exc
    if looks_like_path(model):
        path = os.path.expanduser(model)
        if not os.path.exists(path):
            raise SpecError("model", f"no such file or folder: {model}")
        return os.path.basename(os.path.normpath(path)), _read_config_file(path)
    if "/" in model:
        return model, _from_hub(model, online)
    hint = _pipeline_hint(model)
    # a catalog VLM or pipeline is no unknown model: "unknown model 'qwen2-vl-2b'; did you mean
    # 'qwen2-1.5b'?" sent users away from the entry `vramplan models` lists
    raise SpecError("model", hint[2:-1] if hint else _plain(unknown))


def _pipeline_hint(name: str) -> str:
    """A vision-language or diffusion catalog entry is not a plain model: say how to ask."""
    from vramplan.catalog import pipelines
    for find, how in ((pipelines.find_vlm, "a vision-language model: add a `vision` section "
                       "(e.g. vision: {num_images: 1}) to the spec"),
                      (pipelines.find_pipeline, "a diffusion pipeline: use --task diffusion")):
        try:
            find(name)
        except (KeyError, ValueError):
            continue
        return f" ({name} is {how})"
    return ""


_DESCS: dict[tuple, ModelDesc] = {}
_DESCS_SIZE = 64


def _desc_key(spec: JobSpec) -> tuple | None:
    """What decides a spec's ModelDesc, or None when it cannot be keyed cheaply. A search
    (fit, compare) and the public estimate() resolve the same model again and again; the
    ModelDesc is frozen, so one instance serves them all and the per-model memos
    (components/memo.py, trainable.param_set) keep hitting."""
    labels = spec.num_labels if spec.task is Task.SEQUENCE_CLASSIFICATION else None
    model = spec.model
    if isinstance(model, str):
        path = os.path.expanduser(model)
        if looks_like_path(model):
            try:
                st = os.stat(path if os.path.isfile(path) else os.path.join(path, "config.json"))
            except OSError:
                return None
            return ("path", path, st.st_mtime_ns, st.st_size, labels)
        from vramplan import catalog
        try:  # only catalog entries: a hub id depends on the cache and on `online`
            catalog.find_model(model)
        except (catalog.UnknownNameError, KeyError, ValueError):
            return None
        return ("name", model, labels)
    if isinstance(model, dict):
        try:
            return ("inline", json.dumps(model, sort_keys=True), labels)
        except (TypeError, ValueError):
            return None
    return None


def resolve_model(spec: JobSpec) -> ModelDesc:
    """The ModelDesc the estimator reads for a spec (memoized, see _desc_key)."""
    key = _desc_key(spec)
    hit = _DESCS.get(key) if key is not None else None
    if hit is not None:
        return hit
    desc = _resolve_model(spec)
    if key is not None:
        if len(_DESCS) >= _DESCS_SIZE:
            _DESCS.pop(next(iter(_DESCS)))
        _DESCS[key] = desc
    return desc


def _resolve_model(spec: JobSpec) -> ModelDesc:
    if spec.model is None:
        from vramplan.rawsize import model_from_size
        return model_from_size(spec.num_params, num_layers=spec.num_layers, hidden_size=spec.hidden_size)
    name, config = resolve_hf_config(spec.model, online=spec.online)
    labels = spec.num_labels if spec.task is Task.SEQUENCE_CLASSIFICATION else None
    try:
        return model_from_hf_config(config, name=name, num_labels=labels)
    except SpecError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise SpecError("model", _plain(exc)) from None


# ---------------------------------------------------------------- config -> ModelDesc
def model_from_hf_config(config: dict, name: str | None = None, *,
                         num_labels: int | None = None) -> ModelDesc:
    """The ModelDesc of a Hugging Face config.json dict: every parameter tensor that
    `AutoModelForCausalLM.from_config(cfg).named_parameters()` yields (or
    `AutoModelForSequenceClassification` with `num_labels`), with its exact module path and
    shape. The one dispatcher over the adapters: a family with a folder under
    vramplan/families (families.FAMILY_OF) builds its own; the Llama-layout decoders,
    GPT-2, BERT (vramplan.catalog.hf) and GPT-NeoX, BLOOM, OPT, Qwen-1, Falcon, T5
    (catalog/hf_extended.py) are built in the catalog."""
    from dataclasses import replace
    from vramplan.catalog.hf_config import checkpoint_dtype
    from vramplan.catalog.quant_config import checkpoint_quantization
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    desc = _model_from_config(config, name, num_labels)
    return replace(desc, checkpoint_dtype=checkpoint_dtype(config) or desc.checkpoint_dtype,
                   checkpoint_quantization=checkpoint_quantization(config))


def supported_model_types() -> tuple[str, ...]:
    """Every model_type model_from_hf_config builds."""
    from vramplan.catalog.hf import BUILTIN_MODEL_TYPES
    from vramplan.families import FAMILY_OF
    return (*BUILTIN_MODEL_TYPES, *(t for t in FAMILY_OF if t not in BUILTIN_MODEL_TYPES))


def _model_from_config(config: dict, name: str | None, num_labels: int | None) -> ModelDesc:
    model_type = config.get("model_type")
    if model_type is None:
        raise ValueError("config is missing required field 'model_type'")
    if not isinstance(model_type, str):
        raise ValueError(f"config field 'model_type' must be a string like 'llama', got {model_type!r}")
    from vramplan.catalog.hf_check import check_config, check_desc
    check_config(config)
    return check_desc(_build(config, model_type, name, num_labels))


def _build(config: dict, model_type: str, name: str | None, num_labels: int | None) -> ModelDesc:
    from vramplan.catalog.hf import builds, builtin_desc
    from vramplan.families import FAMILY_OF, adapter
    if model_type in FAMILY_OF:
        return adapter(model_type)(config, name or config.get("_name_or_path") or model_type, num_labels)
    if "text_config" in config or model_type == "gemma3":
        return _from_text_config(config, model_type, name, num_labels)
    if not builds(model_type):
        raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                         + ", ".join(supported_model_types()))
    return builtin_desc(config, model_type, name or config.get("_name_or_path") or model_type, num_labels)


def _from_text_config(config: dict, model_type: str, name: str | None,
                      num_labels: int | None) -> ModelDesc:
    text = config.get("text_config")
    if model_type != "gemma3":
        raise ValueError(f"multimodal config (text_config) of model_type {model_type!r} is "
                         "not supported yet; pass its language model's config instead")
    if not isinstance(text, dict):
        raise ValueError("gemma3 config is missing required field 'text_config'")
    text = {"model_type": "gemma3_text", **text}
    return model_from_hf_config(text, name or config.get("_name_or_path"), num_labels=num_labels)


@functools.lru_cache(maxsize=None)
def model_desc(name: str) -> ModelDesc:
    """The ModelDesc of a catalog model (causal LM; BERT: sequence classification)."""
    from dataclasses import replace
    from vramplan.catalog import find_model
    entry = find_model(name)
    return replace(model_from_hf_config(entry.config, entry.name), hub_id=entry.hub_id)

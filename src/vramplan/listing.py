"""The catalog as rows: `vramplan models` (language, vision-language and generation models
together) and `vramplan gpus`, for the `--json` output and the web page's /api/models, /api/gpus.

Language models are counted from their config (catalog/hf.py); vision-language models add
their vision tower and projector to their language model; a diffusion pipeline's count is
its parts' published totals (denoiser, VAE, text encoders), the denoiser being the part a
job trains.
"""
from __future__ import annotations

KINDS = ("llm", "vlm", "diffusion")


def model_rows(kind: str | None = None, name: str | None = None) -> list[dict]:
    """{name, kind, hub_id, type, num_params, trained_params} per catalog entry, filtered by
    kind and by a case-insensitive substring of the name or hub id."""
    rows = []
    if kind in (None, "llm"):
        rows += _llm_rows()
    if kind in (None, "vlm"):
        rows += _vlm_rows()
    if kind in (None, "diffusion"):
        rows += _pipeline_rows()
    if name:
        needle = name.lower()
        rows = [r for r in rows if needle in r["name"].lower() or needle in (r["hub_id"] or "").lower()]
    return rows


def _llm_rows() -> list[dict]:
    from vramplan.catalog import list_models
    from vramplan.sources import model_desc
    out = []
    for m in list_models():
        desc = model_desc(m.name)
        out.append({"name": m.name, "kind": "llm", "hub_id": m.hub_id, "type": desc.model_type,
                    "num_params": desc.num_params()})
    return out


def _vlm_rows() -> list[dict]:
    from vramplan.catalog.pipelines import list_vlms
    from vramplan.jobs.vlm import vlm_num_params
    return [{"name": e["name"], "kind": "vlm", "hub_id": e["hub_id"], "type": e["kind"],
             "num_params": vlm_num_params(e)} for e in list_vlms()]


def _pipeline_rows() -> list[dict]:
    from vramplan.catalog.pipelines import list_pipelines
    out = []
    for e in list_pipelines():
        parts = [e["denoiser"], e["vae"], *e.get("text_encoders", ())]
        d = e.get("defaults") or {}
        out.append({"name": e["name"], "kind": "diffusion", "hub_id": e["hub_id"], "type": e["kind"],
                    "num_params": sum(p["num_params"] for p in parts),
                    "trained_params": e["denoiser"]["num_params"],
                    "defaults": f"{d.get('num_frames', 1)}x{d.get('height', '?')}x{d.get('width', '?')}"})
    return out


def gpu_rows() -> list[dict]:
    """{name, memory_bytes, memory_marketed, memory_unit_note} per catalog GPU."""
    from vramplan.catalog import list_gpus
    return [{"name": g.name, "memory_bytes": g.memory_bytes, "memory_marketed": g.memory_marketed,
             "memory_unit_note": g.memory_unit_note} for g in list_gpus()]

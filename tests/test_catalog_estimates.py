"""Every catalog entry estimates without error: language models with default flags,
vision-language models with the one `vision` section they need, diffusion pipelines
with `task: diffusion` (the CLI says so when either is missing)."""
from __future__ import annotations

import json
from importlib import resources

import pytest

import vramplan
from vramplan.cli import main
from vramplan.spec import DEFAULT_SEQ_LEN


def _names(folder: str) -> list[str]:
    root = resources.files("vramplan.catalog").joinpath(folder)
    return sorted(json.loads(f.read_text(encoding="utf-8"))["name"]
                  for f in root.iterdir() if f.name.endswith(".json"))


def _learned_positions(name: str) -> int | None:
    """The position table of a model with learned positions (GPT-2, BERT, T5-free OPT...):
    a longer seq_len is refused (validity.py), so a default seq_len is capped at it."""
    from vramplan import catalog
    cfg = catalog.find_model(name).config
    if cfg.get("model_type") in ("gpt2", "bert", "opt", "gpt_bigcode"):
        return cfg.get("n_positions") or cfg.get("max_position_embeddings")
    return None


@pytest.mark.parametrize("name", _names("models"))
def test_language_model_estimates_with_default_flags(name, capsys):
    assert main(["estimate", name, "--json"]) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    assert out["peak_allocated_bytes"] > out["model"]["num_params"]
    limit = _learned_positions(name)
    assert out["spec"]["seq_len"] == (min(limit, DEFAULT_SEQ_LEN) if limit else DEFAULT_SEQ_LEN)


@pytest.mark.parametrize("name", _names("multimodal"))
def test_vision_language_model_estimates(name):
    est = vramplan.estimate(vramplan.load_spec({"model": name, "vision": {"num_images": 1}}))
    assert est.peak_allocated_bytes > 0


@pytest.mark.parametrize("name", _names("diffusion"))
def test_diffusion_pipeline_estimates(name, capsys):
    assert main(["estimate", name, "--task", "diffusion"]) == 0, capsys.readouterr().err

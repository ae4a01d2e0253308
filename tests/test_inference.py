"""Inference jobs: the estimate against transformers' own no-grad forward and generate.

bench/inference/run.py measures each case with `vramplan measure` (measure/inference.py) on
CPU under the exact meter; here the committed measurements are held to 2% against today's
estimate, and one tiny case is measured live.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import vramplan

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "inference" / "results.json"
TINY = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 344,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}


def _committed() -> dict:
    return json.loads(RESULTS.read_text())


@pytest.mark.parametrize("name", sorted(_committed()))
def test_committed_case_within_two_percent(name):
    row = _committed()[name]
    est = vramplan.estimate(vramplan.load_spec(row["job"])).peak_allocated_bytes
    measured = row["measured"]["peak_allocated_bytes"]
    assert abs(est / measured - 1) <= 0.02, (name, est, measured)


@pytest.mark.parametrize("extra", [{}, {"max_new_tokens": 4}])
def test_live_tiny_inference_matches_the_meter(extra):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from vramplan.measure import measure

    job = {"model": TINY, "task": "inference", "backend": "cpu", "micro_batch_size": 2, "seq_len": 64,
           "precision": "fp32", **extra}
    result = measure(job)
    assert result.runner["library"] == "transformers"
    assert result.phases["backward"] == result.phases["optimizer"] == 0
    est = vramplan.estimate(vramplan.load_spec(job))
    assert abs(est.peak_allocated_bytes / result.peak_allocated_bytes - 1) <= 0.02


def test_generation_cache_grows_with_new_tokens_and_forward_keeps_all_logits():
    base = {"model": TINY, "task": "inference", "micro_batch_size": 2, "seq_len": 64, "precision": "bf16"}
    plain = vramplan.estimate(vramplan.load_spec(base)).components.terms
    # a plain forward returns every position's logits in the compute dtype (bf16: 2 B)
    assert plain["transient/logits"] == 2 * 64 * 2048 * 2
    long = vramplan.estimate(vramplan.load_spec({**base, "seq_len": 8, "max_new_tokens": 4000})).components.terms
    # the last decoding step: the cache of s + n - 1 tokens and one layer's grown keys
    kv_one = 2 * 2 * 128 // 4 * 2  # b x k x d x bf16 per token
    assert long["kv_cache"] == 2 * 2 * (8 + 4000 - 1) * kv_one
    assert long["transient/kv_cat"] == (8 + 4000) * kv_one


def test_inference_header_names_no_optimizer(capsys, tmp_path):
    from vramplan.cli import main

    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"model": TINY, "task": "inference", "seq_len": 64, "max_new_tokens": 8}))
    assert main(["--lang", "en", "estimate", "--spec", str(spec)]) in (0, None)
    out = capsys.readouterr().out
    assert "inference" in out and "adamw" not in out and "optimizer states" not in out

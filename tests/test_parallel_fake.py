"""FSDP2 at world sizes 4 and 8 in one process with PyTorch's fake process group
(bench/parallel/fsdp2_fake.py): committed results and one live run."""
import json
import pathlib
import sys

import pytest

from vramplan.estimation import estimate
from vramplan.spec import load_spec

BENCH = pathlib.Path(__file__).parents[1] / "bench/parallel"


def test_fake_pg_results_within_5_percent_at_world_4_and_8():
    rows = json.loads((BENCH / "results-fake.json").read_text())["results"]
    assert {4, 8} <= {r["world_size"] for r in rows}
    for row in rows:
        measured = row["measured"][0]["peak_allocated_bytes"]
        spec = load_spec({**row["job"], "num_gpus": row["world_size"]})
        assert abs(estimate(spec).peak_allocated_bytes - measured) / measured < 0.05, (row["name"], row["world_size"])


def test_fake_pg_world_8_live():
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    sys.path.insert(0, str(BENCH))
    try:
        from fsdp2_fake import TINY_LLAMA, run_isolated
    finally:
        sys.path.remove(str(BENCH))
    job = {"model": {**TINY_LLAMA, "num_hidden_layers": 2}, "precision": "fp32", "optimizer": "adamw",
           "optimizer_impl": "foreach", "micro_batch_size": 1, "seq_len": 64, "backend": "cpu",
           "attention": "sdpa", "parallel": {"fsdp": "full-shard", "fsdp_version": 2}}
    measured = run_isolated(job, 8, steps=2)["peak_allocated_bytes"]
    est = estimate(load_spec({**job, "num_gpus": 8})).peak_allocated_bytes
    assert abs(est - measured) / measured < 0.05

"""FSDP2 at world sizes 4 and 8 in one process with PyTorch's fake process group
(bench/parallel/fsdp2_fake.py), 2-D FSDP2 + TP and HSDP (fsdp_tp_cpu.py): committed results
and one live run."""
import json
import pathlib
import sys

import pytest

from vramplan.estimation import estimate
from vramplan.spec import load_spec

BENCH = pathlib.Path(__file__).parents[1] / "bench/parallel"


def _errors(row) -> tuple[float, dict]:
    e = estimate(load_spec({**row["job"], "num_gpus": row["world_size"]}))
    m = row["measured"][0]
    phases = {}
    for name, key in (("forward", "fwd"), ("backward", "bwd"), ("optimizer", "opt")):
        seen = max(v for k, v in m["phase_peaks"].items() if k.endswith("." + key))
        phases[key] = (e.phases[name] - seen) / seen
    return (e.peak_allocated_bytes - m["peak_allocated_bytes"]) / m["peak_allocated_bytes"], phases


@pytest.mark.parametrize("results", ["results-fake.json", "results-fsdp-tp.json", "results-fake-float8.json"])
def test_fake_pg_results_within_2_percent_and_5_per_phase(results):
    # fsdp2_fake.py (FSDP2 and FSDP1 at world 4 and 8) and fsdp_tp_cpu.py (2-D FSDP2 + TP, HSDP)
    rows = json.loads((BENCH / results).read_text())["results"]
    assert rows and {r["world_size"] for r in rows} >= {4, 8}
    for row in rows:
        peak, phases = _errors(row)
        assert abs(peak) < 0.02, (row["name"], row["world_size"])
        assert all(abs(v) < 0.05 for v in phases.values()), (row["name"], row["world_size"], phases)


def test_float8_all_gather_measured_saving_and_the_estimate_follows():
    # the same FSDP2 float8 job measured with and without torchao's float8 all-gather: the
    # gathered weights hold one byte per element instead of four, and the estimate moves by
    # the measured amount (within 2% of the saving)
    rows = {(r["name"], r["world_size"]): r for r in json.loads((BENCH / "results-fake-float8.json").read_text())["results"]}
    base = "tiny-llama/b2s128/fp32/adamw-forloop/fsdp2-full-shard/float8"
    for world in (4, 8):
        plain, gathered = rows[(base, world)], rows[(base + "-all-gather", world)]
        saved = plain["measured"][0]["peak_allocated_bytes"] - gathered["measured"][0]["peak_allocated_bytes"]
        assert saved > 0.05 * gathered["measured"][0]["peak_allocated_bytes"]
        est = [estimate(load_spec({**r["job"], "num_gpus": world})).peak_allocated_bytes for r in (plain, gathered)]
        assert abs((est[0] - est[1]) - saved) < 0.02 * saved


def test_float8_gathered_weights_are_the_ones_torchao_wraps():
    # the estimate's predicate against the real conversion: the weights torchao wraps in
    # WeightWithDynamicFloat8CastTensor (the ones FSDP2 all-gathers in float8)
    pytest.importorskip("torchao.float8")
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from vramplan.components.float8 import gathered_in_float8
    from vramplan.components.trainable import param_set
    from vramplan.estimation import model_spec
    from vramplan.sources import resolve_model
    from vramplan.measure.build import build_model, convert_float8
    sys.path.insert(0, str(BENCH))
    try:
        from fsdp2_fake import FLOAT8_CASES
    finally:
        sys.path.remove(str(BENCH))
    import torch
    for case in FLOAT8_CASES[1:4:2]:  # without and with the output head converted
        # intermediate 680: its projections are no multiple of 16 and stay nn.Linear
        job = {**case["job"], "model": {**case["job"]["model"], "intermediate_size": 680}}
        model = build_model(job, "meta", torch.float32)
        convert_float8(model, job["float8"])
        real = {n for n, p in model.named_parameters() if isinstance(p, WeightWithDynamicFloat8CastTensor)}
        spec = load_spec({**job, "num_gpus": 4})
        desc = resolve_model(spec)
        spec = model_spec(desc, spec)
        pred = gathered_in_float8(spec, desc.model_type)
        ours = {p.name for p in param_set(desc, spec).params if pred(p)}
        assert real and ours == real, (sorted(real ^ ours))


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


def test_fsdp2_over_tensor_parallel_live():
    # torchtitan's 2-D recipe (TP plan, then fully_shard over the dp_shard sub-mesh), rank 0
    # of dp 2 x tp 2 on the fake process group, against `parallel: {fsdp, tp: 2}` on 4 GPUs.
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    sys.path.insert(0, str(BENCH))
    try:
        from fsdp_tp_cpu import TINY_LLAMA, run_isolated
    finally:
        sys.path.remove(str(BENCH))
    job = {"model": {**TINY_LLAMA, "num_hidden_layers": 2}, "precision": "fp32", "optimizer": "adamw",
           "micro_batch_size": 1, "seq_len": 64, "backend": "cpu", "attention": "sdpa",
           "parallel": {"fsdp": "full-shard", "fsdp_version": 2, "tp": 2, "sp": True}}
    measured = run_isolated(job, 4, steps=2)["peak_allocated_bytes"]
    est = estimate(load_spec({**job, "num_gpus": 4})).peak_allocated_bytes
    assert abs(est - measured) / measured < 0.02

"""The estimator against training steps measured on a real GPU (an H100 80GB HBM3, torch
2.11.0+cu130; bench/cuda/README.md): the committed measurements, re-estimated with this
code. The GPU is not needed here: its readings are the ground truth on file."""
from __future__ import annotations

import json
import pathlib
import statistics

import pytest

import vramplan
from vramplan.components.runtime import cuda_context_bytes, cuda_context_process_bytes
from vramplan.units import MiB

ROOT = pathlib.Path(__file__).parents[1]
GRID = ROOT / "bench/accuracy/results-cuda-nvidia-h100-80gb-hbm3.json"
SCALE = ROOT / "bench/cuda/results-cuda-scale-nvidia-h100-80gb-hbm3.json"


def _measured(path: pathlib.Path, word: str = "") -> list[dict]:
    rows = [r for r in json.loads(path.read_text())["cases"] if "measured" in r and word in r["name"]]
    assert rows, f"no measured case with {word!r} in {path.name}"
    return rows


def _error(row: dict, key: str = "peak_allocated_bytes", est_key: str = "peak_allocated_bytes") -> float:
    est = vramplan.estimate(vramplan.load_spec(row["job"])).to_dict()
    return (est[est_key] - row["measured"][key]) / row["measured"][key]


@pytest.mark.parametrize("word", ["qwen2/b2s512/fp32/full", "gpt_bigcode/b2s512/fp32/full",
                                  "mistral-nemo-shape", "llama-gqa/b2s512/fp32/full"])
def test_fp32_grouped_heads_take_the_math_path_on_cuda(word):
    # fp32 with fewer k/v heads than query heads: no fused CUDA kernel takes the call in
    # torch <= 2.13, the math path saves the (b, a, s, s) softmax: 6-27% low before.
    for row in _measured(GRID, word):
        assert abs(_error(row)) < 0.02, row["name"]


def test_catalog_size_steps_on_an_h100():
    # 0.5B-3B models, full and LoRA, 19-34 GiB allocated: the peak within 0.2%
    for row in _measured(SCALE):
        assert abs(_error(row)) < 0.005, row["name"]


def test_the_grid_on_an_h100_stays_close():
    rows = [r for r in _measured(GRID) if "mamba2" not in r["name"] and "jamba" not in r["name"]]
    errors = [abs(_error(r)) for r in rows[::4]]  # every 4th case keeps this quick
    assert statistics.median(errors) < 0.01
    assert max(errors) < 0.05


def test_context_measured_on_sm90_device_level_and_per_process():
    # NVML on the H100: 1246.8 MiB device-level and 758 MiB charged to the process, above
    # max_memory_reserved, on every catalog-size case (catalog/cuda_runtime.json)
    assert cuda_context_bytes("h100-80gb") == 1307377664
    assert cuda_context_process_bytes("h100-80gb") == 758 * MiB
    assert cuda_context_process_bytes("rtx-3090") == cuda_context_bytes("rtx-3090")  # no split measured
    for row in _measured(SCALE):
        m = row["measured"]
        assert m["device_bytes"] - m["peak_reserved_bytes"] == cuda_context_bytes("h100-80gb"), row["name"]
        assert m["process_bytes"] - m["peak_reserved_bytes"] == cuda_context_process_bytes("h100-80gb")


def _failed_on_the_gpu(word: str) -> dict:
    rows = [r for r in json.loads(GRID.read_text())["cases"] if "failed" in r and word in r["name"]]
    assert rows, f"no failed {word!r} case in {GRID.name}"
    return rows[0]["job"]


@pytest.mark.parametrize("job,what", [({"model": "gpt2", "task": "dpo"}, "task 'dpo'"),
                                      ({"model": "gpt2", "task": "inference"}, "task 'inference'"),
                                      ("gemma3-vl/b2s64+2img/fp32/full/tower-trained", "a vision-language job")])
def test_cuda_refuses_a_step_it_would_not_run(job, what):
    # measure(device="cuda") runs only the single-model loop: a DPO, inference or VLM job
    # is refused before any CUDA call (so this holds on a machine without a GPU too),
    # rather than measured as a plain step of its language model (the VLM case is the one
    # that ran that way on the H100 and failed inside the model)
    pytest.importorskip("torch")
    from vramplan.measure import measure
    if isinstance(job, str):
        job = _failed_on_the_gpu(job)
    else:
        job = {"seq_len": 64, "micro_batch_size": 1, **job}
    with pytest.raises(ValueError, match=f"device: measuring {what}"):
        measure(job, device="cuda")

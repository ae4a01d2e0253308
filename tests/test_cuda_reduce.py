"""components/cuda_reduce.py against the H200's own allocation traces of transformers'
Adafactor steps (bench/allocator/traces/h200_*adafactor*, recorded by bench/cuda/trace_cuda.py):
every block allocated by the column mean `exp_avg_sq_col...add_(update.mean(dim=-2))` is the
reduction buffer computed for that parameter's shape, or, where none is computed, the mean's
own output (cols x 4 bytes)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import vramplan
from vramplan.components.cuda_reduce import column_reduce_buffer
from vramplan.components.trainable import param_set
from vramplan.sources import resolve_model

TRACES = sorted((Path(__file__).resolve().parents[1] / "bench" / "allocator" / "traces").glob("h200_*adafactor*"))
COLUMN_MEAN = "optimization.py:1267:step"   # transformers 5.24 Adafactor.step, the dim=-2 mean
UPDATE = "optimization.py:1261:step"        # `update = grad**2 + eps`, two blocks per parameter


def _column_mean_blocks(doc: dict) -> list[tuple[int, list[int]]]:
    """(fp32 bytes of the parameter's update, sizes the column mean allocated) per step of a
    parameter, in the trace's order."""
    actions, frames = doc["actions"], doc["frames"]
    out: list[tuple[int, list[int]]] = []
    for action, _, size, frame in doc["trace"]:
        if actions[action] != "alloc" or frame < 0:
            continue
        where = frames[frame].split(" < ")[0]
        if where == UPDATE and (not out or out[-1][1] or out[-1][0] != size):
            out.append((size, []))
        elif where == COLUMN_MEAN and out:
            out[-1][1].append(size)
    return [x for x in out if x[1]]


@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_adafactor_column_mean_buffer_is_the_reduction_config(path):
    with gzip.open(path, "rt") as fh:
        doc = json.load(fh)
    spec = vramplan.load_spec(doc["job"])
    shapes: dict[int, set[tuple[int, int]]] = {}
    for p in param_set(resolve_model(spec), spec).trainable():
        if len(p.shape) == 2:
            shapes.setdefault(p.numel * 4, set()).add(p.shape)
    checked = 0
    for update_bytes, sizes in _column_mean_blocks(doc):
        if update_bytes not in shapes:
            continue
        allowed = set()
        for rows, cols in shapes[update_bytes]:
            buffer = column_reduce_buffer(rows, cols, "h200-141gb")
            allowed.add(buffer if buffer else cols * 4)
        assert max(sizes) in allowed, (update_bytes, sizes, shapes[update_bytes])
        checked += 1
    assert checked >= 10

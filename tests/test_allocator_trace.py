"""PyTorch's own allocation traces (vramplan.measure.cuda_trace's compact form) read back and
replayed through the allocator model (vramplan.allocator.trace), against H100 traces."""
import gzip
import json
from pathlib import Path

import pytest

import vramplan
from vramplan.allocator.trace import is_marker, ops, replay_ops
from vramplan.measure.cuda_trace import ACTIONS, MARK, compact, frame_key
from vramplan.spec.alloc_conf import parse_alloc_conf

TRACES = Path(__file__).resolve().parents[1] / "bench/allocator/traces"


def _doc(name):
    with gzip.open(TRACES / name, "rt") as fh:
        return json.load(fh)


def test_compact_keeps_each_entry_and_the_innermost_frames_outside_the_plumbing():
    frames = [{"filename": "/x/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"},
              {"filename": "/x/site-packages/transformers/models/llama/modeling_llama.py", "line": 164,
               "name": "forward"},
              {"filename": "/home/u/train.py", "line": 9, "name": "main"}]
    entries = [{"action": "segment_alloc", "addr": 0, "size": 2 << 20},
               {"action": "alloc", "addr": 0, "size": 4096, "frames": frames},
               {"action": "free_requested", "addr": 0, "size": 4096},
               {"action": "free_completed", "addr": 0, "size": 4096}]
    doc = compact(entries, ["s1.fwd"])
    assert doc["actions"] == list(ACTIONS) and doc["mark_bytes"] == MARK and doc["phases"] == ["s1.fwd"]
    assert [r[:3] for r in doc["trace"]] == [[ACTIONS.index(e["action"]), e["addr"], e["size"]] for e in entries]
    assert doc["frames"] == ["transformers/models/llama/modeling_llama.py:164:forward < train.py:9:main"]
    assert [r[3] for r in doc["trace"]] == [-1, 0, -1, -1]
    assert frame_key(frames[:1]) == ""


def test_markers_open_phases_and_stay_allocations():
    doc = {"actions": list(ACTIONS), "mark_bytes": MARK, "phases": ["s1.fwd", "s1.bwd"],
           "trace": [[0, 1, 100, -1], [0, 2, MARK + 512, -1], [2, 2, MARK + 512, -1], [0, 3, 200, -1],
                     [0, 4, MARK + 1024, -1], [2, 1, 100, -1]]}
    seq = ops(doc)
    assert [(k, p) for k, _, _, p in seq] == [("a", "init"), ("a", "s1.fwd"), ("f", "s1.fwd"), ("a", "s1.fwd"),
                                              ("a", "s1.bwd"), ("f", "s1.bwd")]
    assert is_marker(doc, MARK + 512) and not is_marker(doc, MARK) and not is_marker(doc, MARK + 3 * 512)


@pytest.mark.parametrize("name", ["llama_b2s512_fp32_full_adamw-foreach_sdpa_nogc.json.gz",
                                  "llama-3.2-1b_b4s1024_expandable.json.gz"])
def test_the_model_on_a_real_step_s_allocations_gives_its_measured_reserve(name):
    doc = _doc(name)
    top, ends = replay_ops(ops(doc), parse_alloc_conf(doc["job"].get("alloc_conf")))
    assert top == doc["max_memory_reserved"]
    assert set(ends) == {"init", *doc["phases"]}


def test_measure_cli_puts_the_replays_beside_the_measured_reserve():
    from vramplan.cli.measure import allocator_check, render
    doc = _doc("llama-3.2-1b_b4s1024_default.json.gz")
    spec = vramplan.load_spec(doc["job"])
    check = allocator_check(doc, doc["max_memory_reserved"], vramplan.estimate(spec), spec)
    assert check["model_on_trace_reserved_bytes"] == check["measured_reserved_bytes"] == doc["max_memory_reserved"]
    assert check["allocations"] == sum(1 for r in doc["trace"] if r[0] == 0) - len(doc["phases"])
    replay = check["estimate_replay_reserved_bytes"]
    assert abs(replay - doc["max_memory_reserved"]) <= 0.05 * doc["max_memory_reserved"]
    text = render({"device": "cuda", "runner": None, "failure": None, "measured": None, "allocator": check})
    assert "allocator: " in text and f"{replay / 2**30:.2f} GiB" in text

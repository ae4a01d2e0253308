"""CLI: compare, fit, check; JSON shapes and one-line errors."""
from __future__ import annotations

import json
import sys

from vramplan.cli import main

JOB = ["qwen2.5-0.5b", "--gpu", "rtx-4090", "--micro-batch-size", "4", "--grad-accum-steps", "2",
       "--seq-len", "1024", "--num-gpus", "2"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_fit_json_schema_and_order(capsys):
    code, out, _ = run(capsys, "fit", *JOB, "--json", "--top-k", "3")
    data = json.loads(out)
    assert code == 0
    assert {"candidates_evaluated", "elapsed_s", "results"} <= set(data)
    res = data["results"]
    assert 1 <= len(res) <= 3 and all(r["fits"] for r in res)
    assert [r["step_time_s"] for r in res] == sorted(r["step_time_s"] for r in res)
    assert {"spec", "estimate", "step_time_s", "fits", "why"} <= set(res[0])


def test_fit_headroom_is_respected(capsys):
    code, out, _ = run(capsys, "fit", *JOB, "--json", "--headroom", "10%")
    data = json.loads(out)
    for r in data["results"]:
        assert r["estimate"]["device_bytes"] <= data["limit_bytes"]
    bare = json.loads(run(capsys, "fit", *JOB, "--json", "--headroom", "0")[1])
    assert data["limit_bytes"] < bare["limit_bytes"] and bare["headroom_bytes"] == 0
    # by default fit keeps the nvidia-smi upper bound (catalog/bounds.json) on the card
    from vramplan.plan.fit import default_fit_headroom
    default = json.loads(run(capsys, "fit", *JOB, "--json")[1])
    assert default["headroom_bytes"] == default_fit_headroom(bare["limit_bytes"]) > 0
    assert default["limit_bytes"] == bare["limit_bytes"] - default["headroom_bytes"]


def test_compare_json_rows(capsys):
    code, out, _ = run(capsys, "compare", *JOB, "--json", "--strategy", "tiny seq_len=128")
    rows = json.loads(out)["rows"]
    assert [r["name"] for r in rows] == ["baseline", "tiny"]
    assert rows[1]["saving_bytes"] > 0 and rows[1]["spec"]["seq_len"] == 128


def test_fit_maximize_and_minimize(capsys):
    code, out, _ = run(capsys, "fit", *JOB, "--maximize", "micro_batch_size", "--json")
    data = json.loads(out)
    assert code == 0 and data["value"] >= 1 and data["estimate"]["fits"]
    code, out, _ = run(capsys, "fit", *JOB, "--minimize", "num_gpus", "--json", "--max-gpus", "4")
    assert code == 0 and json.loads(out)["num_gpus"] == 1


def test_user_errors_are_one_line_exit_2(capsys):
    code, out, err = run(capsys, "fit", *JOB, "--vary", "zero_stag=0,3")
    assert code == 2 and "did you mean" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "compare", "qwen2.5-0.5b")
    assert code == 2 and "--gpu" in err
    code, _, err = run(capsys, "fit", *JOB, "--headroom", "lots")
    assert code == 2 and "headroom" in err


def test_check_without_gpu_says_so_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(sys.modules["vramplan.check"], "_nvml_gpus", lambda: [])
    monkeypatch.setattr(sys.modules["vramplan.check"], "_torch_gpus", lambda: [])
    code, out, err = run(capsys, "check", "qwen2.5-0.5b")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no local GPU" in err
    code, out, err = run(capsys, "check", "qwen2.5-0.5b", "--gpu", "t4", "--seq-len", "8192",
                         "--micro-batch-size", "8")
    assert code == 1 and "does not fit" in out

"""--format table|json|markdown|csv, notebook display, shell completion."""
import csv
import io
import json
import shutil
import subprocess

import pytest

import vramplan
from vramplan.cli import main

JOB = ["qwen2.5-0.5b", "--gpu", "rtx-4090", "--micro-batch-size", "4", "--grad-accum-steps", "2",
       "--seq-len", "1024", "--num-gpus", "2"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_csv_adds_up_to_the_json(capsys):
    data = json.loads(run(capsys, "estimate", *JOB, "--format", "json")[1])
    code, out, _ = run(capsys, "estimate", *JOB, "--format", "csv", "--depth", "9")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and rows[-1]["term at the peak"] == "peak allocated"
    assert int(rows[-1]["bytes"]) == data["peak_allocated_bytes"]
    assert sum(int(r["bytes"]) for r in rows[:-1]) == data["peak_allocated_bytes"]
    assert float(rows[-1]["GiB"]) == pytest.approx(data["peak_allocated_bytes"] / 2**30, abs=0.01)


def test_json_flag_is_format_json(capsys):
    a = json.loads(run(capsys, "estimate", *JOB, "--json")[1])
    b = json.loads(run(capsys, "estimate", *JOB, "--format", "json")[1])
    assert a == b


def test_markdown_tables(capsys):
    code, out, _ = run(capsys, "estimate", *JOB, "--format", "markdown")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("**qwen2.5-0.5b")
    assert lines[2].startswith("| term at the peak |") and lines[3].startswith("|:---|")
    assert any(l.startswith("| peak allocated |") for l in lines) and "rtx-4090" in out
    code, out, _ = run(capsys, "compare", *JOB, "--format", "markdown")
    assert code == 0 and "| baseline |" in out and "| strategy |" in out
    code, out, _ = run(capsys, "fit", *JOB, "--format", "markdown", "--top-k", "2")
    assert code == 0 and "| 1 |" in out and "| 2 |" in out and "vramplan estimate qwen2.5-0.5b" in out


def test_compare_and_fit_csv_parse(capsys):
    out = run(capsys, "compare", *JOB, "--format", "csv")[1]
    rows = list(csv.DictReader(io.StringIO(out)))
    assert rows[0]["strategy"] == "baseline" and float(rows[0]["saves GiB"]) == 0.0
    out = run(capsys, "fit", *JOB, "--format", "csv", "--top-k", "3")[1]
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["#"] for r in rows] == ["1", "2", "3"]
    limit = json.loads(run(capsys, "fit", *JOB, "--json", "--top-k", "3")[1])["limit_bytes"] / 2**30
    for r in rows:  # device + spare is the usable capacity on every row
        assert float(r["device GiB"]) + float(r["spare GiB"]) == pytest.approx(limit, abs=0.02)


def test_repr_html_for_notebooks():
    spec = vramplan.load_spec({"model": "qwen2.5-0.5b", "gpu": "rtx-4090", "seq_len": 256})
    est = vramplan.estimate(spec)
    page = est._repr_html_()
    assert page.startswith("<div>") and "<table>" in page and "peak allocated" in page and "rtx-4090" in page
    from vramplan.plan.compare import Strategy, compare
    rows = compare(spec, strategies=[Strategy("ckpt", {"gradient_checkpointing": "full"})])
    assert "<td>ckpt</td>" in rows._repr_html_() and rows.to_dict()["rows"][0]["name"] == "baseline"
    from vramplan.plan.fit import fit
    report = fit(spec, top_k=2)
    assert report._repr_html_().count("<tr>") == 1 + len(report.results)


def test_html_escapes():
    from vramplan.report.tables import Tabular
    page = Tabular("a<b", ["x"], [["<script>"]]).to_html()
    assert "<script>" not in page and "&lt;script&gt;" in page


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_scripts(capsys, shell):
    code, out, _ = run(capsys, "completion", shell)
    assert code == 0 and "--per-device-train-batch-size" in out and "--num-frames" in out
    if shell == "bash" and shutil.which("bash"):
        assert subprocess.run(["bash", "-n"], input=out, text=True).returncode == 0

"""--plot: html without dependencies or network, png/svg through matplotlib."""
from __future__ import annotations

import re

import pytest

from vramplan.cli import main
from vramplan.report.plots import plot_sweep

JOB = ["qwen2.5-0.5b", "--gpu", "rtx-4090", "--micro-batch-size", "2", "--seq-len", "1024"]


def test_compare_html_is_self_contained_and_lists_every_strategy(tmp_path, capsys):
    out = tmp_path / "compare.html"
    assert main(["compare", *JOB, "--plot", str(out), "--json"]) == 0
    page = out.read_text()
    assert "<svg" in page and "capacity" in page
    assert not re.search(r"""(src|href)=["']?https?:""", page)      # no network
    for name in ("baseline", "checkpointing", "lora"):
        assert f">{name}<" in page
    assert 'data-group="optimizer"' in page


def test_sweep_html_marks_points_over_capacity(tmp_path):
    out = plot_sweep([(1, 10 * 2**30), (2, 20 * 2**30), (4, 40 * 2**30)], str(tmp_path / "s.html"),
                     name="micro_batch_size", capacity_bytes=24 * 2**30)
    page = open(out).read()
    assert len(re.findall(r'<circle[^>]*fill="#c00"', page)) == 1 and "micro_batch_size = 4" in page


@pytest.mark.parametrize("ext,magic", [("png", b"\x89PNG"), ("svg", b"<?xml")])
def test_fit_png_and_svg_through_matplotlib(tmp_path, capsys, ext, magic):
    pytest.importorskip("matplotlib")
    out = tmp_path / f"fit.{ext}"
    assert main(["fit", *JOB, "--maximize", "seq_len", "--plot", str(out)]) == 0
    assert out.read_bytes().startswith(magic)


def test_bad_plot_extension_is_one_line(tmp_path, capsys):
    assert main(["compare", *JOB, "--plot", str(tmp_path / "x.pdf")]) == 2
    err = capsys.readouterr().err
    assert "png" in err and len(err.strip().splitlines()) == 1

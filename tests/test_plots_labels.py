"""Plots: numbers on the bars and the capacity line inside the picture."""
import pytest

from vramplan.report import plots
from vramplan.units import GiB

BARS = [("baseline", {"weights": 10 * GiB, "optimizer": 20 * GiB, "activations": 2 * GiB}),
        ("zero-3", {"weights": 3 * GiB, "optimizer": 5 * GiB, "activations": 2 * GiB})]


def test_matplotlib_bars_carry_numbers_and_a_visible_capacity():
    plt = pytest.importorskip("matplotlib.pyplot")
    cap = 80 * GiB  # far above every bar: the line must still be inside the y range
    fig, ax = plots.bars_figure(plt, BARS, title="t", capacity_bytes=cap)
    labels = {t.get_text() for t in ax.texts}
    assert "32.00" in labels and "10.00" in labels  # totals on top
    block_labels = {t.get_text() for t in ax.findobj(match=lambda o: hasattr(o, "get_text")) if t.get_text()}
    assert "20.0" in block_labels and "10.0" in block_labels  # sizes inside the blocks
    assert ax.get_ylim()[1] > 80
    assert any("capacity 80.00 GiB" == l.get_label() for l in ax.get_lines())
    plt.close(fig)


def test_html_bars_carry_block_sizes(tmp_path):
    path = tmp_path / "b.html"
    plots._bars(BARS, str(path), title="t", capacity_bytes=24 * GiB)
    page = path.read_text()
    assert ">20.0</text>" in page and ">32.0</text>" in page and "capacity 24.00 GiB" in page

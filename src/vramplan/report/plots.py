"""Pictures: the breakdown as stacked bars, `compare` side by side, memory against a swept
value with the GPU's capacity line. `.png` / `.svg` through matplotlib (the `plot` extra);
`.html` is a self-contained interactive page (inline SVG, hover tooltips, a legend that
toggles groups) with no network access and no dependency.
"""
from __future__ import annotations

import html
import os

from vramplan.units import GiB

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac")

Bars = list[tuple[str, dict[str, int]]]


def plot_breakdown(est, path: str, *, depth: int = 1) -> str:
    """One stacked bar of what is alive at the peak, by term group."""
    bars = [(f"{est.model.name} ({est.peak_phase})", est.components.groups(depth))]
    cap = est.gpu.memory_bytes if est.gpu is not None else None
    return _bars(bars, path, title=f"{est.model.name}: memory at the peak", capacity_bytes=cap)


def plot_compare(rows, path: str, *, capacity_bytes: int | None = None, depth: int = 1) -> str:
    """One stacked bar per `compare` row that has an estimate."""
    bars = [(r.strategy.name, r.estimate.components.groups(depth)) for r in rows if r.estimate is not None]
    return _bars(bars, path, title="strategies side by side (allocated at the peak)", capacity_bytes=capacity_bytes)


def plot_sweep(points: list[tuple[int, int]], path: str, *, name: str, capacity_bytes: int | None = None) -> str:
    """Device memory against micro-batch or sequence length, with the capacity line."""
    fmt = _format(path)
    if fmt == "html":
        return _write(path, _page(f"device memory against {name}", _sweep_svg(points, name, capacity_bytes)))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([p[0] for p in points], [p[1] / GiB for p in points], marker="o", label="device memory")
    for v, b in points:
        ax.annotate(f"{b / GiB:.1f}", (v, b / GiB), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=8)
    _capacity_line(ax, capacity_bytes, max([b for _, b in points] + [0]))
    ax.set_xlabel(name)
    ax.set_ylabel("GiB")
    ax.legend()
    return _save(fig, plt, path)


def _capacity_line(ax, capacity_bytes: int | None, top_bytes: int) -> None:
    """The GPU's capacity as a dashed line with its value, inside the y range even when
    every bar is far below it."""
    top = max(top_bytes, capacity_bytes or 0) / GiB
    ax.set_ylim(0, top * 1.15 if top else 1)
    if capacity_bytes:
        cap = capacity_bytes / GiB
        ax.axhline(cap, color="#c00", linestyle="--", linewidth=1.5, label=f"capacity {cap:.2f} GiB", zorder=5)
        ax.text(1.0, cap, f" {cap:.2f} GiB", color="#c00", fontsize=8, va="bottom", ha="right",
                transform=ax.get_yaxis_transform())


# ------------------------------------------------------------------ matplotlib
def _format(path: str) -> str:
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext not in ("png", "svg", "html", "htm"):
        from vramplan.spec import SpecError
        raise SpecError("plot", f"{path}: choose a .png, .svg or .html file")
    return "html" if ext in ("html", "htm") else ext


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from vramplan.spec import SpecError
        raise SpecError("plot", "matplotlib is not installed: pip install 'vramplan[plot]', "
                        "or write .html (no dependency)") from None
    return plt


def _save(fig, plt, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _groups_in_order(bars: Bars) -> list[str]:
    seen: dict[str, None] = {}
    for _, groups in bars:
        for g in groups:
            seen.setdefault(g, None)
    return list(seen)


def _bars(bars: Bars, path: str, *, title: str, capacity_bytes: int | None) -> str:
    fmt = _format(path)
    if fmt == "html":
        return _write(path, _page(title, _bars_svg(bars, capacity_bytes)))
    plt = _pyplot()
    fig, _ = bars_figure(plt, bars, title=title, capacity_bytes=capacity_bytes)
    return _save(fig, plt, path)


def bars_figure(plt, bars: Bars, *, title: str, capacity_bytes: int | None):
    """The stacked bars with each block's GiB inside it (when tall enough to read), each
    bar's total on top, and the capacity line with its value."""
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(bars) + 3), 5))
    bottoms = [0.0] * len(bars)
    totals = [sum(g.values()) / GiB for _, g in bars]
    for i, group in enumerate(_groups_in_order(bars)):
        heights = [g.get(group, 0) / GiB for _, g in bars]
        blocks = ax.bar(range(len(bars)), heights, bottom=bottoms, label=group, color=PALETTE[i % len(PALETTE)])
        readable = 0.06 * max(totals + [(capacity_bytes or 0) / GiB])
        ax.bar_label(blocks, labels=[f"{h:.1f}" if h >= readable else "" for h in heights],
                     label_type="center", fontsize=8, color="white")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for i, total in enumerate(totals):
        ax.text(i, total, f"{total:.2f}", ha="center", va="bottom", fontsize=9, fontweight="bold")
    _capacity_line(ax, capacity_bytes, max(sum(g.values()) for _, g in bars) if bars else 0)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=30, ha="right")
    ax.set_ylabel("GiB")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return fig, ax


# ------------------------------------------------------------------ HTML (inline SVG)
W, H, LEFT, BOTTOM, TOP = 860, 460, 70, 120, 30


def _write(path: str, text: str) -> str:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path


def _page(title: str, svg: str) -> str:
    t = html.escape(title)
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{t}</title>
<style>body{{font-family:sans-serif;margin:20px}} rect.term:hover{{opacity:.7}}
.legend span{{cursor:pointer;margin-right:12px}} .legend span.off{{opacity:.35}}</style></head>
<body><h3>{t}</h3>{svg}
<p>Hover a block for its size; click a legend entry to hide or show that group. Sizes in GiB (2^30 bytes).</p>
<script>
document.querySelectorAll('.legend span').forEach(function(el){{
  el.addEventListener('click', function(){{
    el.classList.toggle('off');
    var hide = el.classList.contains('off');
    document.querySelectorAll('rect[data-group="' + el.dataset.group + '"]').forEach(function(r){{
      r.style.display = hide ? 'none' : '';
    }});
  }});
}});
</script></body></html>
"""


def _scale(top_bytes: float):
    top = max(top_bytes, 1) * 1.1
    return lambda b: TOP + (H - BOTTOM - TOP) * (1 - b / top), top


def _axis(y, top: float) -> list[str]:
    out = [f'<line x1="{LEFT}" y1="{y(0):.1f}" x2="{W - 20}" y2="{y(0):.1f}" stroke="#333"/>']
    for i in range(6):
        b = top * i / 5
        out.append(f'<text x="{LEFT - 6}" y="{y(b) + 4:.1f}" text-anchor="end" font-size="11">'
                   f'{b / GiB:.1f}</text>')
    out.append(f'<text x="14" y="{TOP + 10}" font-size="11">GiB</text>')
    return out


def _capacity(y, capacity_bytes: int | None) -> list[str]:
    if not capacity_bytes:
        return []
    cy = y(capacity_bytes)
    return [f'<line x1="{LEFT}" y1="{cy:.1f}" x2="{W - 20}" y2="{cy:.1f}" stroke="#c00" stroke-dasharray="6,4"/>',
            f'<text x="{W - 22}" y="{cy - 4:.1f}" text-anchor="end" font-size="11" fill="#c00">'
            f'capacity {capacity_bytes / GiB:.2f} GiB</text>']


def _bars_svg(bars: Bars, capacity_bytes: int | None) -> str:
    groups = _groups_in_order(bars)
    color = {g: PALETTE[i % len(PALETTE)] for i, g in enumerate(groups)}
    y, top = _scale(max([sum(g.values()) for _, g in bars] + [capacity_bytes or 0]))
    slot = (W - LEFT - 20) / max(1, len(bars))
    parts = _axis(y, top)
    for i, (label, sizes) in enumerate(bars):
        x, base = LEFT + i * slot + slot * 0.15, 0
        for g in groups:
            b = sizes.get(g, 0)
            if not b:
                continue
            tip = html.escape(f"{label} | {g}: {b / GiB:.3f} GiB ({b:,} bytes)")
            parts.append(f'<rect class="term" data-group="{html.escape(g)}" x="{x:.1f}" y="{y(base + b):.1f}" '
                         f'width="{slot * 0.7:.1f}" height="{y(base) - y(base + b):.1f}" fill="{color[g]}">'
                         f'<title>{tip}</title></rect>')
            if y(base) - y(base + b) >= 14:  # the block's size inside it, where it can be read
                parts.append(f'<text x="{x + slot * 0.35:.1f}" y="{(y(base) + y(base + b)) / 2 + 4:.1f}" '
                             f'font-size="10" fill="#fff" text-anchor="middle" pointer-events="none">'
                             f'{b / GiB:.1f}</text>')
            base += b
        cx = x + slot * 0.35
        parts.append(f'<text x="{cx:.1f}" y="{H - BOTTOM + 14}" font-size="11" text-anchor="end" '
                     f'transform="rotate(-30 {cx:.1f} {H - BOTTOM + 14})">{html.escape(label)}</text>')
        parts.append(f'<text x="{cx:.1f}" y="{y(base) - 4:.1f}" font-size="10" text-anchor="middle">'
                     f'{base / GiB:.1f}</text>')
    parts += _capacity(y, capacity_bytes)
    legend = "".join(f'<span data-group="{html.escape(g)}"><b style="color:{color[g]}">&#9632;</b> '
                     f'{html.escape(g)}</span>' for g in groups)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}">' + "".join(parts)
            + f'</svg><div class="legend">{legend}</div>')


def _sweep_svg(points: list[tuple[int, int]], name: str, capacity_bytes: int | None) -> str:
    y, top = _scale(max([b for _, b in points] + [capacity_bytes or 0]))
    xs = [p[0] for p in points] or [0]
    lo, hi = min(xs), max(xs)
    x = lambda v: LEFT + (W - LEFT - 40) * ((v - lo) / (hi - lo) if hi > lo else 0.5)  # noqa: E731
    parts = _axis(y, top)
    path = " ".join(f"{'M' if i == 0 else 'L'}{x(v):.1f},{y(b):.1f}" for i, (v, b) in enumerate(points))
    parts.append(f'<path d="{path}" fill="none" stroke="{PALETTE[0]}" stroke-width="2"/>')
    for v, b in points:
        over = capacity_bytes is not None and b > capacity_bytes
        parts.append(f'<circle cx="{x(v):.1f}" cy="{y(b):.1f}" r="4" fill="{"#c00" if over else PALETTE[0]}">'
                     f'<title>{html.escape(name)} = {v}: {b / GiB:.3f} GiB</title></circle>')
        parts.append(f'<text x="{x(v):.1f}" y="{H - BOTTOM + 16}" font-size="10" text-anchor="middle">{v}</text>')
    parts.append(f'<text x="{W / 2:.0f}" y="{H - BOTTOM + 40}" font-size="12" text-anchor="middle">'
                 f'{html.escape(name)}</text>')
    parts += _capacity(y, capacity_bytes)
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}">' + "".join(parts) + "</svg>"

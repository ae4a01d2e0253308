"""One table, four renderings: rich (terminal), Markdown, CSV and HTML (notebooks).

A Tabular holds typed cells (numbers stay numbers) so CSV gets plain `1234.56` while the
terminal and Markdown get `1,234.56`. The estimate, compare and fit answers build their
Tabular here; the CLI only picks the rendering.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field

from vramplan.i18n import _
from vramplan.units import GB, GiB

FORMATS = ("table", "json", "markdown", "csv")


@dataclass(slots=True)
class Tabular:
    title: str
    columns: list[str]
    rows: list[list] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Lines under the table (verdict, phases, advice); CSV leaves them out."""

    def to_markdown(self) -> str:
        out = [f"**{_md(self.title)}**", "", "| " + " | ".join(_md(c) for c in self.columns) + " |",
               "|" + "|".join(":---" if i == 0 else "---:" for i in range(len(self.columns))) + "|"]
        out += ["| " + " | ".join(_md(_cell(v)) for v in row) + " |" for row in self.rows]
        if self.notes:
            out += [""] + [f"- {_md(n)}" for n in self.notes]
        return "\n".join(out) + "\n"

    def to_csv(self) -> str:
        import csv  # here: the CLI's startup loads this module for FORMATS alone
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(self.columns)
        for row in self.rows:
            writer.writerow([_cell(v, plain=True) for v in row])
        return buf.getvalue()

    def to_html(self) -> str:
        import html
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        right = ' style="text-align:right"'
        body = "".join("<tr>" + "".join(f"<td{'' if i == 0 else right}>{html.escape(_cell(v))}</td>"
                                        for i, v in enumerate(row)) + "</tr>" for row in self.rows)
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        return (f"<div><p><b>{html.escape(self.title)}</b></p><table><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table>{f'<ul>{notes}</ul>' if notes else ''}</div>")

    def print_rich(self, console=None) -> None:
        import sys

        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
        console = console or (Console() if sys.stdout.isatty() else Console(width=160))
        table = Table(title=escape(self.title), title_justify="left")
        for i, col in enumerate(self.columns):
            table.add_column(escape(col), justify="left" if i == 0 else "right")
        for row in self.rows:
            table.add_row(*(escape(_cell(v)) for v in row))
        console.print(table)
        for note in self.notes:
            console.print(escape(note), soft_wrap=True)

    def render(self, fmt: str) -> str | None:
        """Markdown or CSV text; None for `table` (print_rich prints it)."""
        return {"markdown": self.to_markdown, "csv": self.to_csv}[fmt]() if fmt in ("markdown", "csv") else None


def _cell(value, plain: bool = False) -> str:
    if value is None:
        return "" if plain else "-"
    if isinstance(value, bool):
        return _("yes") if value else _("NO")
    if isinstance(value, float):
        return f"{value:.4g}" if plain and abs(value) < 1e-2 and value else (f"{value:.2f}" if plain else f"{value:,.2f}")
    if isinstance(value, int):
        return str(value) if plain else f"{value:,}"
    return str(value)


def _md(text: str) -> str:
    return str(text).replace("|", "\\|")


def gib(n: int | None) -> float | None:
    return None if n is None else n / GiB


def gb(n: int | None) -> float | None:
    return None if n is None else n / GB

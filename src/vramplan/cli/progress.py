"""Progress on stderr for the commands that take seconds (measure, fit's search): rich bars,
shown only on a terminal and never with JSON output, so pipes and scripts see nothing."""
from __future__ import annotations

import contextlib
import sys

from vramplan.i18n import _


def progress_wanted(args) -> bool:
    from vramplan.cli.flags import answer_format
    return sys.stderr.isatty() and answer_format(args) != "json"


def _progress(transient: bool = True):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=transient)


class SearchProgress:
    """fit(progress=...) callback: (layouts settled, layouts in all, fitting so far)."""

    def __init__(self):
        self._bar = _progress()
        self._task = None

    def __enter__(self):
        self._bar.start()
        return self

    def __exit__(self, *exc):
        self._bar.stop()

    def __call__(self, done: int, total: int, found: int) -> None:
        if self._task is None:
            self._task = self._bar.add_task(_("fit: layouts"), total=total)
        self._bar.update(self._task, completed=done, description=_("fit: {found} fitting so far (Ctrl-C: best so far)").format(found=found))
        # Draw now rather than at the next tick of rich's refresh thread: a search that
        # settles its layouts between two ticks would otherwise never show its count.
        self._bar.refresh()


@contextlib.contextmanager
def stages(enabled: bool, names: list[str]):
    """A bar over named stages; yields `step(name)` to call as each stage starts."""
    if not enabled:
        yield lambda name: None
        return
    bar = _progress()
    task = bar.add_task(names[0], total=len(names))
    seen: list[str] = []

    def step(name: str) -> None:
        if seen:
            bar.advance(task)
        seen.append(name)
        bar.update(task, description=name)

    with bar:
        yield step
        bar.update(task, completed=len(names))

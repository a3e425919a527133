"""Progress bars for long work (rich): training with loss and rate, and generic task bars.

Kept apart from the library math so that importing fedvox stays light and quiet.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class _Bar:
    def __init__(self, progress: Progress | None, task: int | None):
        self.progress = progress
        self.task = task
        self._ema: float | None = None

    def update(self, loss: float, rate: float) -> None:
        self._ema = loss if self._ema is None else 0.95 * self._ema + 0.05 * loss
        if self.progress is not None and self.task is not None:
            self.progress.update(
                self.task, advance=1, loss=f"{self._ema:.3f}", rate=f"{rate:.0f} utt/s"
            )


@contextmanager
def training_progress(total: int, done: int, enabled: bool = True) -> Iterator[_Bar]:
    """A bar showing steps, smoothed loss and utterances per second."""
    if not enabled:
        yield _Bar(None, None)
        return
    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with progress:
        task = progress.add_task("train", total=total, completed=done, loss="-", rate="-")
        yield _Bar(progress, task)


@contextmanager
def task_progress(description: str, total: int, enabled: bool = True) -> Iterator:
    """A plain bar; yields a function to call with the number of items done."""
    if not enabled:
        yield lambda n=1: None
        return
    progress = Progress(
        TextColumn(f"[bold]{description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.update(task, advance=n)

"""A rich progress bar for training loops: step count, loss, speed and memory per stage.

Shared by ``torchspan demo`` and ``torchspan run``.

Usage::

    with TrainingProgress(console, total=steps, speed_unit="samples/s") as bar:
        for step in range(steps):
            loss = spanned.train_step(x, y, loss_fn)
            bar.step(loss=float(loss), speed=batch * (step + 1) / elapsed, memory=spanned.memory(opt))
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from . import pictures

__all__ = ["TrainingProgress", "memory_text", "short_bytes"]


def short_bytes(n: float) -> str:
    """A compact byte count for tight columns: ``512B``, ``7.4M``, ``1.2G``."""
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}G"  # pragma: no cover


def memory_text(memory: Any) -> str:
    """Memory per lane in one short line, e.g. ``mem s0 cpu 7.4M  s1 cpu 7.2M`` (``-`` if unreadable).

    ``memory``: ``spanned.memory(optimizer)`` or anything ``pictures.normalize_memory`` accepts.
    """
    try:
        rows = pictures.normalize_memory(memory)
    except ValueError:
        return "-"
    parts = []
    for label, kinds in rows.items():
        short = label.replace("stage ", "s").replace("\n", " ")
        parts.append(f"{short} {short_bytes(sum(kinds.values()))}")
    return "mem " + "  ".join(parts)


class TrainingProgress:
    """A context manager around ``rich.progress.Progress`` with loss, speed and memory columns.

    ``speed_unit`` labels the speed column (``"tok/s"``, ``"samples/s"``). Each :meth:`step`
    advances the bar by one; the memory column keeps its last value when ``memory`` is ``None``.
    """

    def __init__(
        self, console: Console, total: int, *, speed_unit: str = "samples/s", label: str = "training"
    ) -> None:
        self._progress = Progress(
            TextColumn(
                "{task.description}", style="bold", markup=False
            ),  # the label as given, brackets and braces too
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}", markup=False),
            TextColumn(
                "{task.fields[speed]} " + speed_unit.replace("{", "{{").replace("}", "}}"), markup=False
            ),
            TextColumn("{task.fields[mem]}", markup=False),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._task = self._progress.add_task(label, total=total, loss="-", speed="-", mem="-")

    def __enter__(self) -> TrainingProgress:
        self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._progress.stop()

    def step(self, *, loss: float, speed: float, memory: Any = None) -> None:
        """Advance one step showing ``loss``, ``speed`` (per second) and, when given, ``memory``."""
        fields = {"loss": f"{loss:.3f}", "speed": f"{speed:,.0f}"}
        if memory is not None:
            fields["mem"] = memory_text(memory)
        self._progress.update(self._task, advance=1, **fields)

"""The report page: the pictures and ``report.md`` (summary, pictures, plan and device tables) in a folder.

Usage: ``write_report("torchspan-demo", plan=plan, events=spanned.timeline(), losses=losses)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..files import output_folder, write_text
from ..runtime.record import Event
from .loss import loss_png
from .memory import memory_png
from .tables import DEVICE_COLUMNS, PLAN_COLUMNS, device_rows, md_table, plan_caption, plan_rows
from .timeline import timeline_png

if TYPE_CHECKING:  # pragma: no cover
    from ..hardware import Device
    from ..planner.plans import Plan

__all__ = ["ReportFiles", "write_report"]


@dataclass
class ReportFiles:
    """Paths written by :func:`write_report` (``None`` where the input was not given)."""

    report: Path
    timeline: Path | None = None
    memory: Path | None = None
    loss: Path | None = None
    extra: dict[str, Path] = field(default_factory=dict)


def _plan_section(plan: Plan) -> list[str]:
    lines = ["## Plan", ""] + [
        part for line in plan_caption(plan).splitlines() for part in (line, "")
    ]  # runner-up within noise too
    lines += md_table(PLAN_COLUMNS, plan_rows(plan))
    lines += [f"- note: {n}" for n in plan.notes]
    return lines + [""]


def _devices_section(devs: Sequence[Device]) -> list[str]:
    return ["## Devices", "", *md_table(DEVICE_COLUMNS, device_rows(devs)), ""]


def write_report(
    out_dir: str | os.PathLike[str],
    *,
    title: str = "torchspan run",
    plan: Plan | None = None,
    devices: Sequence[Device] | None = None,
    events: Iterable[Event] | None = None,
    memory: Any = None,
    losses: Sequence[float] | None = None,
    budgets: Mapping[str, int | None] | None = None,
    summary: Mapping[str, Any] | None = None,
    sections: Sequence[tuple[str, Sequence[str]]] = (),
    sample: str | None = None,
) -> ReportFiles:
    """Write the pictures and ``report.md`` (pictures, plan table, device table) into ``out_dir``.

    Each picture is drawn when its input is given: ``events`` → ``timeline.png``, ``memory`` →
    ``memory.png``, ``losses`` → ``loss.png``. ``summary`` adds a key/value table; ``sections``
    ``(title, markdown lines)`` pairs after it (what ran and why); ``sample`` a text block. Usage:
    ``write_report("torchspan-demo", plan=plan, events=spanned.timeline(), losses=losses)``.
    """
    out = output_folder(
        out_dir,
        name="out_dir",
        files=("report.md", "loss.png", "timeline.png", "memory.png"),
        example="report",
    )
    out.mkdir(parents=True, exist_ok=True)
    files = ReportFiles(report=out / "report.md")
    if losses is not None:
        files.loss = loss_png(losses, out / "loss.png")
    if events is not None:
        files.timeline = timeline_png(events, out / "timeline.png")
    if memory is not None:
        files.memory = memory_png(memory, out / "memory.png", budgets=budgets)

    lines = [f"# {title}", ""]
    if summary:
        lines += md_table(("", ""), ((str(k), str(v)) for k, v in summary.items())) + [""]
    for heading, body in sections:
        lines += [f"## {heading}", "", *body, ""]
    if files.loss:
        lines += ["## Loss", "", f"![loss curve]({files.loss.name})", ""]
    if files.timeline:
        lines += [
            "## Pipeline timeline (last step)",
            "",
            "One lane per stage and device; blue forward, orange backward, red weight gradients "
            "(zero-bubble, merged-weights), grey transfer, hatched recompute; numbers are micro-batches.",
            "",
            f"![pipeline timeline]({files.timeline.name})",
            "",
        ]
    if files.memory:
        lines += ["## Memory per device", "", f"![memory per device]({files.memory.name})", ""]
    if plan is not None:
        lines += _plan_section(plan)
    if devices:
        lines += _devices_section(devices)
    if sample is not None:
        fence = "```"
        while fence in sample:
            fence += "`"
        lines += ["## Sample", "", fence + "text", sample, fence, ""]
    write_text(files.report, "\n".join(lines), name="out_dir")
    return files

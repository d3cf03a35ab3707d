"""Pictures of what happened: pipeline timeline, memory per device, loss curve, and a report page.

Modules: ``timeline``, ``memory``, ``loss`` (one picture each), ``events`` (timeline checks),
``tables`` (plan and device rows), ``page`` (``report.md`` with the pictures), ``canvas``
(matplotlib's headless Agg backend, so everything draws on machines without a display).

Usage::

    from torchspan import pictures
    pictures.timeline_png(spanned.timeline(), "timeline.png")
    pictures.memory_png(spanned.memory(), "memory.png", budgets={"cpu": 2**30})
    pictures.loss_png(losses, "loss.png")
    pictures.write_report("out/", plan=plan, devices=devs, events=spanned.timeline(),
                          memory=spanned.memory(), losses=losses)
"""

from __future__ import annotations

from .events import timeline_problems
from .loss import loss_png
from .memory import MEMORY_KINDS, memory_png, normalize_memory
from .page import ReportFiles, write_report
from .tables import DEVICE_COLUMNS, PLAN_COLUMNS, device_rows, plan_caption, plan_rows, plan_summary
from .timeline import timeline_png

__all__ = [
    "timeline_png",
    "memory_png",
    "loss_png",
    "write_report",
    "timeline_problems",
    "normalize_memory",
    "MEMORY_KINDS",
    "ReportFiles",
    "plan_rows",
    "plan_summary",
    "plan_caption",
    "device_rows",
    "PLAN_COLUMNS",
    "DEVICE_COLUMNS",
]

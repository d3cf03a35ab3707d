"""A plan and the devices as rows of text: shared by the report page, ``torchspan devices|run`` and the demo.

Usage: ``for row in plan_rows(plan): table.add_row(*row)`` (columns ``PLAN_COLUMNS``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..hardware import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from ..hardware import Device
    from ..planner.plans import Plan

__all__ = [
    "PLAN_COLUMNS",
    "DEVICE_COLUMNS",
    "plan_summary",
    "plan_caption",
    "plan_rows",
    "device_rows",
    "md_table",
]


def md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table: the header, a rule, one line per row (``|`` escaped, newlines flattened)."""

    def cell(v: str) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines.extend("| " + " | ".join(cell(c) for c in r) + " |" for r in rows)
    return lines


PLAN_COLUMNS = ("stage", "device", "layers", "params", "grads", "optim", "activ.", "fwd ms", "bwd ms")
DEVICE_COLUMNS = ("device", "name", "total", "free", "budget")


def plan_summary(plan: Plan) -> str:
    """One line: stages, micro-batches, schedule, recompute and predicted step time."""
    head = (
        f"{len(plan.stages)} stage(s), {plan.microbatches} micro-batch(es), schedule {plan.schedule}, "
        f"recompute {plan.recompute}"
    )
    if plan.predicted_step_time is not None:
        head += f", predicted step {plan.predicted_step_time * 1e3:.1f} ms"
    return head


def plan_caption(plan: Plan) -> str:
    """``plan_summary`` and, on a second line, the runner-up when another device order was predicted within
    measurement noise (``Plan.runner_up_text``): what a plan table shows under it."""
    runner_up = plan.runner_up_text()
    return plan_summary(plan) + (f"\n{runner_up}" if runner_up else "")


def plan_rows(plan: Plan) -> list[tuple[str, ...]]:
    """One row of text per stage, in ``PLAN_COLUMNS`` order (for Markdown and rich tables)."""
    rows = []
    for i, s in enumerate(plan.stages):
        names = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]} ({len(s.layers)})"
        rows.append(
            (
                str(i),
                s.device,
                names,
                format_bytes(s.param_bytes),
                format_bytes(s.grad_bytes),
                format_bytes(s.optimizer_bytes),
                format_bytes(s.activation_bytes),
                f"{s.forward_time * 1e3:.2f}",
                f"{s.backward_time * 1e3:.2f}",
            )
        )
    return rows


def device_rows(devs: Sequence[Device]) -> list[tuple[str, ...]]:
    """One row of text per device, in ``DEVICE_COLUMNS`` order."""
    return [
        (
            str(d.device),
            d.name,
            format_bytes(d.total_memory),
            format_bytes(d.free_memory),
            format_bytes(d.budget),
        )
        for d in devs
    ]

"""The demo's plan: ``torchspan.plan``'s choice, spread over every listed device when asked.

On a machine whose listed devices share the same cores (``--devices cpu,cpu``) the planner rightly
keeps the whole model on one of them: a pipeline cannot be faster there. The demo exists to show
the pipeline, so when several devices are listed it also finds, with the planner's own cost model,
the fastest placement that uses every one of them in the order given, runs that, and says in the
plan's notes what the planner alone chose and what each is predicted to cost.

Usage: ``plan = demo_plan(model, example, devs, spread=True)``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..hardware import Device
from ..planner import search
from ..planner.plans import Plan
from ..planner.spread import spread_plan
from ..profiler import profile

__all__ = ["demo_plan"]


def demo_plan(
    model: nn.Module,
    example: Any,
    devs: list[Device],
    *,
    spread: bool,
    microbatches: int | str = "auto",
    schedule: str = "auto",
    optimizer: str = "adam",
) -> Plan:
    """``torchspan.plan``'s plan for ``devs``; with ``spread`` and fewer stages than devices, one using them all."""
    prof = profile(model, example, devs, optimizer=optimizer)
    chosen = search(prof, microbatches=microbatches, schedule=schedule)
    if not spread or len(chosen.stages) >= len(devs):
        return chosen
    wide = spread_plan(prof, microbatches=microbatches, schedule=schedule)
    if wide is None:
        chosen.notes.append(f"demo: no placement over all {len(devs)} listed devices fits their budgets; running the planner's choice")
        return chosen
    ms = lambda p: f"{p.predicted_step_time * 1e3:.1f} ms" if p.predicted_step_time is not None else "?"
    wide.notes.append(
        f"demo: spread over all {len(devs)} listed devices to show the pipeline (predicted {ms(wide)} per step); "
        f"torchspan.plan alone keeps {len(chosen.stages)} stage(s) (predicted {ms(chosen)}) because these devices share cores"
        if len({str(d.device) for d in devs}) < len(devs)
        else f"demo: spread over all {len(devs)} listed devices (predicted {ms(wide)} per step); "
        f"torchspan.plan alone picks {len(chosen.stages)} stage(s) (predicted {ms(chosen)})"
    )
    return wide

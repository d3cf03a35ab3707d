"""The demo's plan: ``torchspan.plan``'s choice, spread over every listed device when asked.

On a machine whose listed devices share the same cores (``--devices cpu,cpu``) the planner rightly
keeps the whole model on one of them: a pipeline cannot be faster there. The demo exists to show
the pipeline, so when several devices are listed it also finds, with the planner's own cost model,
the fastest placement that uses every one of them in the order given, runs that, and says in the
plan's notes what the planner alone chose and what each is predicted to cost.

``gpu_machine`` answers "what would a GPU machine do instead" from the planner: the same model and
batch planned for two catalog GPUs (described, times estimated), as ``torchspan demo`` would there.

Usage: ``placement = demo_plan(model, example, devs, spread=True)``; ``placement.plan`` runs,
``placement.chosen`` is ``torchspan.plan``'s own choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..hardware import Device
from ..hardware import devices as find_devices
from ..planner import search
from ..planner.plans import Plan
from ..planner.spread import spread_plan
from ..profiler import profile

__all__ = ["Placement", "demo_plan", "gpu_machine", "GPU_MACHINE", "ms"]

GPU_MACHINE = (
    "a100-80gb*2"  # the GPU machine the demo describes where it finds none (torchspan.hardware's catalog)
)


@dataclass
class Placement:
    """The plan the demo runs and ``torchspan.plan``'s own choice for the same devices (the same object unless
    spread)."""

    plan: Plan
    chosen: Plan

    @property
    def spread(self) -> bool:
        """True when the demo runs a placement over every device that the planner alone would not."""
        return self.plan is not self.chosen


def ms(plan: Plan) -> str:
    """The plan's predicted step time in milliseconds, or ``?``."""
    return f"{plan.predicted_step_time * 1e3:.1f} ms" if plan.predicted_step_time is not None else "?"


def demo_plan(
    model: nn.Module,
    example: Any,
    devs: list[Device],
    *,
    spread: bool,
    microbatches: int | str = "auto",
    schedule: str = "auto",
    optimizer: str = "adam",
    measure: bool = True,
) -> Placement:
    """``torchspan.plan``'s plan for ``devs``; with ``spread`` and fewer stages than devices, one using them
    all."""
    prof = profile(model, example, devs, optimizer=optimizer, measure=measure)
    chosen = search(prof, microbatches=microbatches, schedule=schedule)
    if not spread or len(chosen.stages) >= len(devs):
        return Placement(chosen, chosen)
    wide = spread_plan(prof, microbatches=microbatches, schedule=schedule)
    if wide is None:
        chosen.notes.append(
            f"demo: no placement over all {len(devs)} listed devices fits their budgets; running the "
            "planner's choice"
        )
        return Placement(chosen, chosen)
    wide.notes.append(
        f"demo: spread over all {len(devs)} listed devices to show the pipeline (predicted {ms(wide)} per "
        f"step); torchspan.plan alone keeps {len(chosen.stages)} stage(s) (predicted {ms(chosen)}) because "
        "these devices share cores"
        if len({str(d.device) for d in devs}) < len(devs)
        else f"demo: spread over all {len(devs)} listed devices (predicted {ms(wide)} per step); "
        f"torchspan.plan alone picks {len(chosen.stages)} stage(s) (predicted {ms(chosen)})"
    )
    return Placement(wide, chosen)


def gpu_machine(
    model: nn.Module, example: Any, *, microbatches: int | str = "auto", schedule: str = "auto"
) -> str:
    """One paragraph: what ``torchspan demo`` would run on a machine with two GPUs (``GPU_MACHINE``), from the
    planner.

    The GPUs are described from the catalog (nothing runs on them; their times are estimated from FLOPs), and
    the demo's own rule applies: the planner's choice, spread over both GPUs when it keeps one stage.
    """
    gpus = find_devices(GPU_MACHINE)
    placement = demo_plan(
        model, example, gpus, spread=True, microbatches=microbatches, schedule=schedule, measure=False
    )
    chosen, ran = placement.chosen, placement.plan
    name = gpus[0].name.replace(" (described)", "")
    where = lambda p: ", ".join(dict.fromkeys(str(s.device) for s in p.stages))
    text = (
        f"On a machine with GPUs, torchspan demo plans over them instead. For two {name} (described from "
        f"torchspan's catalog, times estimated), torchspan.plan puts this model on {where(chosen)}, "
        f"{'one stage' if len(chosen.stages) == 1 else f'{len(chosen.stages)} stages'} (predicted "
        f"{ms(chosen)} per step)"
    )
    if placement.spread:
        text += (
            f", so the demo runs it as a {len(ran.stages)}-stage pipeline over {where(ran)} "
            f"({ran.microbatches} micro-batches, {ran.schedule}; predicted {ms(ran)} per step) and checks "
            f"its gradients against {ran.stages[0].device} alone"
        )
    return (
        text + ". With one GPU it spans the GPU and the CPU; a model too big for one GPU the planner splits "
        "itself."
    )

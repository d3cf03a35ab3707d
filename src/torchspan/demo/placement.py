"""The demo's plan: ``torchspan.plan``'s choice, spread over every listed device when asked.

On a machine whose listed devices share the same cores (``--devices cpu,cpu``) the planner rightly
keeps the whole model on one of them: a pipeline cannot be faster there. The demo exists to show
the pipeline, so when several devices are listed it also finds, with the planner's own cost model,
the fastest placement that uses every one of them in the order given, runs that, and says in the
plan's notes what the planner alone chose and what each is predicted to cost.

Usage: ``plan = demo_plan(model, example, devs, spread=True)``.
"""

from __future__ import annotations

import itertools
from typing import Any

from torch import nn

from ..hardware import Device
from ..planner.cost import CostModel, Stage, time_tables
from ..planner.plans import Plan
from ..planner.optimize import search, settings_grid
from ..profiler import Profile, profile

__all__ = ["demo_plan", "spread_plan"]


def spread_plan(prof: Profile, *, microbatches: int | str = "auto", schedule: str = "auto", checkpoint: str = "auto") -> Plan | None:
    """The fastest fitting plan with one stage on each of ``prof.devices``, in order; ``None`` if none fits.

    Exhaustive over contiguous cuts and the planner's settings grid, scored by ``CostModel`` (the
    demo's models have a handful of layers, so this is small). With ``microbatches="auto"`` only
    counts of at least two per device are considered, so the result is a real pipeline.
    """
    n_layers, n_devs = len(prof.layers), len(prof.devices)
    if n_devs < 2 or n_layers < n_devs:
        return None
    settings = settings_grid(prof.batch_size, microbatches, schedule, checkpoint)
    if microbatches == "auto":
        # A pipeline shows (and pays off) only with at least two micro-batches per stage in flight.
        piped = [st for st in settings if st[0] >= 2 * n_devs]
        settings = piped or settings
    tables = time_tables(prof)
    models = [CostModel(prof, m, s, c, tables) for m, s, c in settings]
    fitting: list[tuple[float, float, CostModel, Any]] = []
    for cuts in itertools.combinations(range(1, n_layers), n_devs - 1):
        bounds = (0, *cuts, n_layers)
        stages = [Stage(d, bounds[d], bounds[d + 1]) for d in range(n_devs)]
        for cm in models:
            ev = cm.evaluate(stages)
            if ev.fits:
                fitting.append((ev.step_time, _slowest_stage(prof, bounds, cm.M), cm, ev))
    if not fitting:
        return None
    # Stages sharing one device cost the same however the layers are cut; among plans within 2% of
    # the fastest, take the most balanced one (slowest stage fastest): the one that pipelines on
    # separate devices, and the one whose timeline shows a pipeline.
    fastest = min(f[0] for f in fitting)
    _, _, cm, ev = min((f for f in fitting if f[0] <= fastest * 1.02), key=lambda f: (f[1], f[0]))
    return cm.to_plan(ev, "torchspan")


def _slowest_stage(prof: Profile, bounds: tuple[int, ...], microbatches: int) -> float:
    """The slowest stage's share of all stages' forward+backward time (1/stages when balanced)."""
    samples = prof.batch_size / microbatches
    times = [
        sum(lay.forward_seconds(d, samples) + lay.backward_seconds(d, samples) for lay in prof.layers[bounds[d] : bounds[d + 1]])
        for d in range(len(bounds) - 1)
    ]
    return max(times) / sum(times) if sum(times) > 0 else 1.0


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

"""A plan that uses every listed device: the fastest fitting one-stage-per-device placement, in order.

On a machine whose listed devices share the same cores (``cpu,cpu``) the search rightly keeps the
whole model on one of them; a demo, or a user measuring a real pipeline, wants one stage on each
device anyway. ``spread_plan`` finds, with the planner's own cost model, the fastest such
placement that fits the budgets.

Usage: ``plan = spread_plan(profile, microbatches="auto")`` (``None`` when nothing fits).
"""

from __future__ import annotations

import itertools

from ..profiler.costs import Profile
from .cost import CostModel, time_tables
from .plans import Plan
from .settings import settings_grid
from .stages import Evaluation, Stage

__all__ = ["spread_plan"]


def spread_plan(
    prof: Profile, *, microbatches: int | str = "auto", schedule: str = "auto", recompute: str = "auto"
) -> Plan | None:
    """The fastest fitting plan with one stage on each of ``prof.devices``, in order; ``None`` if none fits.

    Exhaustive over contiguous cuts and the planner's settings grid, scored by ``CostModel`` (the
    demo's models have a handful of layers, so this is small). With ``microbatches="auto"`` only
    counts of at least two per device are considered, so the result is a real pipeline.
    """
    n_layers, n_devs = len(prof.layers), len(prof.devices)
    if n_devs < 2 or n_layers < n_devs:
        return None
    settings = settings_grid(prof.batch_size, microbatches, schedule, recompute)
    if microbatches == "auto":
        # A pipeline shows (and pays off) only with at least two micro-batches per stage in flight.
        piped = [st for st in settings if st[0] >= 2 * n_devs]
        settings = piped or settings
    tables = time_tables(prof)
    models = [CostModel(prof, m, s, c, tables) for m, s, c in settings]
    fitting: list[tuple[float, float, tuple[int, ...], CostModel, Evaluation]] = []
    for cuts in itertools.combinations(range(1, n_layers), n_devs - 1):
        bounds = (0, *cuts, n_layers)
        stages = [Stage(d, bounds[d], bounds[d + 1]) for d in range(n_devs)]
        for cm in models:
            ev = cm.evaluate(stages)
            if ev.fits:
                fitting.append((ev.step_time, _slowest_stage(prof, bounds, cm.M), bounds, cm, ev))
    if not fitting:
        return None
    # Stages sharing one device (``cpu,cpu``) cost the same however the layers are cut, up to the cost
    # model's small terms (which move with the CPU speed measured under load): take the most balanced cut
    # (slowest stage fastest), the one whose timeline shows a pipeline. On separate devices, the most
    # balanced among plans within 2% of the fastest: the one that pipelines.
    fastest = min(f[0] for f in fitting)
    if len({str(dev.device) for dev in prof.devices}) == 1:  # each cut at its fastest setting
        best: dict[tuple[int, ...], tuple[float, float, tuple[int, ...], CostModel, Evaluation]] = {}
        for f in fitting:
            if f[2] not in best or f[0] < best[f[2]][0]:
                best[f[2]] = f
        near = list(best.values())
    else:
        near = [f for f in fitting if f[0] <= fastest * 1.02]
    _, _, _, cm, ev = min(near, key=lambda f: (f[1], f[0]))
    return cm.to_plan(ev, "torchspan")


def _slowest_stage(prof: Profile, bounds: tuple[int, ...], microbatches: int) -> float:
    """The slowest stage's share of all stages' forward+backward time (1/stages when balanced)."""
    samples = prof.batch_size / microbatches
    times = [
        sum(
            lay.forward_seconds(d, samples) + lay.backward_seconds(d, samples)
            for lay in prof.layers[bounds[d] : bounds[d + 1]]
        )
        for d in range(len(bounds) - 1)
    ]
    return max(times) / sum(times) if sum(times) > 0 else 1.0

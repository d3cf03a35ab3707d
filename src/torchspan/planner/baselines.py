"""Placements other tools would make, scored with torchspan's cost model (for ``plan_quality``).

Usage::

    plan, ev = baseline(profile, "parameters")        # DeepSpeed-style parameter balance
    plan.predicted_step_time, ev.fits

Strategies (each picks layer splits by its own rule; all get the best micro-batch count, schedule
and recompute mode for that split, so the comparison is about placement alone). Devices are taken
as listed, as those tools take them: a device listed twice gets a stage per entry, and the cost
model scores those stages as sharing one device (its time and its budget).

``uniform``       equal layer counts over the listed devices, in order (torchgpipe's even balance).
``parameters``    contiguous split of the listed devices minimising the largest parameter bytes per
                  device, like DeepSpeed's ``partition_method="parameters"``.
``greedy``        fill devices in list order with parameter + buffer bytes up to each budget, then
                  move on, like accelerate's ``infer_auto_device_map``.
``greedy_state``  the same fill counting gradients and optimizer state too: what a careful user gets
                  by lowering accelerate's ``max_memory`` for training (a stronger baseline).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..hardware import format_bytes
from ..profiler.costs import Profile
from .cost import CostModel, time_tables
from .physical import budget_of
from .plans import Plan
from .settings import settings_grid
from .stages import Evaluation, Stage

__all__ = ["STRATEGIES", "baseline", "uniform_split", "parameter_split", "greedy_split"]

STRATEGIES = ("uniform", "parameters", "greedy", "greedy_state")


def uniform_split(n_layers: int, devices: Sequence[int]) -> list[Stage]:
    """Equal layer counts (the first ones one larger) over ``devices`` in order."""
    n = min(n_layers, len(devices))
    out, pos = [], 0
    for s in range(n):
        size = n_layers // n + (1 if s < n_layers % n else 0)
        out.append(Stage(devices[s], pos, pos + size))
        pos += size
    return out


def parameter_split(weights: Sequence[float], devices: Sequence[int]) -> list[Stage]:
    """Contiguous split into ``len(devices)`` parts minimising the largest sum of ``weights``."""
    L = len(weights)
    n = min(L, len(devices))

    def cuts_for(cap: float) -> list[int] | None:
        cuts, acc = [], 0.0
        for i, w in enumerate(weights):
            if w > cap:
                return None
            if acc + w > cap:
                cuts.append(i)
                acc = 0.0
            acc += w
        return cuts if len(cuts) + 1 <= n else None

    lo, hi = max(weights, default=0.0), float(sum(weights))
    for _ in range(100):
        if hi - lo <= 1e-9 * max(hi, 1.0):
            break
        mid = (lo + hi) / 2
        if cuts_for(mid) is None:
            lo = mid
        else:
            hi = mid
    cuts = cuts_for(hi) or []
    bounds = [0, *cuts, L]
    # use every device: split the longest parts until there are n
    while len(bounds) - 1 < n:
        k = max(range(len(bounds) - 1), key=lambda s: bounds[s + 1] - bounds[s])
        bounds.insert(k + 1, (bounds[k] + bounds[k + 1] + 1) // 2)
    return [Stage(devices[s], bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1)]


def greedy_split(sizes: Sequence[float], capacities: Sequence[float], devices: Sequence[int]) -> list[Stage]:
    """Fill ``devices`` in order with ``sizes`` up to ``capacities``; the last device takes the rest."""
    out: list[Stage] = []
    start, acc, d = 0, 0.0, 0
    for i, size in enumerate(sizes):
        while d < len(devices) - 1 and acc + size > capacities[d] and i > start:
            out.append(Stage(devices[d], start, i))
            start, acc, d = i, 0.0, d + 1
        acc += size
    out.append(Stage(devices[d], start, len(sizes)))
    return out


def _stages(profile: Profile, strategy: str) -> list[Stage]:
    L = len(profile.layers)
    everyone = list(range(len(profile.devices)))
    caps = [budget_of(d) for d in profile.devices]
    if strategy == "uniform":
        return uniform_split(L, everyone)
    if strategy == "parameters":
        return parameter_split([float(x.param_bytes) for x in profile.layers], everyone)
    if strategy == "greedy":
        return greedy_split([float(x.param_bytes + x.buffer_bytes) for x in profile.layers], caps, everyone)
    if strategy == "greedy_state":
        return greedy_split([float(x.state_bytes) for x in profile.layers], caps, everyone)
    raise ValueError(f"strategy={strategy!r} is not one of {', '.join(STRATEGIES)}")


def baseline(
    profile: Profile,
    strategy: str,
    *,
    microbatches: int | str = "auto",
    schedule: str = "auto",
    recompute: str = "auto",
) -> tuple[Plan, Evaluation]:
    """The ``strategy`` placement as a ``Plan`` with the best settings for it, and its evaluation.

    When no setting fits the budgets the fastest one is returned with a note saying where memory
    runs out (``evaluation.fits`` is False).
    """
    stages = _stages(profile, strategy)
    grid = settings_grid(profile.batch_size, microbatches, schedule, recompute)
    tables = time_tables(profile)
    scored = [(cm, cm.evaluate(stages)) for cm in (CostModel(profile, m, s, c, tables) for m, s, c in grid)]
    # fitting before not fitting, then the fastest; among equals the first setting (min keeps it)
    cm, ev = min(scored, key=lambda pair: (not pair[1].fits, pair[1].step_time))
    notes = [f"baseline '{strategy}' scored with torchspan's cost model"]
    if not ev.fits:
        over = [f"{name} needs {format_bytes(m)} of {format_bytes(c)}" for name, m, c in ev.over_budget()]
        notes.append("does not fit: " + "; ".join(over))
    return cm.to_plan(ev, strategy, notes=notes), ev

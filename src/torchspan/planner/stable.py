"""Stable plans: predicted steps within measurement noise are ties, broken the same way every run.

Why. Measured layer times vary from run to run (other processes, caches, clocks). A predicted step is
sums and maxima of those times, so it moves by about as much, and the exact optimum flips between
placements whose predictions differ by less than that: the same ``torchspan plan`` command once gave
``cuda:0 | cpu | cuda:1`` and twice ``cpu | cuda:0 | cuda:1`` (issue 19).

Noise. The profiler keeps the median of its timing repeats, not their spread, so each device gets a
documented relative tolerance: ``MEASURED_NOISE`` (5%) when its times were measured here
(``LayerCost.time_source == "measured"``), 0 when they are estimated for a described device (the same
every run). Two predictions are a tie when they differ by at most the largest noise of the devices
either plan uses, relative to the faster one. With every device described, plans are the exact optimum.

Rule. The candidates are device orders (each stage one physical device; interchangeable devices, equal
in times, link and budget, count as one) with, for each micro-batch count, schedule and recompute mode
of the search's grid, the best cut for that order (``Solver(cm, sequence)``). Among the candidates
predicted within noise of the fastest, the plan is the most preferred: fewer stages, then devices in
listed order stage by stage (``devices="auto"`` lists accelerators before the CPU), then the grid's
order (fewer micro-batches, no recompute before recompute; fewer micro-batches also means less of the
per-micro-batch overhead the cost model does not price). The fastest candidate on another device order
within noise is the plan's ``runner_up``; the plan's table names it.

Limits. A candidate predicted right at the edge of the tolerance can still flip between runs (any rule
on one noisy measurement has an edge); the rule moves the edge away from near-equal plans, where
flips were likely. At most ``MAX_ORDERS`` device orders are solved, cheapest bound first after pruning
by a lower bound (``sigma + (M - 1) * floor`` over the order's devices); beyond it the rest are not
compared, and a note says so.

Usage: ``choice = stable_choice(models, kept, winner_cm, winner_ev, make_setting)`` (``optimize.search`` calls
it).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..profiler.costs import Profile
from .cost import CostModel, time_tables
from .physical import budget_of, host_bandwidth, identity, memory_bandwidth
from .solver import device_groups
from .stages import Evaluation
from .ties import TieCost

__all__ = ["MEASURED_NOISE", "MAX_ORDERS", "device_noise", "Choice", "stable_choice", "describe"]

MEASURED_NOISE = 0.05  # relative: run-to-run spread of measured step predictions on a shared machine
MAX_ORDERS = 200  # device orders solved at most per search (fewer stages first)


def device_noise(profile: Profile) -> list[float]:
    """Per listed device: ``MEASURED_NOISE`` when any of its layer times was measured here, else 0."""
    out = []
    for d in range(len(profile.devices)):
        measured = any(
            d < len(lay.time_source) and lay.time_source[d] == "measured" for lay in profile.layers
        )
        out.append(MEASURED_NOISE if measured else 0.0)
    return out


@dataclass
class Choice:
    """The plan to return (``cm``, ``ev``), the fastest other device order within noise, and notes saying
    why."""

    cm: CostModel
    ev: Evaluation
    runner_up: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    programmes: int = 0


def describe(cm: CostModel, ev: Evaluation) -> str:
    """``"cpu | cuda:0 (balance 3,5; 4 micro-batches, 1f1b, recompute never)"``."""
    names = " | ".join(cm.names[s.device] for s in ev.stages)
    balance = ",".join(str(s.end - s.start) for s in ev.stages)
    return f"{names} (balance {balance}; {cm.M} micro-batch(es), {cm.schedule}, recompute {cm.recompute})"


def stable_choice(
    models: Sequence[CostModel],
    kept: Sequence[tuple[TieCost, ...]],
    winner_cm: CostModel,
    winner_ev: Evaluation,
    make_setting: Callable[[CostModel, tuple[int, ...]], Any],
    others: Sequence[tuple[CostModel, Evaluation]] = (),
    rtol: float = 1e-9,
) -> Choice:
    """The most preferred candidate within noise of ``winner_ev`` (the search's exact optimum); see the module
    docstring.

    ``models``: one ``CostModel`` per grid setting, in the grid's (preference) order; ``kept``: the tie
    subsets the search also keeps on one stage; ``make_setting(cm, types)``: the search's branch and
    bound restricted to one order of device types (``optimize._Setting``); ``others``: the search's best
    placement of every other setting (runner-up candidates, with the chosen order's rearrangements).
    """
    noise = device_noise(winner_cm.profile)
    if max(noise, default=0.0) == 0.0:
        return Choice(winner_cm, winner_ev)
    t0 = winner_ev.step_time
    used = {s.device for s in winner_ev.stages}
    restricted = _Restricted(models, kept, make_setting, rtol)

    def limit(
        order: Sequence[int],
    ) -> float:  # within noise of the fastest: noise of every device either uses
        return t0 * (1 + max(noise[d] for d in {*order, *used})) * (1 + rtol)

    chosen, stopped = (winner_cm, winner_ev), False
    for n, order in enumerate(
        _orders(models, noise, used, t0)
    ):  # most preferred first: the first within noise wins
        if n >= MAX_ORDERS or order is None:
            stopped = True
            break
        found = restricted.first_within(order, limit(order))
        if found is not None:
            chosen = found
            break
    seen = [(winner_cm, winner_ev), *others]
    mine = tuple(s.device for s in chosen[1].stages)
    for order in _rearrangements(
        mine, _classes(models[0])
    ):  # the same devices in other orders, where swaps hide
        found = restricted.fastest(order, limit(order))
        if found is not None:
            seen.append(found)
    notes = _notes(chosen, winner_cm, winner_ev, noise, stopped)
    return Choice(chosen[0], chosen[1], _runner_up(chosen, seen, t0, noise), notes, restricted.programmes)


class _Restricted:
    """The search's branch and bound restricted to one device order, for each grid setting and its tie
    variants."""

    def __init__(
        self,
        models: Sequence[CostModel],
        kept: Sequence[tuple[TieCost, ...]],
        make_setting: Callable[..., Any],
        rtol: float,
    ) -> None:
        self.models, self.make, self.rtol, self.programmes = models, make_setting, rtol, 0
        self.variants = [
            [cm, *(cm.keeping(k) for k in kept)] for cm in models
        ]  # the setting, and it with ties kept whole
        self.groups = [
            [device_groups(v) for v in row] for row in self.variants
        ]  # the solver's device types for each

    def best(self, order: tuple[int, ...], limit: float, g: int) -> tuple[CostModel, Evaluation] | None:
        """The fastest fitting placement in ``order`` under setting ``g`` if one is within ``limit``."""
        best: tuple[CostModel, Evaluation] | None = None
        for variant, grouped in zip(self.variants[g], self.groups[g]):
            types = _types(grouped, order)
            if types is None:
                continue
            st = self.make(variant, types)
            st.root()
            if st.best is not None:
                st.refine(limit, self.rtol)
            self.programmes += st.programmes
            if (
                st.best is not None
                and st.best.fits
                and (best is None or st.best.step_time < best[1].step_time)
            ):
                best = (variant, st.best)
        return best if best is not None and best[1].step_time <= limit else None

    def first_within(self, order: tuple[int, ...], limit: float) -> tuple[CostModel, Evaluation] | None:
        """The first setting in grid order with a placement in ``order`` within ``limit``."""
        for g, cm in enumerate(self.models):
            if _bound(cm, order) <= limit:
                found = self.best(order, limit, g)
                if found is not None:
                    return found
        return None

    def fastest(self, order: tuple[int, ...], limit: float) -> tuple[CostModel, Evaluation] | None:
        """The fastest placement in ``order`` over every setting, if within ``limit``."""
        best = None
        for g, cm in enumerate(self.models):
            bar = limit if best is None else best[1].step_time
            if _bound(cm, order) <= bar:
                found = self.best(order, bar, g)
                if found is not None and (best is None or found[1].step_time < best[1].step_time):
                    best = found
        return best


def _rearrangements(order: tuple[int, ...], classes: list[list[int]]) -> list[tuple[int, ...]]:
    """``order``'s devices in every other order (up to 3 stages; beyond, each adjacent pair swapped), as
    realized orders."""
    class_of = {d: i for i, c in enumerate(classes) for d in c}
    k = len(order)
    perms = (
        itertools.permutations(order)
        if k <= 3
        else (order[:i] + (order[i + 1], order[i]) + order[i + 2 :] for i in range(k - 1))
    )
    out: dict[tuple[int, ...], tuple[int, ...]] = {}
    for perm in perms:
        labels = tuple(class_of[d] for d in perm)  # interchangeable devices swapped: the same order
        members = [iter(sorted(d for d in order if class_of[d] == i)) for i in range(len(classes))]
        out.setdefault(labels, tuple(next(members[i]) for i in labels))
    mine = tuple(class_of[d] for d in order)
    return [o for labels, o in out.items() if labels != mine]


def _classes(cm: CostModel) -> list[list[int]]:
    """Physical devices (first entries, listed order) grouped when interchangeable in every setting."""
    tables = time_tables(cm.profile)
    devs = cm.profile.devices
    groups: dict[tuple, list[int]] = {}
    for d in sorted(set(cm.rep)):
        key = (
            identity(devs, d),
            host_bandwidth(devs[d]),
            budget_of(devs[d]),
            memory_bandwidth(devs[d]),
            devs[d].kind,
            *(t[d].tobytes() for t in tables),
        )
        groups.setdefault(key, []).append(d)
    return sorted(groups.values(), key=lambda g: g[0])


def _orders(
    models: Sequence[CostModel], noise: list[float], used: set[int], t0: float
) -> Iterator[tuple[int, ...] | None]:
    """Device orders (physical first entries) in preference order: fewer stages, then listed order stage by
    stage.

    A set of devices whose bound is beyond noise of ``t0`` under every setting is skipped whole; ``None``
    (then stop) when one stage count has more orders than ``MAX_ORDERS``.
    """
    cm = models[0]
    classes = _classes(cm)
    listed = {d: i for i, d in enumerate(sorted(set(cm.rep)))}
    for k in range(1, min(sum(map(len, classes)), cm.L) + 1):
        sets = []
        for counts in itertools.product(*(range(len(c) + 1) for c in classes)):
            if sum(counts) != k:
                continue
            members = [
                d for c, n in zip(classes, counts) for d in c[:n]
            ]  # interchangeable: the first listed ones
            limit = t0 * (1 + max(noise[d] for d in {*members, *used}))
            if min(_bound(m, members) for m in models) <= limit:
                sets.append([c[:n] for c, n in zip(classes, counts)])
        if (
            sum(math.factorial(k) // math.prod(math.factorial(len(c)) for c in by_class) for by_class in sets)
            > MAX_ORDERS
        ):
            yield None
            return
        yield from sorted(
            (o for by_class in sets for o in _arrangements(by_class)), key=lambda o: [listed[d] for d in o]
        )


def _arrangements(by_class: list[list[int]]) -> Iterator[tuple[int, ...]]:
    """Every order of the classes' members up to swapping interchangeable ones (each class's members in listed
    order)."""
    left = [len(c) for c in by_class]
    k = sum(left)
    labels: list[int] = []

    def walk() -> Iterator[tuple[int, ...]]:  # distinct permutations of the class labels, depth first
        if len(labels) == k:
            nxt = [iter(c) for c in by_class]
            yield tuple(next(nxt[i]) for i in labels)
            return
        for i, n in enumerate(left):
            if n:
                left[i] -= 1
                labels.append(i)
                yield from walk()
                labels.pop()
                left[i] += 1

    yield from walk()


def _bound(cm: CostModel, devices: Sequence[int]) -> float:
    """No placement on only ``devices`` beats this under ``cm`` (``optimize.bottleneck_floor`` restricted to
    them)."""
    rows = sorted(set(devices))
    lat, steady = cm.lat[rows], cm.steady[rows]
    best_layer = steady.min(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(steady > 0, best_layer[None, :] / steady, 1.0).max(axis=1)
    capacity = float(rel.sum())
    floor = max(float(best_layer.max()), float(best_layer.sum()) / capacity if capacity > 0 else 0.0)
    return float(lat.min(axis=0).sum()) + (cm.M - 1) * floor


def _types(groups: list[list[int]], order: tuple[int, ...]) -> tuple[int, ...] | None:
    """``order`` as the solver's device types (``groups``: ``device_groups(cm)``); None when a type is used
    more often than it has members."""
    type_of = {d: t for t, g in enumerate(groups) for d in g}
    types = tuple(type_of[d] for d in order)
    if any(types.count(t) > len(groups[t]) for t in set(types)):
        return None
    return types


def _runner_up(
    chosen: tuple[CostModel, Evaluation],
    seen: Sequence[tuple[CostModel, Evaluation]],
    t0: float,
    noise: list[float],
) -> dict[str, Any]:
    """The fastest placement the search saw on another device order within noise of the fastest, as
    ``Plan.runner_up``."""
    order = tuple(s.device for s in chosen[1].stages)
    close = []
    for cm, ev in seen:
        other = tuple(s.device for s in ev.stages)
        tolerance = max(noise[d] for d in {*other, *order})
        if other != order and ev.fits and ev.step_time <= t0 * (1 + tolerance) * (1 + 1e-9):
            close.append((ev.step_time, tolerance, cm, ev))
    if not close:
        return {}
    _, tolerance, cm, ev = min(close, key=lambda c: c[0])
    return {
        "devices": [cm.names[s.device] for s in ev.stages],
        "balance": [s.end - s.start for s in ev.stages],
        "microbatches": cm.M,
        "schedule": cm.schedule,
        "recompute": cm.recompute,
        "predicted_step_time": ev.step_time,
        "noise": tolerance,
        "within_noise": True,
    }


def _notes(
    chosen: tuple[CostModel, Evaluation],
    winner_cm: CostModel,
    winner_ev: Evaluation,
    noise: list[float],
    stopped: bool,
) -> list[str]:
    """Why the plan is not the fastest prediction (when it is not), and whether the comparison stopped
    early."""
    cm, ev = chosen
    notes = []
    if (ev.stages, cm.M, cm.schedule, cm.recompute) != (
        winner_ev.stages,
        winner_cm.M,
        winner_cm.schedule,
        winner_cm.recompute,
    ):
        tolerance = max(
            noise[d] for d in {*(s.device for s in ev.stages), *(s.device for s in winner_ev.stages)}
        )
        notes.append(
            f"stable choice: the fastest prediction, {describe(winner_cm, winner_ev)} at "
            f"{winner_ev.step_time * 1e3:.3f} ms, is within measurement noise ({tolerance:.0%}) of this "
            f"plan's {ev.step_time * 1e3:.3f} ms; this one is preferred (fewer stages, then devices in "
            "listed order, then fewer micro-batches), so the same command plans the same way each run"
        )
    if stopped:
        notes.append(
            f"stable choice compared the first {MAX_ORDERS} device orders only (fewer stages first); the "
            "rest were not compared"
        )
    return notes

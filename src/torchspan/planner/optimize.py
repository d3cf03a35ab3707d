"""Exact placement search over a ``Profile`` (no model, no devices needed): ``search(profile) -> Plan``.

Usage::

    plan = search(profile, microbatches="auto", schedule="auto", recompute="auto")

What is searched: contiguous stages over any subset and order of the profile's *physical* devices,
each holding one contiguous run of layers, the micro-batch count, the schedule and the recompute
mode; what is minimised: the step time of ``cost.py`` (``sum lat + links + (M - 1) * bottleneck``)
with every device within its budget.

Entries that are one physical device (``['cpu', 'cpu']``) are collapsed to their first entry. In the
cost model they share one budget and their stages run one after another in one worker, so cutting
a device's run of layers into several stages on its entries never lowers the step time (same
serial work, same bubble, free hand-overs) and never lowers memory (the parts together hold at
least as much: under 1F1B the earlier part keeps one more micro-batch in flight, and each part has
its own workspace and its own copy of tensors shared across the cut). The search space therefore
loses nothing by the collapse; ``tests/test_planner_search.py`` checks it against brute force over
every placement on the uncollapsed list in which each physical device's stages are adjacent.
Not searched: one device visited twice with another in between (``cpu, cuda:0, cpu``), which
``CostModel.evaluate`` scores but the dynamic programme's per-stage state cannot express (the
device's busy time would be a sum over non-adjacent stages). On small random profiles such a
placement beats the search's in about 1% of cases (26 of 2,400 tried; in all of them the CPU
holds both ends with an accelerator in the middle).

How (exact for the cost model, up to a relative ``rtol``, default 1e-9):

* For a bottleneck cap ``tau``, ``solver.Solver`` finds the placement with the least
  ``sum lat + links`` whose every stage and link takes at most ``tau`` (a dynamic programme; see there).
* ``minsum(tau)`` is a non-increasing step function; the step time is ``minsum(tau) + (M-1)*tau``.
  A branch and bound over ``tau`` finds its minimum: a piece ``[lo, hi)`` whose top value is known
  is bounded by ``minsum(hi) + (M-1)*lo`` and is either bisected or cut just below ``hi`` (one
  programme gives the next step of ``minsum`` exactly; bisection alone needs ~30 halvings to close
  the piece under the incumbent). Settings (micro-batch counts, recompute modes) are visited in
  order of a cheap lower bound (sum of each layer's fastest latency + (M-1) * bottleneck floor);
  a setting whose bound cannot beat the best so far gets no programme at all.
* Dominated settings are skipped under ``"auto"`` (see ``settings.settings_grid``).

Stability: on measured devices the exact optimum is then replaced by the most preferred plan predicted
within measurement noise of it (fewer stages, devices in listed order, fewer micro-batches), and the
fastest other device order within noise is kept as ``Plan.runner_up`` (``stable``). Described devices
have no noise: their plans are the exact optimum.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import numpy as np

from ..hardware import format_bytes
from ..profiler.costs import Profile
from .cost import CostModel, time_tables
from .explain import explain_no_fit
from .interleaved import INTERLEAVED
from .interleaved import choose as choose_interleaved
from .physical import INF
from .plans import Plan
from .settings import settings_grid
from .solver import Solver
from .stable import stable_choice
from .stages import Evaluation
from .ties import TieCost

__all__ = ["search", "solve", "bottleneck_floor", "plan_notes", "collapse_notes"]


def bottleneck_floor(cm: CostModel) -> float:
    """A lower bound on any placement's bottleneck (for pruning).

    No stage is faster than its slowest layer on its best device; and in time ``beta`` device
    ``d`` can do at most ``beta * r_d`` of the layers' best-device work, ``r_d`` being its
    best relative speed over all layers, so ``beta >= total / sum(r_d)``.
    """
    steady = cm.steady[sorted(set(cm.rep))]  # one row per physical device
    best_layer = steady.min(axis=0)
    total = float(best_layer.sum())
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(steady > 0, best_layer[None, :] / steady, 1.0).max(axis=1)
    capacity = float(rel.sum())
    return float(max(best_layer.max(), total / capacity if capacity > 0 else 0.0))


class _Setting:
    """One (micro-batches, schedule, recompute) setting: its solver and best placement so far; ``sequence``
    (device types, stage by stage) restricts it to placements in that order (``Solver``)."""

    def __init__(self, cm: CostModel, sequence: tuple[int, ...] | None = None) -> None:
        self.cm = cm
        self.sequence = sequence
        self._solver: Solver | None = None
        self.best: Evaluation | None = None
        self.floor = bottleneck_floor(cm)
        self.sigma = float(cm.lat.min(axis=0).sum())  # raised to the exact min sum by root()

    @property
    def solver(self) -> Solver:
        """Built on first use: a setting pruned by its bound never needs one."""
        if self._solver is None:
            self._solver = Solver(self.cm, self.sequence)
        return self._solver

    @property
    def programmes(self) -> int:
        return 0 if self._solver is None else self._solver.evaluations

    @property
    def bound(self) -> float:
        """No placement under this setting is faster than this."""
        return self.sigma + (self.cm.M - 1) * self.floor

    def root(self) -> None:
        """Best placement ignoring the bottleneck: feasibility, and the exact min-sum lower bound."""
        stages = self.solver.run(INF)
        if stages is not None:
            self.best = self.cm.evaluate(stages)
            self.sigma = self._programme(stages, self.best).latency_sum

    def _programme(self, stages: list, ev: Evaluation) -> Evaluation:
        """``ev`` as the programme prices it (ties not charged): what the branch and bound reasons about."""
        return self.cm.evaluate(stages, ties=()) if self.cm.ties else ev

    def refine(self, incumbent: float, rtol: float) -> None:
        """Branch and bound over the bottleneck cap ``tau`` until nothing can beat the incumbent.

        A piece ``[lo, hi)`` of ``tau`` knows ``f(hi) = top`` (the min sum of a placement whose
        bottleneck is ``hi``) and ``f >= top`` below ``hi``, so no placement in it beats
        ``top + (M - 1) * lo``. A piece is either bisected (run at ``mid``: ``f`` is then known on
        ``[b, mid]``, ``b`` the returned bottleneck) or cut just below ``hi`` (run at ``hi - 0``:
        the next step of ``f``, exactly, which closes the piece an incumbent sits on top of; bisection
        alone would need ~30 halvings to get within ``rtol`` of it). The two alternate.
        """
        if self.best is None:
            return
        cm, solver, M1 = self.cm, self.solver, self.cm.M - 1
        if M1 == 0:
            return  # step time is the min sum: root() found it
        bound = min(incumbent, self.best.step_time)
        below = 1.0 - rtol / 10  # "strictly below hi": ties within this are priced within rtol
        # (lower bound, lo, hi, top, bisect next?)
        # the pieces follow the programme's own sums and bottlenecks (ties uncharged, so its lower bounds stay
        # valid); incumbents are compared charged
        first = self._programme(list(self.best.stages), self.best)
        heap = [(first.latency_sum + M1 * self.floor, self.floor, first.bottleneck, first.latency_sum, False)]
        while heap:
            lb, lo, hi, top, bisect = heapq.heappop(heap)
            if lb >= bound * (1 - rtol) or hi <= lo:
                continue
            tau = 0.5 * (lo + hi) if bisect else hi * below
            stages = solver.run(tau)
            if bisect:  # [mid, hi) keeps what it knew; [lo, mid] is settled below
                heapq.heappush(heap, (top + M1 * tau, tau, hi, top, False))
            if stages is None:
                continue  # nothing has a bottleneck <= tau
            ev = cm.evaluate(stages)
            if ev.step_time < self.best.step_time:
                self.best = ev
                bound = min(bound, ev.step_time)
            ev = self._programme(stages, ev)
            b = min(ev.bottleneck, tau)  # f == ev.latency_sum on [b, tau]
            heapq.heappush(heap, (ev.latency_sum + M1 * lo, lo, b, ev.latency_sum, not bisect))


def solve(cm: CostModel, *, incumbent: float = INF, rtol: float = 1e-9) -> tuple[Evaluation | None, int]:
    """Best placement for one setting, or ``None`` when nothing fits or nothing beats ``incumbent``.

    Returns ``(evaluation, dynamic programmes run)``.
    """
    setting = _Setting(cm)
    if setting.bound >= incumbent * (1 - rtol):
        return None, 0
    setting.root()
    setting.refine(incumbent, rtol)
    runs = setting.programmes
    if setting.best is None or setting.best.step_time >= incumbent:
        return None, runs
    return setting.best, runs


def search(
    profile: Profile,
    *,
    microbatches: int | str = "auto",
    schedule: str = "auto",
    recompute: str = "auto",
    rtol: float = 1e-9,
    ties: Sequence[TieCost] = (),
) -> Plan:
    """The fastest plan for ``profile`` under its devices' budgets (see the module docstring).

    ``ties``: tied parameters (``planner.ties``), charged when a cut splits them. Each setting is
    then also searched with every subset of them kept on one stage (all of them at once beyond 3
    ties): exact for placements that keep those ties; a placement that splits one is the best the
    programme finds without that charge, then charged in full (the programme prices stages by
    prefix sums, and a tie's copy depends on two stages' devices).

    Usage: ``search(profile, microbatches=8, schedule="1f1b")``. Raises ``PlanError`` (listing
    needed vs available memory and what would make it fit) when no placement fits.
    """
    # interleaved: the best one-stage-per-device placement, then looped (``planner.interleaved.choose``)
    grid = settings_grid(
        profile.batch_size, microbatches, "1f1b" if schedule == INTERLEAVED else schedule, recompute
    )
    tables = time_tables(profile)
    ties = tuple(ties)
    kept = (
        [c for r in range(1, len(ties) + 1) for c in itertools.combinations(ties, r)]
        if len(ties) <= 3
        else [ties]
    )
    models = [CostModel(profile, m, s, c, tables, ties=ties) for m, s, c in grid]
    settings = [_Setting(cm) for cm in models] + [_Setting(cm.keeping(k)) for cm in models for k in kept]
    feasible: list[_Setting] = []

    def incumbent() -> _Setting | None:
        # the fastest; among equals the earliest in preference order (only settings with a best are feasible)
        return min(feasible, key=lambda st: (st.best.step_time, settings.index(st)), default=None)  # type: ignore[union-attr]

    # settings in order of a cheap lower bound; one whose bound cannot beat the incumbent needs no
    # programme at all (sorted: nor do the ones after it)
    for st in sorted(settings, key=lambda st: st.bound):
        inc = incumbent()
        if inc is not None and inc.best is not None and st.bound >= inc.best.step_time * (1 - rtol):
            break
        st.root()
        if st.best is None:
            continue
        feasible.append(st)
        inc = incumbent()
        assert inc is not None and inc.best is not None
        st.refine(inc.best.step_time, rtol)
    if not feasible:
        raise explain_no_fit(profile, grid)
    winner = incumbent()
    assert winner is not None and winner.best is not None
    # within measurement noise of the fastest, the same command plans the same way every run (``stable``)
    seen = [(st.cm, st.best) for st in feasible if st.best is not None and st is not winner]
    choice = stable_choice(models, kept, winner.cm, winner.best, _Setting, seen, rtol)
    programmes = sum(st.programmes for st in settings) + choice.programmes
    cm, ev, extra = choice.cm, choice.ev, []
    interleaved = choose_interleaved(cm, ev, schedule)
    if interleaved is not None:
        cm, ev, extra = interleaved
    notes = plan_notes(cm, ev, programmes, len(grid)) + choice.notes + extra
    plan = cm.to_plan(ev, "torchspan", notes=notes)
    plan.runner_up = (
        choice.runner_up if interleaved is None else {}
    )  # it names another 1-stage-per-device order
    return plan


def plan_notes(cm: CostModel, ev: Evaluation, programmes: int, settings: int) -> list[str]:
    """Human-readable reasons for a plan: spills, skipped devices, collapsed duplicates, bottleneck."""
    devs = cm.profile.devices
    notes = []
    used = {cm.names[s.device] for s in ev.stages}
    cpu_stages = [s for s in ev.stages if devs[s.device].kind == "cpu"]
    accel = {cm.names[d] for d in range(cm.D) if devs[d].kind != "cpu"}
    if cpu_stages and accel:
        names = [cm.profile.layers[k].name for s in cpu_stages for k in range(s.start, s.end)]
        why = (
            "the accelerators' budgets are full"
            if accel <= used
            else "predicted faster than placing them on the remaining accelerators"
        )
        notes.append(f"{len(names)} layer(s) run on the CPU ({names[0]} .. {names[-1]}): {why}")
    unused = [n for n in dict.fromkeys(cm.names) if n not in used]
    if unused:
        notes.append(f"not used (no faster placement with them): {', '.join(unused)}")
    busiest = ev.devices[int(np.argmax(ev.device_busy))]
    notes.append(
        f"bottleneck {ev.bottleneck * 1e3:.3f} ms per micro-batch; pipeline fill/drain "
        f"{ev.latency_sum * 1e3:.3f} ms; busiest device {busiest}"
    )
    notes.extend(collapse_notes(cm))
    notes.append(f"searched {settings} setting(s) with {programmes} dynamic programme(s)")
    return notes


def collapse_notes(cm: CostModel) -> list[str]:
    """One note per physical device listed more than once: why the search planned it as one."""
    out = []
    for name in dict.fromkeys(cm.names):
        count = cm.names.count(name)
        if count < 2:
            continue
        cap = cm.capacity[cm.names.index(name)]
        budget = "no budget" if cap == INF else f"one budget of {format_bytes(cap)}"
        out.append(
            f"{name} is listed {count} times: the entries are one device ({budget} for all of them; their "
            f"stages would run one after another in one worker), so it was planned as one device - "
            f"splitting the model across its entries is never faster and never needs less memory. To run a "
            f"pipeline on it anyway (e.g. to test one), pass span(model, devices=[...], balance=[...]) or "
            f"a hand-made Plan; CostModel.evaluate(cm.stages_for(plan)) predicts its time"
        )
    return out

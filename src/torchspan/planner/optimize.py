"""Exact placement search over a ``Profile`` (no model, no devices needed): ``search(profile) -> Plan``.

Usage::

    plan = search(profile, microbatches="auto", schedule="auto", checkpoint="auto")

What is searched: contiguous stages over any subset and order of the profile's *physical* devices,
each holding one contiguous run of layers, the micro-batch count, the schedule and the checkpoint
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

* For a bottleneck cap ``tau`` the best placement minimises the additive part ``sum lat + links``
  with every stage and link at most ``tau``. A dynamic programme solves that: its state is
  (first layer of the suffix still to place, how many devices of each *type* the suffix uses, type
  of the suffix's first stage). Devices with the same per-layer times and host link whose budgets
  admit exactly the same stages (``CostModel.max_end`` for every in-flight count: the only way a
  budget enters the programme) form one type and are interchangeable, so 8 equal GPUs are 9
  counts, not 8! orders, and GPUs whose free memory differs by a few megabytes that no stage
  boundary notices stay one type. Stage costs are prefix-sum differences, so each transition is a
  sliding-window minimum, computed for all starts at once with a sparse table (numpy). Working
  from the last stage backwards, a stage knows how many stages follow it, which fixes its 1F1B
  in-flight count and thus its memory. Each level keeps only the band of first layers where it
  can be finite (reachable from the end within the cap, and leaving a prefix the remaining stages
  can cover), and the best link into the next stage is found for all types at once (a link costs
  ``2 * out / min(bw, bw')``: sorted by bandwidth, a prefix and a suffix minimum).
* ``minsum(tau)`` is a non-increasing step function; the step time is ``minsum(tau) + (M-1)*tau``.
  A branch and bound over ``tau`` finds its minimum: a piece ``[lo, hi)`` whose top value is known
  is bounded by ``minsum(hi) + (M-1)*lo`` and is either bisected or cut just below ``hi`` (one
  programme gives the next step of ``minsum`` exactly; bisection alone needs ~30 halvings to close
  the piece under the incumbent). Settings (micro-batch counts, checkpoint modes) are visited in
  order of a cheap lower bound (sum of each layer's fastest latency + (M-1) * bottleneck floor);
  a setting whose bound cannot beat the best so far gets no programme at all.
* Dominated settings are skipped under ``"auto"``: 1F1B has GPipe's time with no more memory, and
  ``except_last`` has ``always``'s memory saving at less recompute (``tests/test_planner_search.py``
  checks both against brute force over every setting).
"""

from __future__ import annotations

import functools
import heapq
import math

import numpy as np

from ..profiler.costs import Profile
from .cost import INF, CostModel, Evaluation, Stage, identity, link_bandwidth, time_tables
from .plans import CHECKPOINTS, SCHEDULES, Plan

__all__ = ["search", "microbatch_candidates", "device_groups", "solve", "settings_grid"]


def microbatch_candidates(batch_size: int) -> list[int]:
    """Micro-batch counts tried under ``microbatches="auto"``: divisors and powers of two up to the batch."""
    out = {d for d in range(1, int(math.isqrt(batch_size)) + 1) if batch_size % d == 0}
    out |= {batch_size // d for d in out}
    p = 1
    while p <= batch_size:
        out.add(p)
        p *= 2
    return sorted(out)


def in_flight_counts(cm: CostModel) -> list[int]:
    """The in-flight counts a stage can have under ``cm``'s schedule (GPipe: ``M``; 1F1B: ``1..M``)."""
    stages = len(set(cm.rep))
    return [cm.M] if cm.schedule == "gpipe" else list(range(1, min(cm.M, stages) + 1))


def physical_ends(cm: CostModel) -> tuple[list[int], dict[int, np.ndarray]]:
    """``(physical devices as their first entries, {k: max_end rows for their budgets})``."""
    phys = sorted(set(cm.rep))
    caps = np.array([cm.capacity[d] for d in phys], dtype=np.float64)
    return phys, {k: cm.max_end(caps, k) for k in in_flight_counts(cm)}


def device_groups(cm: CostModel, ends: tuple[list[int], dict[int, np.ndarray]] | None = None) -> list[list[int]]:
    """Interchangeable physical devices (same link, per-layer times and fitting stages), as list indices.

    Budgets enter the search only through which stages fit (``CostModel.max_end`` for each
    in-flight count), so devices whose budgets differ but admit exactly the same stages are
    interchangeable too: grouping them is exact. Each physical device appears once, as its first
    entry: further entries of it are collapsed.
    """
    phys, by_k = physical_ends(cm) if ends is None else ends
    keys: dict[tuple, list[int]] = {}
    devs = cm.profile.devices
    for row, d in enumerate(phys):
        fitting = tuple(by_k[k][row].tobytes() for k in sorted(by_k))
        key = (fitting, cm.host_bw[d], identity(devs, d), cm.fwd[d].tobytes(), cm.bwd[d].tobytes())
        keys.setdefault(key, []).append(d)
    return sorted(keys.values(), key=lambda g: g[0])


def _window_min(V: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """``out[r, q] = min(V[r, left[q] .. right[q]])`` (``inf`` where ``right[q] < left[q]``), by a sparse table."""
    m, n = V.shape
    valid = right >= left
    if not valid.any():
        return np.full((m, len(left)), INF)
    if (right[valid] == n - 1).all():  # every window runs to the end: a suffix minimum
        suffix = np.minimum.accumulate(V[:, ::-1], axis=1)[:, ::-1]
        res = suffix[:, np.where(valid, left, 0)]
        res[:, ~valid] = INF
        return res
    ln = np.where(valid, right - left + 1, 1)
    p = np.floor(np.log2(ln)).astype(np.int64)
    levels = int(ln.max()).bit_length()
    st = np.empty((levels, m, n))
    st[0] = V
    for lev in range(1, levels):
        half = 1 << (lev - 1)
        st[lev, :, n - half :] = st[lev - 1, :, n - half :]
        np.minimum(st[lev - 1, :, : n - half], st[lev - 1, :, half:], out=st[lev, :, : n - half])
    lo = np.where(valid, left, 0)
    hi = np.where(valid, right - (1 << p) + 1, 0)
    res = np.minimum(st[p, :, lo], st[p, :, hi])  # (len(left), m)
    res[~valid] = INF
    return res.T


@functools.lru_cache(maxsize=16)
def _state_graph(
    sizes: tuple[int, ...], L: int
) -> tuple[list[list[tuple[int, ...]]], list[dict[tuple[int, ...], int]], list[list[tuple[np.ndarray, np.ndarray]]]]:
    """States per level (devices of each type used), their indices, and the moves between levels.

    ``moves[n][t] = (src, dst)``: adding a stage of type ``t`` in front of level-``n`` states ``src``
    gives level-``n+1`` states ``dst``.
    """
    T = len(sizes)
    levels: list[list[tuple[int, ...]]] = [[tuple(0 for _ in range(T))]]
    for _ in range(min(sum(sizes), L)):
        nxt = sorted({u[:t] + (u[t] + 1,) + u[t + 1 :] for u in levels[-1] for t in range(T) if u[t] < sizes[t]})
        if not nxt:
            break
        levels.append(nxt)
    index = [{u: i for i, u in enumerate(lv)} for lv in levels]
    moves: list[list[tuple[np.ndarray, np.ndarray]]] = []
    for n in range(len(levels) - 1):
        per_t = []
        for t in range(T):
            src, dst = [], []
            for si, u in enumerate(levels[n]):
                if u[t] < sizes[t]:
                    src.append(si)
                    dst.append(index[n + 1][u[:t] + (u[t] + 1,) + u[t + 1 :]])
            per_t.append((np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)))
        moves.append(per_t)
    return levels, index, moves


class _Solver:
    """Min ``sum lat + links`` placement under a bottleneck cap, for one ``CostModel``.

    Each level's table ``G[n]`` (suffix cost by state, type of the suffix's first stage, first
    layer) is kept only over the band of first layers where some value is finite, and the best
    link into the next stage's type is found for every type at once: a link costs
    ``2 * out / min(bw_t, bw_t')``, so sorting the types by host bandwidth turns the minimum over
    ``t'`` into a prefix minimum and a suffix minimum.
    """

    def __init__(self, cm: CostModel) -> None:
        self.cm = cm
        ends = physical_ends(cm)
        groups = device_groups(cm, ends)
        self.groups = groups
        T = len(groups)
        L = cm.L
        rep = [g[0] for g in groups]
        self.PL = cm.PL[rep]
        self.PS = cm.PS[rep]
        self.sizes = [len(g) for g in groups]
        devs = cm.profile.devices
        self.base = np.zeros(L + 1)
        self.base[1:L] = 2.0 * cm.out[: L - 1]
        # one physical device per group member, so a link is the slower host link of the two (cost.py)
        self.bw = np.array([cm.host_bw[r] for r in rep])
        for t in range(T):
            for t2 in range(T):
                if t != t2 or self.sizes[t] > 1:
                    a, z = groups[t][0], (groups[t2][0] if t != t2 else groups[t][1])
                    assert link_bandwidth(devs, a, z) == min(self.bw[t], self.bw[t2])
        self.order = np.argsort(self.bw, kind="stable")
        self.pos = np.empty(T, dtype=np.int64)
        self.pos[self.order] = np.arange(T)
        self.cin = np.array([cm.input_time(r) for r in rep])
        self.levels, self.index, self.moves = _state_graph(tuple(self.sizes), L)
        rows = [ends[0].index(g[0]) for g in groups]
        self._max_end: dict[int, np.ndarray] = {k: v[rows] for k, v in ends[1].items()}
        self.evaluations = 0

    def max_end(self, t: int, k: int) -> np.ndarray:
        return self._max_end[k][t]

    def _link_weights(self, cap_tau: float) -> np.ndarray:
        """``(T, L+1)``: seconds of a link at each boundary at type ``t``'s host bandwidth, ``inf`` above the cap."""
        with np.errstate(divide="ignore", invalid="ignore"):
            w = np.where(np.isinf(self.bw)[:, None], 0.0, self.base[None, :] / self.bw[:, None])
        return np.where(w <= cap_tau, w, INF)

    def run(self, tau: float) -> list[Stage] | None:
        """Best placement with every stage and link time ``<= tau``, or ``None`` if none fits."""
        self.evaluations += 1
        cm = self.cm
        L = cm.L
        T = len(self.groups)
        cap_tau = tau * (1 + 1e-12) if tau != INF else INF
        wl = self._link_weights(cap_tau)
        cin = np.where(self.cin <= cap_tau, self.cin, INF)
        ar = np.arange(L, dtype=np.int64)
        if tau == INF:
            hi_time = [np.full(L, L, dtype=np.int64) for _ in range(T)]
        else:
            hi_time = [np.searchsorted(self.PS[t], self.PS[t][:L] + cap_tau, side="right") - 1 for t in range(T)]
        # level n: a stage with n stages after it holds what stage 0 of n + 1 stages holds
        his = [np.minimum(self.max_end(t, self.cm.in_flight(0, n + 1)), hi_time[t]) for n in range(len(self.levels) - 1) for t in range(T)]
        order, pos = self.order, self.pos
        # reach[r]: no r stages from layer 0 get past it (any type, the widest window at each start)
        widest = np.maximum.accumulate(np.max(np.stack(his), axis=0))
        depth = len(self.levels) - 1
        reach = [0]
        for _ in range(depth):
            reach.append(L if reach[-1] >= L else int(widest[reach[-1]]))
        G: list[tuple[np.ndarray, int]] = []  # per level >= 1: (values over columns c0.., c0)
        best, best_at = INF, None
        for n in range(len(self.levels) - 1):
            k_his = his[n * T : (n + 1) * T]
            if n == 0:  # the last stage ends at layer L
                i0, i1 = 0, L - 1
                nxt = np.full((len(self.levels[1]), T, L), INF)
                for t in range(T):
                    src, dst = self.moves[0][t]
                    if len(src):
                        nxt[dst, t, :] = np.where(k_his[t] >= L, self.PL[t][L] - self.PL[t][:L], INF)
            else:
                arr, c0 = G[-1]
                w = arr.shape[2]
                cols = slice(c0, c0 + w)
                wlc = wl[:, cols]
                srt = arr[:, order, :]
                A = srt + wlc[order][None]
                prefix = A  # minimum over types of lower bandwidth (inclusive), in place
                suffix = srt.copy()  # minimum over types of higher bandwidth (inclusive)
                for r in range(1, T):
                    np.minimum(prefix[:, r - 1], prefix[:, r], out=prefix[:, r])
                    np.minimum(suffix[:, T - r], suffix[:, T - r - 1], out=suffix[:, T - r - 1])
                maxlen = max(int((h - ar).max()) for h in k_his)
                # a suffix of n + 1 stages must leave a prefix the other stages can cover
                i0, i1 = max(0, c0 - maxlen), min(c0 + w - 2, L - 1, reach[depth - n - 1])
                if i1 < i0:
                    break
                rows = np.arange(i0, i1 + 1)
                nxt = np.full((len(self.levels[n + 1]), T, i1 - i0 + 1), INF)
                left = np.maximum(rows + 1, c0) - c0
                for t in range(T):
                    src, dst = self.moves[n][t]
                    if not len(src):
                        continue
                    r = pos[t]
                    H = suffix[src, r, :] + wlc[t][None, :]
                    if r > 0:
                        np.minimum(H, prefix[src, r - 1, :], out=H)
                    H += self.PL[t][None, cols]
                    right = np.minimum(k_his[t][i0 : i1 + 1], c0 + w - 1) - c0
                    nxt[dst, t, :] = _window_min(H, left, right) - self.PL[t][None, i0 : i1 + 1]
            finite = np.isfinite(nxt).any(axis=(0, 1))
            if not finite.any():
                break
            a = int(np.argmax(finite))
            z = len(finite) - int(np.argmax(finite[::-1]))
            G.append((nxt[:, :, a:z], i0 + a))
            if i0 + a == 0:
                total = nxt[:, :, 0] + cin[None, :]
                flat = int(np.argmin(total))
                if total.flat[flat] < best:
                    best, best_at = float(total.flat[flat]), (n + 1, *divmod(flat, T))
        if best_at is None:
            return None
        return self._rebuild(G, best_at, wl, his)

    def _rebuild(self, G: list[tuple[np.ndarray, int]], at: tuple[int, int, int], wl: np.ndarray, his: list[np.ndarray]) -> list[Stage]:
        L = self.cm.L
        T = len(self.groups)
        n, ui, t = at
        u = self.levels[n][ui]
        i = 0
        typed: list[tuple[int, int, int]] = []
        while True:
            hi = int(his[(n - 1) * T + t][i])
            if n == 1:
                typed.append((t, i, L))
                break
            prev_u = u[:t] + (u[t] - 1,) + u[t + 1 :]
            si = self.index[n - 1][prev_u]
            arr, c0 = G[n - 2]
            w = arr.shape[2]
            link = np.where((self.bw[t] <= self.bw)[:, None], wl[t][None, :], wl)[:, c0 : c0 + w]  # (T', w)
            cand = arr[si] + link  # (T', w)
            V = cand.min(axis=0) + self.PL[t][c0 : c0 + w]
            lo, top = max(i + 1, c0), min(hi, c0 + w - 1)
            j = lo + int(np.argmin(V[lo - c0 : top - c0 + 1]))
            t_next = int(np.argmin(cand[:, j - c0]))
            typed.append((t, i, j))
            u, ui, t, i, n = prev_u, si, t_next, j, n - 1
        used = [0] * len(self.groups)
        stages = []
        for t, i, j in typed:
            stages.append(Stage(self.groups[t][used[t]], i, j))
            used[t] += 1
        return stages

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
    """One (micro-batches, schedule, checkpoint) setting: its solver and best placement so far."""

    def __init__(self, cm: CostModel) -> None:
        self.cm = cm
        self._solver: _Solver | None = None
        self.best: Evaluation | None = None
        self.floor = bottleneck_floor(cm)
        self.sigma = float(cm.lat.min(axis=0).sum())  # raised to the exact min sum by root()

    @property
    def solver(self) -> _Solver:
        """Built on first use: a setting pruned by its bound never needs one."""
        if self._solver is None:
            self._solver = _Solver(self.cm)
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
            self.sigma = self.best.latency_sum

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
        heap = [(self.best.latency_sum + M1 * self.floor, self.floor, self.best.bottleneck, self.best.latency_sum, False)]
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


def settings_grid(
    batch_size: int, microbatches: int | str, schedule: str, checkpoint: str
) -> list[tuple[int, str, str]]:
    """``(microbatches, schedule, checkpoint)`` settings to search, validated, in preference order."""
    if microbatches == "auto":
        ms = microbatch_candidates(batch_size)
    elif isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be 'auto' or an int >= 1")
    elif microbatches > batch_size:
        raise ValueError(
            f"microbatches={microbatches} is more than the batch size {batch_size}; use at most {batch_size} or 'auto'"
        )
    else:
        ms = [microbatches]
    if schedule == "auto":
        schedules = ["1f1b"]  # GPipe is never faster in the model and never uses less memory
    elif schedule in SCHEDULES:
        schedules = [schedule]
    else:
        raise ValueError(f"schedule={schedule!r} is not one of auto, {', '.join(SCHEDULES)}")
    if checkpoint == "auto":
        checkpoints = ["never", "except_last"]  # 'always' saves no more memory than except_last, at more time
    elif checkpoint in CHECKPOINTS:
        checkpoints = [checkpoint]
    else:
        raise ValueError(f"checkpoint={checkpoint!r} is not one of auto, {', '.join(CHECKPOINTS)}")
    return [(m, s, c) for c in checkpoints for s in schedules for m in ms]


def search(
    profile: Profile,
    *,
    microbatches: int | str = "auto",
    schedule: str = "auto",
    checkpoint: str = "auto",
    rtol: float = 1e-9,
) -> Plan:
    """The fastest plan for ``profile`` under its devices' budgets (see the module docstring).

    Usage: ``search(profile, microbatches=8, schedule="1f1b")``. Raises ``PlanError`` (listing
    needed vs available memory and what would make it fit) when no placement fits.
    """
    grid = settings_grid(profile.batch_size, microbatches, schedule, checkpoint)
    tables = time_tables(profile)
    settings = [_Setting(CostModel(profile, m, s, c, tables)) for m, s, c in grid]
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
        from .diagnose import explain_no_fit

        raise explain_no_fit(profile, grid)
    winner = incumbent()
    assert winner is not None and winner.best is not None
    programmes = sum(st.programmes for st in settings)
    return winner.cm.to_plan(winner.best, "torchspan", notes=plan_notes(winner.cm, winner.best, programmes, len(grid)))


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
        f"bottleneck {ev.bottleneck * 1e3:.3f} ms per micro-batch; pipeline fill/drain {ev.latency_sum * 1e3:.3f} ms; "
        f"busiest device {busiest}"
    )
    notes.extend(collapse_notes(cm))
    notes.append(f"searched {settings} setting(s) with {programmes} dynamic programme(s)")
    return notes


def collapse_notes(cm: CostModel) -> list[str]:
    """One note per physical device listed more than once: why the search planned it as one."""
    from ..hardware import format_bytes

    out = []
    for name in dict.fromkeys(cm.names):
        count = cm.names.count(name)
        if count < 2:
            continue
        cap = cm.capacity[cm.names.index(name)]
        budget = "no budget" if cap == INF else f"one budget of {format_bytes(cap)}"
        out.append(
            f"{name} is listed {count} times: the entries are one device ({budget} for all of them; their stages "
            f"would run one after another in one worker), so it was planned as one device - splitting the model "
            f"across its entries is never faster and never needs less memory. To run a pipeline on it anyway "
            f"(e.g. to test one), pass span(model, devices=[...], balance=[...]) or a hand-made Plan; "
            f"CostModel.evaluate(cm.stages_for(plan)) predicts its time"
        )
    return out

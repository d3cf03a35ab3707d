"""The exact placement programme: least ``sum lat + links`` under a bottleneck cap, for one ``CostModel``.

Usage::

    solver = Solver(CostModel(profile, 8, "1f1b", "never"))
    stages = solver.run(tau)          # list[Stage], or None when nothing fits with every stage <= tau

For a bottleneck cap ``tau`` the best placement minimises the additive part ``sum lat + links``
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

Entries that are one physical device are collapsed to their first entry (``device_groups``); why
that loses nothing is in ``optimize``'s docstring.

``Solver(cm, sequence=(t0, t1, ...))`` solves the same programme restricted to placements whose stages
run on exactly these device types in this order (``stable`` compares device orders this way): level
``n`` then admits only the type ``sequence[-1 - n]`` and only a placement of ``len(sequence)`` stages counts.
"""

from __future__ import annotations

import functools

import numpy as np

from .cost import CostModel
from .physical import INF, identity, link_bandwidth
from .stages import Stage

__all__ = ["Solver", "device_groups", "physical_ends", "in_flight_counts"]


def in_flight_counts(cm: CostModel) -> list[int]:
    """The in-flight counts a stage can have under ``cm``'s schedule (GPipe and merged-weights: ``M``; 1F1B:
    ``1..M``; zero-bubble: one count for every stage, ``cm.in_flight``)."""
    stages = len(set(cm.rep))
    if cm.schedule in ("zero-bubble", "merged-weights"):
        return [cm.in_flight(0, 1)]
    return [cm.M] if cm.schedule == "gpipe" else list(range(1, min(cm.M, stages) + 1))


def physical_ends(cm: CostModel) -> tuple[list[int], dict[int, np.ndarray]]:
    """``(physical devices as their first entries, {k: max_end rows for their budgets})``."""
    phys = sorted(set(cm.rep))
    caps = np.array([cm.capacity[d] for d in phys], dtype=np.float64)
    return phys, {k: cm.max_end(caps, k) for k in in_flight_counts(cm)}


def device_groups(
    cm: CostModel, ends: tuple[list[int], dict[int, np.ndarray]] | None = None
) -> list[list[int]]:
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
    """``out[r, q] = min(V[r, left[q] .. right[q]])`` (``inf`` where ``right[q] < left[q]``), by a sparse
    table."""
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
) -> tuple[
    list[list[tuple[int, ...]]], list[dict[tuple[int, ...], int]], list[list[tuple[np.ndarray, np.ndarray]]]
]:
    """States per level (devices of each type used), their indices, and the moves between levels.

    ``moves[n][t] = (src, dst)``: adding a stage of type ``t`` in front of level-``n`` states ``src``
    gives level-``n+1`` states ``dst``.
    """
    T = len(sizes)
    levels: list[list[tuple[int, ...]]] = [[tuple(0 for _ in range(T))]]
    for _ in range(min(sum(sizes), L)):
        nxt = sorted(
            {u[:t] + (u[t] + 1,) + u[t + 1 :] for u in levels[-1] for t in range(T) if u[t] < sizes[t]}
        )
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


class Solver:
    """Min ``sum lat + links`` placement under a bottleneck cap, for one ``CostModel``.

    Each level's table ``G[n]`` (suffix cost by state, type of the suffix's first stage, first
    layer) is kept only over the band of first layers where some value is finite, and the best
    link into the next stage's type is found for every type at once: a link costs
    ``2 * out / min(bw_t, bw_t')``, so sorting the types by host bandwidth turns the minimum over
    ``t'`` into a prefix minimum and a suffix minimum.
    """

    def __init__(self, cm: CostModel, sequence: tuple[int, ...] | None = None) -> None:
        self.cm = cm
        self.sequence = sequence  # type indices (into ``groups``), stage by stage; None: any order and count
        ends = physical_ends(cm)
        groups = device_groups(cm, ends)
        self.groups = groups
        T = len(groups)
        L = cm.L
        rep = [g[0] for g in groups]
        self.PL = cm.PL[rep]
        self.PL_last = cm.PL_last[
            rep
        ]  # the last stage's latency (zero-bubble: its whole backward; merged-weights: + tail)
        self.PL_full = cm.PL_full[rep]  # a single stage's (nothing waits for it: no tail)
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

    def _allowed(self, n: int) -> range | tuple[int]:
        """Device types a stage with ``n`` stages after it may take: any, or the one ``sequence`` names."""
        return range(len(self.groups)) if self.sequence is None else (self.sequence[-1 - n],)

    def max_end(self, t: int, k: int) -> np.ndarray:
        return self._max_end[k][t]

    def _link_weights(self, cap_tau: float) -> np.ndarray:
        """``(T, L+1)``: seconds of a link at each boundary at type ``t``'s host bandwidth, ``inf`` above the
        cap."""
        with np.errstate(divide="ignore", invalid="ignore"):
            w = np.where(np.isinf(self.bw)[:, None], 0.0, self.base[None, :] / self.bw[:, None])
        w[:, self.cm.uncut] = INF  # cuts that would split a tie the model keeps (``CostModel.keeping``)
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
        if tau == INF:
            hi_time = [np.full(L, L, dtype=np.int64) for _ in range(T)]
        else:
            hi_time = [
                np.searchsorted(self.PS[t], self.PS[t][:L] + cap_tau, side="right") - 1 for t in range(T)
            ]
        # level n: a stage with n stages after it holds what stage 0 of n + 1 stages holds
        his = [
            np.minimum(self.max_end(t, self.cm.in_flight(0, n + 1)), hi_time[t])
            for n in range(len(self.levels) - 1)
            for t in range(T)
        ]
        # reach[r]: no r stages from layer 0 get past it (any type, the widest window at each start)
        widest = np.maximum.accumulate(np.max(np.stack(his), axis=0))
        depth = len(self.levels) - 1
        reach = [0]
        for _ in range(depth):
            reach.append(L if reach[-1] >= L else int(widest[reach[-1]]))
        G: list[tuple[np.ndarray, int]] = []  # per level >= 1: (values over columns c0.., c0)
        best, best_at = INF, None
        for n in range(
            len(self.levels) - 1 if self.sequence is None else min(len(self.sequence), len(self.levels) - 1)
        ):
            k_his = his[n * T : (n + 1) * T]
            if n == 0:  # the last stage ends at layer L
                i0, nxt = 0, self._last_level(k_his)
            else:
                step = self._next_level(n, *G[-1], k_his, wl, reach[depth - n - 1])
                if step is None:
                    break
                nxt, i0 = step
            finite = np.isfinite(nxt).any(axis=(0, 1))
            if not finite.any():
                break
            a = int(np.argmax(finite))
            z = len(finite) - int(np.argmax(finite[::-1]))
            G.append((nxt[:, :, a:z], i0 + a))
            if i0 + a == 0 and (self.sequence is None or n + 1 == len(self.sequence)):
                total = nxt[:, :, 0] + cin[None, :]
                flat = int(np.argmin(total))
                if total.flat[flat] < best:
                    best, best_at = float(total.flat[flat]), (n + 1, *divmod(flat, T))
        if best_at is None:
            return None
        return self._rebuild(G, best_at, wl, his)

    def _last_level(self, k_his: list[np.ndarray]) -> np.ndarray:
        """Level 0 of ``run``: the last stage, ending at layer L, by its first layer (columns), level and
        type."""
        L = self.cm.L
        nxt = np.full((len(self.levels[1]), len(self.groups), L), INF)
        for t in self._allowed(0):
            src, dst = self.moves[0][t]
            if len(src):
                nxt[dst, t, :] = np.where(k_his[t] >= L, self.PL_last[t][L] - self.PL_last[t][:L], INF)
                nxt[dst, t, 0] = self.PL_full[t][L] if k_his[t][0] >= L else INF  # the only stage
        return nxt

    def _next_level(
        self, n: int, arr: np.ndarray, c0: int, k_his: list[np.ndarray], wl: np.ndarray, reach: int
    ) -> tuple[np.ndarray, int] | None:
        """Level ``n`` of ``run`` from level ``n - 1`` (``arr``, its first column ``c0``): one more stage in
        front, over the rows its start can take; ``(values, first row)``, or ``None`` when no start is
        left."""
        L, T = self.cm.L, len(self.groups)
        order, pos = self.order, self.pos
        ar = np.arange(L, dtype=np.int64)
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
        i0, i1 = max(0, c0 - maxlen), min(c0 + w - 2, L - 1, reach)
        if i1 < i0:
            return None
        rows = np.arange(i0, i1 + 1)
        nxt = np.full((len(self.levels[n + 1]), T, i1 - i0 + 1), INF)
        left = np.maximum(rows + 1, c0) - c0
        for t in self._allowed(n):
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
        return nxt, i0

    def _rebuild(
        self, G: list[tuple[np.ndarray, int]], at: tuple[int, int, int], wl: np.ndarray, his: list[np.ndarray]
    ) -> list[Stage]:
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

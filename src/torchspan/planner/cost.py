"""The planner's cost model: predicted step time and per-device memory of a pipeline placement.

Usage::

    cm = CostModel(profile, microbatches=8, schedule="1f1b", recompute="never")
    ev = cm.evaluate([Stage(device=0, start=0, end=3), Stage(device=2, start=3, end=7)])
    ev.step_time, ev.fits, ev.memory[0].total, ev.device_memory
    ev = cm.evaluate(cm.stages_for(plan))          # any Plan over these devices, e.g. a hand-made one

Notation: ``B`` samples per step split into ``M`` micro-batches of ``b = ceil(B / M)`` samples;
stage ``s`` (of ``S``) runs layers ``[i, j)`` on device ``d``. Per micro-batch on ``d``:
``F_s = sum forward_seconds(d, b)`` and ``Bw_s = sum backward_seconds(d, b)`` over its layers.

Physical devices. List entries that are the same physical device (``['cpu', 'cpu']``, a present GPU
listed twice; see ``physical.identity``) are ONE device ``p``: the model takes its times and host link from
its first entry and its budget ``capacity_p`` as the smallest among its entries (``memory={'cpu':
X}`` gives every ``'cpu'`` entry ``X``; ``X`` then bounds all of them together). The runtime
(``span``, default ``workers="device"``) runs every stage of one device in one worker, one action
after another: stages on distinct devices overlap, stages on one device never do.

Time. Recompute runs a stage's forward again before its backward:

=============  =====================  ======================
recompute     latency  ``lat_s``     steady  ``st_s``
=============  =====================  ======================
never          ``F + Bw``             ``F + Bw + G``
except_last    ``F + Bw``             ``2F + Bw + G``
always         ``2F + Bw``            ``2F + Bw + G``
=============  =====================  ======================

``G_s = 3 * grad_bytes_s / membw(d)``: every micro-batch after the first adds its gradients into
``.grad`` (reads both, writes one) at the device's memory bandwidth (``extra["memory_bandwidth"]``
times ``extra["memory_efficiency"]``: measured for a present CPU, from the catalog for a described
GPU; 0 without a figure). The profile times each layer's backward with ``.grad`` unset, so this
is the part of a real multi-micro-batch step it does not see (about 25% of an MLP's time at 32
samples per micro-batch on a CPU); merged-weights has none (below).

Links are pipeline resources too. Boundary ``j`` between stages on devices ``d`` and ``d'`` carries
the activation forward and its gradient back: ``c_j = 2 * out_{j-1} / bw(d, d')`` (bytes of one
micro-batch); the batch enters the first stage from the host: ``c_in = in_0 / bw(host, d_0)``. ``bw`` is the
smaller host bandwidth of the two devices (device-to-device copies go through the host); the CPU
*is* the host (infinite bandwidth), and stages on one physical device hand over for free.

A physical device's busy time per micro-batch is the sum over its stages, ``R_p = sum_{s on p} st_s``:

    step_time = sum_s lat_s + c_in + sum_j c_j  +  (M - 1) * max(max_p R_p, max_j c_j, c_in)

i.e. one micro-batch's trip through the whole pipeline (fill and drain: the bubble; serial whether or not
stages share a device) plus ``M - 1`` further micro-batches paced by the slowest resource: a physical device
working through all of its stages, or a link. So a device that holds every stage costs ``M`` times its whole
forward + backward (+ recompute) however many stages it is cut into. GPipe and 1F1B share this time (same
bubble); they differ in memory. Zero-bubble (ZB-H1) splits each backward into the inputs' part ``B`` and the
weights' part ``W`` (``B = W = Bw / 2`` here) and runs the drain's ``W``s in the bubble: every stage but the
last has latency ``lat_s - Bw_s / 2`` (one micro-batch's trip waits for its ``F`` and ``B`` only), so with
equal stages the bubble is ``(S - 1)(F + Bw/2)`` against 1F1B's ``(S - 1)(F + Bw)`` (ZB-H1's
``(S - 1)(F + B - W)`` for ``S = 2``; conservative beyond); one stage gains nothing, nor do stages
sharing a physical device (no bubble to fill). Merged-weights (all ``W`` at the end as one pass,
``runtime.linearw``) has no ``G`` but ends in a stage's ``W`` of all ``M`` micro-batches, charged to the last
of several stages (``+ (M - 1) Bw/2``, no merging gain; stages on one CPU overlap too): it wins where ``G``
outweighs that. Optimizer step: not modelled.

Memory of stage ``s`` (bytes), with ``k`` micro-batches in flight (GPipe: ``k = M``;
1F1B: ``k = min(M, S - s)``; zero-bubble: ``k = min(M, max(S, D))`` on every stage, a micro-batch held until
its ``W``: ``min(M, S)`` really, counted for the most stages the search can make, ``D`` listed devices, so
that the search, building stages from the last one without knowing ``S``, charges what a plan does;
merged-weights: ``k = M``, held until the weight pass), and per micro-batch (``fixed + b * per_sample`` from
the profile) ``A`` the stage's saved activations (plus, for a stage that does not start at layer 0, the copy
of saved tensors its first layer shares with the layer before: ``shared_activation_bytes``; plus, for
the last stage, the loss's saved input ``loss = out_{L-1}``, see below), ``in`` its input boundary
and ``out_max`` its largest layer output:

    state       = params + grads + optimizer state + buffers
    activations = never: k*A;  except_last: (k-1)*in + A;  always: k*in + A
    workspace   = in + 2 * out_max      (received input, largest output and its gradient)

Assumption about the loss: the profile sizes the model only, but the runtime computes the loss
on the last stage, inside that stage's forward (and its recompute), and autograd keeps what the
loss saves until that micro-batch's backward. The model charges one tensor the size of the model's
output per micro-batch (``loss = output_fixed_bytes + b * output_bytes`` of the last layer): a
loss that saves its input, as cross-entropy (its log-softmax) and MSE do. Not charged: what a
loss saves besides (cross-entropy's class indices, a few bytes per sample; MSE's target, another
output-sized tensor when the target is a float tensor of the output's shape, so MSE's last stage
is under-predicted by one output per micro-batch in flight) and losses that save nothing.

A placement fits when on every physical device ``p`` the SUM over its stages of
``state + activations + workspace`` is at most ``capacity_p`` (stages sharing a device share its
memory; the sum of their peaks bounds their joint peak from above).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..profiler.costs import Profile
from ..schedule import RECOMPUTE_MODES, SCHEDULES
from .costplan import PlanConversion
from .interleaved import INTERLEAVED, evaluate_interleaved
from .physical import INF, budget_of, host_bandwidth, link_bandwidth, memory_bandwidth, physical_names
from .stages import Evaluation, Stage, StageMemory
from .ties import TieCost, copy_times

__all__ = ["CostModel", "time_tables"]


def _prefix(values: Sequence[float] | np.ndarray) -> np.ndarray:
    out = np.zeros(len(values) + 1, dtype=np.float64)
    np.cumsum(np.asarray(values, dtype=np.float64), out=out[1:])
    return out


def time_tables(profile: Profile) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(forward_fixed, forward_per_sample, backward_fixed, backward_per_sample)``, each ``(devices,
    layers)``.

    Raises ``ValueError`` when a layer lacks a time for some device or a time is negative.
    """
    D = len(profile.devices)
    out = []
    for attr in ("forward_fixed", "forward_per_sample", "backward_fixed", "backward_per_sample"):
        rows = []
        for lay in profile.layers:
            vals = getattr(lay, attr)
            if len(vals) != D:
                raise ValueError(
                    f"profile layer {lay.name!r} has {len(vals)} {attr} entries for {D} devices; "
                    "re-profile with the same device list"
                )
            rows.append(vals)
        arr = np.asarray(rows, dtype=np.float64).T.reshape(D, len(profile.layers))
        if not np.all(np.isfinite(arr)) or (arr < 0).any():
            raise ValueError(
                f"profile has a negative or non-finite {attr}; times must be finite seconds >= 0"
            )
        out.append(np.ascontiguousarray(arr))
    return out[0], out[1], out[2], out[3]


def _check_settings(profile: Profile, microbatches: int, schedule: str, recompute: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if not profile.layers:
        raise ValueError("profile has no layers; profile a model with at least one child module")
    if not profile.devices:
        raise ValueError("profile has no devices; profile with at least one device, e.g. devices='cpu'")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be an int >= 1")
    if microbatches > profile.batch_size:
        raise ValueError(
            f"microbatches={microbatches} is more than the batch size {profile.batch_size}; "
            f"use at most {profile.batch_size} micro-batches (one sample each)"
        )


def _range_max_table(values: np.ndarray) -> np.ndarray:
    """Sparse table for range maxima: row ``p`` holds ``max(values[i : i + 2**p])`` (clipped at the end)."""
    rows = [values]
    n = len(values)
    while (1 << len(rows)) <= n:
        prev = rows[-1]
        half = 1 << (len(rows) - 1)
        nxt = prev.copy()
        nxt[: n - half] = np.maximum(prev[: n - half], prev[half:])
        rows.append(nxt)
    return np.stack(rows)


class CostModel(PlanConversion):
    """Prefix sums over a ``Profile`` for one micro-batch count, schedule and recompute mode (plans to and
    from placements: ``PlanConversion``; the interleaved schedule's price: ``planner.interleaved``)."""

    def __init__(
        self,
        profile: Profile,
        microbatches: int,
        schedule: str,
        recompute: str,
        tables: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
        ties: Sequence[TieCost] = (),
    ) -> None:
        """``tables``: ``time_tables(profile)`` when the caller already has them (saves the work).
        ``ties``: tied parameters, charged when a placement splits them (module docstring)."""
        _check_settings(profile, microbatches, schedule, recompute)
        self.profile = profile
        self.M = microbatches
        self.schedule = schedule
        self.recompute = recompute
        self.L = len(profile.layers)
        self.D = len(profile.devices)
        self.ties = tuple(ties)
        if any(t.layers[-1] >= self.L for t in self.ties):
            raise ValueError(
                f"ties {[t.name for t in self.ties]} name a layer outside the profile's {self.L}"
            )
        self.uncut = np.zeros(self.L + 1, dtype=bool)  # stage boundaries the search may not cut (``keeping``)
        self.b = math.ceil(profile.batch_size / microbatches)
        # physical devices: entries that are one device share its first entry's times and link
        self.names = physical_names(profile.devices)
        first: dict[str, int] = {}
        self.rep = [first.setdefault(name, d) for d, name in enumerate(self.names)]
        self._time_sums(time_tables(profile) if tables is None else tables)
        self._memory_sums()
        own = [budget_of(d) for d in profile.devices]
        shared = {name: min(c for c, n in zip(own, self.names) if n == name) for name in first}
        self.capacity = [shared[name] for name in self.names]  # per entry: its physical device's budget
        self.host_bw = [host_bandwidth(profile.devices[r]) for r in self.rep]
        self._out_table = _range_max_table(self.out)

    def _time_sums(self, tables: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> None:
        """Per-micro-batch times by physical device and layer (``fwd``, ``bwd``, ``lat``, ``steady``) and
        their prefix sums."""
        self.fwd = (tables[0] + self.b * tables[1])[self.rep]
        self.bwd = (tables[2] + self.b * tables[3])[self.rep]
        lat = full = (
            self.fwd + self.bwd if self.recompute != "always" else 2 * self.fwd + self.bwd
        )  # full: one device's
        whole = (
            lat if self.schedule != "merged-weights" else lat + (self.M - 1) * 0.5 * self.bwd
        )  # last stage: ... + tail
        if (
            self.schedule == "zero-bubble"
        ):  # the trip waits for the other stages' input backwards only; W fills the bubble
            lat = lat - 0.5 * self.bwd
        steady = self.fwd + self.bwd if self.recompute == "never" else 2 * self.fwd + self.bwd
        # G: gradient accumulation of every micro-batch after the first (read both, write one); none merged
        membw = [memory_bandwidth(self.profile.devices[r]) for r in self.rep]
        grads = np.array([float(lay.grad_bytes) for lay in self.profile.layers])
        self.accumulate = np.stack([3.0 * grads / bw if bw > 0 else np.zeros(self.L) for bw in membw])
        self.lat, self.steady = lat, steady if self.schedule == "merged-weights" else steady + self.accumulate
        self.PL = np.stack([_prefix(row) for row in lat])  # (D, L+1)
        self.PL_last = self.PL if lat is whole else np.stack([_prefix(row) for row in whole])
        self.PL_full = (
            self.PL
            if lat is full
            else self.PL_last
            if whole is full
            else np.stack([_prefix(r) for r in full])
        )
        self.PS = np.stack([_prefix(row) for row in self.steady])
        self.PF = np.stack([_prefix(row) for row in self.fwd])
        self.PB = np.stack([_prefix(row) for row in self.bwd])

    def _memory_sums(self) -> None:
        """Prefix sums of state bytes, per-micro-batch saved activations, and the boundary and loss
        tensors."""
        layers = self.profile.layers
        self.P_param = _prefix([lay.param_bytes for lay in layers])
        self.P_grad = _prefix([lay.grad_bytes for lay in layers])
        self.P_opt = _prefix([lay.optimizer_bytes for lay in layers])
        self.P_buf = _prefix([lay.buffer_bytes for lay in layers])
        self.P_state = self.P_param + self.P_grad + self.P_opt + self.P_buf
        b = self.b
        # bytes per micro-batch: per-sample figures times b plus any per-call part
        self.P_act = _prefix([lay.saved_bytes(b) for lay in layers])
        # saved tensors a layer shares with earlier layers: a stage starting there holds its own copy
        self.shared = np.array([b * lay.shared_activation_bytes for lay in layers] + [0.0])
        self.shared[0] = 0.0
        self.out = np.array([lay.output_fixed_bytes + b * lay.output_bytes for lay in layers])
        # the loss's saved input (one model output per micro-batch), held by the stage ending at layer L
        self.loss_saved = float(self.out[-1])
        self.tail = np.zeros(self.L + 1)
        self.tail[self.L] = self.loss_saved
        # input boundary of a stage starting at layer i
        self.inb = np.concatenate([[b * float(self.profile.input_bytes)], self.out[:-1]])

    # ------------------------------------------------------------------ pieces
    def in_flight(self, stage_index: int, num_stages: int) -> int:
        """Micro-batches whose activations a stage holds at once under the schedule."""
        if self.schedule in (
            "gpipe",
            "merged-weights",
        ):  # merged-weights: every micro-batch held until the weight pass
            return self.M
        if (
            self.schedule == "zero-bubble"
        ):  # held until its weight backward: 1F1B's first-stage bound on every stage,
            return min(
                self.M, max(num_stages, self.D)
            )  # counted for as many stages as devices (the search's most)
        return min(self.M, num_stages - stage_index)

    def max_output(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Largest per-sample layer output over layers ``[i, j)`` (``j > i``), vectorised."""
        i = np.asarray(i, dtype=np.int64)
        j = np.asarray(j, dtype=np.int64)
        length = np.maximum(j - i, 1)
        p = np.floor(np.log2(length)).astype(np.int64)
        table = self._out_table
        return np.maximum(table[p, i], table[p, j - (1 << p)])

    def _in_flight(self, act: Any, inb: Any, k: int) -> Any:
        """Saved-activation bytes with ``k`` micro-batches in flight (arrays or floats alike).

        ``act``: one micro-batch's saved bytes in the stage; ``inb``: its input bytes, all that a
        micro-batch under recompute keeps. ``except_last`` keeps the last micro-batch's full set.
        """
        if self.recompute == "never":
            return k * act
        if self.recompute == "except_last":
            return (k - 1) * inb + act
        return k * inb + act

    def _act_work(self, i: np.ndarray, j: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(activation bytes, workspace bytes)`` of stages ``[i, j)`` holding ``k`` micro-batches,
        unrounded."""
        act = self.P_act[j] - self.P_act[i] + self.shared[i] + self.tail[j]
        inb = self.inb[i]
        return self._in_flight(act, inb, k), inb + 2 * self.max_output(i, j)

    def memory_total(self, i: np.ndarray, j: np.ndarray, k: int) -> np.ndarray:
        """Predicted bytes of stages ``[i, j)`` (``j > i``) holding ``k`` micro-batches, vectorised."""
        i = np.asarray(i, dtype=np.int64)
        j = np.asarray(j, dtype=np.int64)
        acts, work = self._act_work(i, j, k)
        # whole bytes, rounded up as ``stage_memory`` reports them, so that fitting here means fitting there
        return np.round(self.P_state[j] - self.P_state[i]) + np.ceil(acts) + np.ceil(work)

    def stage_memory(self, start: int, end: int, k: int) -> StageMemory:
        """Bytes by kind for layers ``[start, end)`` holding ``k`` micro-batches."""
        acts, work = self._act_work(np.array([start]), np.array([end]), k)
        return StageMemory(
            params=int(round(self.P_param[end] - self.P_param[start])),
            grads=int(round(self.P_grad[end] - self.P_grad[start])),
            optimizer=int(round(self.P_opt[end] - self.P_opt[start])),
            buffers=int(round(self.P_buf[end] - self.P_buf[start])),
            activations=int(math.ceil(acts[0])),
            workspace=int(math.ceil(work[0])),
        )

    def max_end(self, capacity: float | np.ndarray, k: int) -> np.ndarray:
        """For each start ``i`` in ``0..L-1``: the largest ``j`` whose stage ``[i, j)`` fits ``capacity``.

        ``j == i`` means not even layer ``i`` alone fits. Memory grows with ``j``, so this is a
        vectorised binary search. An array of capacities gives one row per capacity.
        """
        L = self.L
        caps = np.asarray(capacity, dtype=np.float64)
        i = np.broadcast_to(np.arange(L, dtype=np.int64), (*caps.shape, L))
        cap = caps[..., None]
        lo = i.copy()  # known to fit (empty stage)
        hi = np.full(i.shape, L, dtype=np.int64)
        while True:
            open_ = lo < hi
            if not open_.any():
                return lo
            mid = np.where(open_, (lo + hi + 1) // 2, lo + 1)
            mid = np.minimum(mid, L)
            ok = self.memory_total(i, mid, k) <= cap
            lo = np.where(open_ & ok, mid, lo)
            hi = np.where(open_ & ~ok, mid - 1, hi)

    def link_time(self, boundary: int, a: int, b: int) -> float:
        """Seconds per micro-batch over boundary ``j`` (activation forward plus gradient back)."""
        if self.names[a] == self.names[b]:
            return 0.0  # one physical device: the next stage reads the tensor in place
        bw = link_bandwidth(self.profile.devices, self.rep[a], self.rep[b])
        return 0.0 if bw == INF else 2.0 * float(self.out[boundary - 1]) / bw

    def input_time(self, device: int) -> float:
        """Seconds per micro-batch to bring the input from the host to ``device``."""
        bw = self.host_bw[device]
        return 0.0 if bw == INF else float(self.inb[0]) / bw

    def keeping(self, ties: Sequence[TieCost]) -> CostModel:
        """This model with no cut between the layers of any of ``ties`` (the search's "tie kept" variant)."""
        out = copy.copy(self)
        out.uncut = self.uncut.copy()
        for tie in ties:
            lo, hi = tie.span
            out.uncut[lo : hi + 1] = True
        return out

    def tie_copies(
        self, stages: Sequence[Stage], ties: Sequence[TieCost] | None = None
    ) -> list[tuple[float, float]]:
        """Per stage ``(forward, backward)`` seconds of tied-parameter copies per micro-batch."""
        devs = self.profile.devices
        return copy_times(
            self.ties if ties is None else ties,
            stages,
            self.names,
            lambda a, b: link_bandwidth(devs, self.rep[a], self.rep[b]),
        )

    # ------------------------------------------------------------------ whole placements
    def check_stages(self, stages: Sequence[Stage]) -> None:
        """Raise ``ValueError`` unless ``stages`` cover the layers contiguously on listed devices.

        Several stages may name one device (or entries of one physical device): they share it.
        """
        if not stages:
            raise ValueError("a placement needs at least one stage")
        pos = 0
        for s in stages:
            if s.start != pos or s.end <= s.start:
                raise ValueError(f"stages {list(stages)} do not cover layers 0..{self.L} contiguously")
            if not 0 <= s.device < self.D:
                raise ValueError(f"stages {list(stages)} name a device outside 0..{self.D - 1}")
            pos = s.end
        if pos != self.L:
            raise ValueError(f"stages {list(stages)} do not cover layers 0..{self.L} contiguously")

    def evaluate(self, stages: Sequence[Stage], ties: Sequence[TieCost] | None = None) -> Evaluation:
        """Step time and memory of any placement, physical devices shared (see the module docstring).

        ``ties``: charge these instead of the model's own (``()``: none)."""
        stages = tuple(stages)
        self.check_stages(stages)
        if self.schedule == INTERLEAVED:  # looped stages, the bubble divided by the stages per device
            return evaluate_interleaved(self, stages, ties)
        return self.evaluate_with(stages, ties, [self.in_flight(i, len(stages)) for i in range(len(stages))])

    def evaluate_with(
        self, stages: tuple[Stage, ...], ties: Sequence[TieCost] | None, flight: Sequence[int]
    ) -> Evaluation:
        """``evaluate`` with stage ``s`` holding ``flight[s]`` micro-batches (what the schedule keeps in
        flight)."""
        S = len(stages)
        fwd, bwd, lat, mem, tied = [], [], [], [], []
        busy: dict[str, float] = {}
        held: dict[str, int] = {}
        rc = self.recompute
        apart = (
            len({self.names[s.device] for s in stages}) == S
        )  # split backwards gain only across distinct devices
        for idx, (s, (tf, tb)) in enumerate(zip(stages, self.tie_copies(stages, ties))):
            d = s.device
            fwd.append(float(self.PF[d, s.end] - self.PF[d, s.start]))
            bwd.append(float(self.PB[d, s.end] - self.PB[d, s.start]))
            tied.append((1 if rc == "never" else 2) * tf + tb)  # steady: recompute copies again
            PL = (
                self.PL_full
                if S == 1
                else self.PL_last
                if idx == S - 1
                else self.PL
                if apart
                else self.PL_full
            )
            lat.append(float(PL[d, s.end] - PL[d, s.start]) + (2 if rc == "always" else 1) * tf + tb)
            mem.append(self.stage_memory(s.start, s.end, flight[idx]))
            name = self.names[d]
            busy[name] = busy.get(name, 0.0) + float(self.PS[d, s.end] - self.PS[d, s.start]) + tied[-1]
            held[name] = held.get(name, 0) + mem[-1].total
        links = [self.input_time(stages[0].device)]
        links += [self.link_time(a.end, a.device, nb.device) for a, nb in zip(stages, stages[1:])]
        latency = sum(lat) + sum(links)
        bottleneck = max(max(busy.values()), max(links))
        where = {self.names[s.device]: self.capacity[s.device] for s in stages}
        return Evaluation(
            stages=stages,
            forward=tuple(fwd),
            backward=tuple(bwd),
            links=tuple(links),
            memory=tuple(mem),
            latency_sum=latency,
            bottleneck=bottleneck,
            step_time=latency + (self.M - 1) * bottleneck,
            devices=tuple(busy),
            device_busy=tuple(busy.values()),
            device_memory=tuple(held[n] for n in busy),
            device_capacity=tuple(where[n] for n in busy),
            ties=tuple(tied),
        )

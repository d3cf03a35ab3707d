"""A cluster candidate: one data x pipeline placement, its step split and each stage's gradient reduction.

``evaluate_cluster`` prices a replica placement on a ``Cluster`` (compute, hand-overs, all-reduces
overlapping backward, tied parameters' all-reduces); ``even_cut`` cuts a replica into exactly ``pp``
stages. The formulas are ``planner.cluster``'s module docstring; the sharded variants' are
``planner.sharded``'s. ``ClusterCandidate`` is what ``cluster_search`` and ``planner.strategies``
compare.

Usage::

    cm = CostModel(replica_profile(profile, 2, 4), 2, "1f1b", "never")
    cand = evaluate_cluster(cm, even_cut(cm, 2), cluster, [[0, 1], [2, 3]], "replicas-in-node")
    cand.step, cand.strategy, cand.device_memory
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..hardware import format_bytes
from ..hardware.links import Link
from .comm import BUCKET_BYTES, allreduce_time, buckets, finish_time, p2p_time
from .cost import CostModel
from .physical import INF, host_bandwidth
from .stages import Evaluation, Stage, StageMemory
from .ties import TieCost, split_stages
from .topology import Cluster

Reduce = Callable[[float, int, Link], float]  # (bytes, ranks, link) -> seconds, as comm.allreduce_time

__all__ = [
    "ClusterCandidate",
    "Reduction",
    "evaluate_cluster",
    "even_cut",
    "stage_reductions",
    "slowest_hop",
    "leads",
    "strategy_of",
]


@dataclass(frozen=True)
class Reduction:
    """One stage's gradient all-reduce over its replicas (``stage_reductions``).

    ``seconds``: all of it, over ``buckets`` all-reduces on ``link``; ``end``: when the last ends, in
    seconds after the pipeline's last backward ends (``<= 0``: hidden behind backward).
    """

    link: str
    seconds: float
    buckets: int
    end: float


def strategy_of(dp: int, pp: int, shard: bool = False, offload: str | None = None, tp: int = 1) -> str:
    """The strategy a data x pipeline choice is: ``replicas``, ``sharded``, ``sharded + offload``,
    ``pipeline``, ``hybrid`` (pipeline x replicas), ``pipeline x sharded`` or, each layer split over ``tp >
    1`` ranks, ``tensor parallel x sharded`` (``planner.strategies.STRATEGIES``,
    ``planner.tensorparallel``)."""
    if tp > 1:
        return "tensor parallel x pipeline" if pp > 1 else "tensor parallel x sharded"
    if pp == 1:
        return "sharded + offload" if offload else "sharded" if shard else "replicas"
    if dp == 1:
        return "pipeline"
    return "pipeline x sharded" if shard else "hybrid"


@dataclass(frozen=True)
class ClusterCandidate:
    """One data x pipeline choice and its predicted step: ``step = compute + p2p + allreduce + ties +
    optimizer + tp_comm``.

    Sharded (``shard``): ``allreduce`` is every collective the step waits for (all-gathers and
    reduce-scatters, with offload their host copies too), ``memory`` one rank's device bytes per stage,
    ``host`` the host bytes of one node (offload), ``optimizer`` the CPU optimizer step (offload), ``totals``
    the collectives in full. Tensor parallel (``tp > 1``, ``planner.tensorparallel``): ``dp`` replicas of
    ``tp`` ranks each, ``stage_ranks`` one row of every rank (replica ``r``: ``row[r * tp:(r + 1) * tp]``),
    ``tp_comm`` its all-reduces (not overlapped).
    """

    dp: int
    layout: str
    stage_ranks: list[list[int]]
    cm: CostModel
    evaluation: Evaluation
    compute: float
    p2p: float
    allreduce: float  # exposed: the part of the all-reduce the step waits for after the last backward
    links: tuple[str, ...]  # per boundary: the link key its hand-overs use
    reductions: tuple[Reduction, ...]  # per stage
    ties: float = 0.0  # exposed beyond ``allreduce``: the tied parameters' all-reduces (split ties only)
    tie_reductions: tuple[
        tuple[TieCost, int, Reduction], ...
    ] = ()  # (tie, ranks in its group, its all-reduce)
    shard: bool = False
    offload: str | None = None
    memory: tuple[StageMemory, ...] = ()  # sharded: one rank's device bytes per stage (else the evaluation's)
    host: int = 0  # offload: bytes in one node's host memory
    optimizer: float = 0.0  # offload: the optimizer step on the CPU, exposed
    totals: tuple[
        tuple[str, float], ...
    ] = ()  # sharded: ("allgather_total", s), ("reduce_scatter_total", s), ...
    fits: bool = True
    why: str = ""  # when it does not fit: what is over its budget
    tp: int = 1  # ranks each layer is split over (tensor parallel), within a node
    tp_comm: float = 0.0  # tensor parallel: seconds of its all-reduces per step, on the compute's path

    @property
    def pp(self) -> int:
        return len(self.stage_ranks)

    @property
    def step(self) -> float:
        return self.compute + self.p2p + self.allreduce + self.ties + self.optimizer + self.tp_comm

    @property
    def strategy(self) -> str:
        return strategy_of(self.dp, self.pp, self.shard, self.offload, self.tp)

    @property
    def stage_memory(self) -> tuple[StageMemory, ...]:
        """Per stage: one rank's device bytes by kind."""
        return self.memory or tuple(self.evaluation.memory)

    @property
    def peak(self) -> int:
        """The most device bytes any rank holds."""
        return max(m.total for m in self.stage_memory)

    @property
    def allreduce_total(self) -> float:
        """The longest stage's all-reduce, were none of it hidden (stages reduce at once, on disjoint
        ranks)."""
        return max(r.seconds for r in self.reductions)

    @property
    def reduce_links(self) -> tuple[str, ...]:
        """Per stage: the link key its all-reduce uses."""
        return tuple(r.link for r in self.reductions)

    def times(self) -> dict[str, float]:
        """The step split (``Plan.predicted_times``): the parts not named ``*_total`` add up to ``step``."""
        if self.tp > 1:
            return {
                "compute": self.compute,
                "tp_allreduce": self.tp_comm,
                "collectives": self.allreduce,
                **dict(self.totals),
                "p2p": self.p2p,
                "ties": self.ties,
            }
        if not self.shard:
            return {
                "compute": self.compute,
                "allreduce": self.allreduce,
                "allreduce_total": self.allreduce_total,
                "p2p": self.p2p,
                "ties": self.ties,
            }
        out = {
            "compute": self.compute,
            "collectives": self.allreduce,
            **dict(self.totals),
            "p2p": self.p2p,
            "ties": self.ties,
        }
        if self.offload:
            out["optimizer_cpu"] = self.optimizer
        return out

    def row(self) -> str:
        mem = "/".join(format_bytes(m.total) for m in self.stage_memory)
        split = f"tp {self.tp} x dp {self.dp}" if self.tp > 1 else f"dp {self.dp} x pp {self.pp}"
        split = f"tp {self.tp} x pp {self.pp} x dp {self.dp}" if self.tp > 1 and self.pp > 1 else split
        head = f"{split} ({self.layout}; {self.strategy}), {self.cm.M} micro-batch(es), {self.cm.recompute}: "
        if self.shard:
            total = sum(v for k, v in self.totals if k in ("allgather_total", "reduce_scatter_total"))
            comm = f"collectives {self.allreduce * 1e3:.3f} exposed (of {total * 1e3:.3f})"
        else:
            comm = f"all-reduce {self.allreduce * 1e3:.3f} exposed (of {self.allreduce_total * 1e3:.3f})"
        return (
            head
            + f"step {self.step * 1e3:.3f} ms = compute {self.compute * 1e3:.3f}"
            + (f" + tp all-reduces {self.tp_comm * 1e3:.3f}" if self.tp > 1 else "")
            + f" + {comm} + p2p {self.p2p * 1e3:.3f}"
            + (f" + ties {self.ties * 1e3:.3f}" if self.tie_reductions else "")
            + (f" + CPU optimizer {self.optimizer * 1e3:.3f}" if self.offload else "")
            + f"; memory per stage {mem}"
            + (f", host {format_bytes(self.host)} per node" if self.offload else "")
        )


def evaluate_cluster(
    cm: CostModel,
    ev: Evaluation,
    cluster: Cluster,
    stage_ranks: list[list[int]],
    layout: str,
    bucket_bytes: float = BUCKET_BYTES,
    ties: Sequence[TieCost] = (),
    reduce: Reduce = allreduce_time,
) -> ClusterCandidate:
    """Predict a replica placement ``ev`` (under ``cm``, hand-overs free) on ``cluster``
    (``planner.cluster``'s docstring). ``ties``: tied parameters, all-reduced in their own group where ``ev``
    splits them. ``reduce``: how a stage's gradients are reduced over its replicas
    (``comm.reduce_scatter_time`` for a sharded stage).

    Usage: ``evaluate_cluster(cm, cm.evaluate(stages), cluster, [[0, 1]], "pipelines-in-node").step``.
    """
    S, M = len(ev.stages), cm.M
    host = host_bandwidth(cluster.device)
    c_in = 0.0 if host == INF else float(cm.inb[0]) / host
    hand: list[float] = []
    link_keys: list[str] = []
    for s in range(S - 1):
        link = slowest_hop(cluster, stage_ranks[s], stage_ranks[s + 1])
        hand.append(2.0 * p2p_time(float(cm.out[ev.stages[s].end - 1]), link))
        link_keys.append(link.key)
    base = ev.latency_sum - sum(ev.links)  # stages only (the cost model's own links are free here)
    compute = base + c_in + (M - 1) * max(ev.bottleneck, c_in)
    pipeline = base + c_in + sum(hand) + (M - 1) * max([ev.bottleneck, c_in, *hand])
    split = [(t, split_stages(t, ev.stages)) for t in ties]
    split = [(t, st) for t, st in split if len(st) > 1]
    reductions = stage_reductions(
        cm, ev, cluster, stage_ranks, [h / 2 for h in hand], bucket_bytes, [t for t, _ in split], reduce
    )
    exposed = max(0.0, *(r.end for r in reductions))
    lead = leads(cm, ev, [h / 2 for h in hand])
    tied = []
    for tie, held in split:
        ranks = sorted(r for s in held for r in stage_ranks[s])
        link = cluster.link(ranks)
        seconds = allreduce_time(float(tie.nbytes), len(ranks), link)
        tied.append((tie, len(ranks), Reduction(link.key, seconds, 1, seconds - min(lead[s] for s in held))))
    beyond = max(exposed, *(r.end for _, _, r in tied)) - exposed if tied else 0.0
    return ClusterCandidate(
        dp=len(stage_ranks[0]),
        layout=layout,
        stage_ranks=stage_ranks,
        cm=cm,
        evaluation=ev,
        compute=compute,
        p2p=pipeline - compute,
        allreduce=exposed,
        links=tuple(link_keys),
        reductions=tuple(reductions),
        ties=beyond,
        tie_reductions=tuple(tied),
    )


def leads(cm: CostModel, ev: Evaluation, back: list[float]) -> list[float]:
    """Per stage: how long before stage 0 it ran its last backward (``lead_s``, module docstring)."""
    out, lead = [], 0.0
    for s in range(len(ev.stages)):
        out.append(lead)
        recompute = ev.forward[s] if cm.recompute == "always" else 0.0
        lead += ev.backward[s] + recompute + (back[s] if s < len(ev.stages) - 1 else 0.0)
    return out


def stage_reductions(
    cm: CostModel,
    ev: Evaluation,
    cluster: Cluster,
    stage_ranks: list[list[int]],
    back: list[float],
    bucket_bytes: float = BUCKET_BYTES,
    split: Sequence[TieCost] = (),
    reduce: Reduce = allreduce_time,
) -> list[Reduction]:
    """Each stage's gradient all-reduce and when it ends after the last backward (see the module docstring).

    ``back[s]``: seconds to hand a gradient from stage ``s + 1`` back to ``s``. One stage: DDP buckets
    of ``bucket_bytes`` during its backward; several: one buffer per stage once its last backward ran,
    without the ties in ``split`` (reduced in their own groups; the profile counts one in its home layer).
    Usage: ``stage_reductions(cm, ev, cluster, [[0, 1]], [])[0].end``.
    """
    S, dp = len(ev.stages), len(stage_ranks[0])
    out: list[Reduction] = []
    lead = 0.0  # how long before stage 0 this stage ran its last backward
    for s, stage in enumerate(ev.stages):
        link = cluster.link(stage_ranks[s])
        own = float(ev.memory[s].grads) - sum(
            t.nbytes for t in split if stage.start <= t.layers[0] < stage.end
        )
        ready, sizes = _bucket_ready(cm, stage, bucket_bytes) if S == 1 else ([0.0], [max(0.0, own)])
        seconds = [reduce(b, dp, link) for b in sizes]
        end = finish_time([r - lead for r in ready], seconds)
        out.append(Reduction(link.key, sum(seconds), len(sizes), end))
        recompute = ev.forward[s] if cm.recompute == "always" else 0.0
        lead += ev.backward[s] + recompute + (back[s] if s < S - 1 else 0.0)
    return out


def _bucket_ready(cm: CostModel, stage: Stage, cap: float) -> tuple[list[float], list[float]]:
    """``(ready, bytes)`` of a stage's DDP buckets: layers' gradients in reverse order, a bucket ready when
    the backward of its last layer ended, in seconds relative to the end of the stage's backward (``<=
    0``)."""
    d, layers = stage.device, range(stage.end - 1, stage.start - 1, -1)
    grads = [float(cm.profile.layers[i].grad_bytes) for i in layers]
    ready, sizes = [], []
    for k, nbytes in buckets(grads, cap):
        i = stage.end - 1 - k  # the layer that closes the bucket; layers [start, i) still run backward
        ready.append(-float(cm.PB[d, i] - cm.PB[d, stage.start]))
        sizes.append(nbytes)
    return ready, sizes


def even_cut(cm: CostModel, stages: int) -> Evaluation | None:
    """The placement of exactly ``stages`` contiguous stages on ``cm``'s first ``stages`` devices with
    the least bottleneck within the first device's budget (all devices alike), or ``None``.

    Stages of identical devices all take the same ``sum lat``, so with hand-overs free the step
    time depends on the cut only through the bottleneck: a min-max partition, by a dynamic
    programme over (stage, first layer) from the last stage back (its 1F1B in-flight count is known).
    """
    L = cm.L
    if not 1 <= stages <= min(L, cm.D):
        return None
    i, j = np.meshgrid(np.arange(L + 1), np.arange(L + 1), indexing="ij")
    ok = j > i
    cost = np.where(ok, cm.PS[0][j] - cm.PS[0][i], INF)
    best = np.full(L + 1, INF)
    best[L] = 0.0  # nothing left after the last stage
    choice = []
    for s in range(stages - 1, -1, -1):
        mem = np.where(
            ok, cm.memory_total(np.where(ok, i, 0), np.where(ok, j, 1), cm.in_flight(s, stages)), INF
        )
        value = np.where(mem <= cm.capacity[0], np.maximum(cost, best[None, :]), INF)
        choice.append(value.argmin(axis=1))
        best = value.min(axis=1)
    if not np.isfinite(best[0]):
        return None
    out, pos = [], 0
    for s, row in enumerate(reversed(choice)):
        end = int(row[pos])
        out.append(Stage(s, pos, end))
        pos = end
    return cm.evaluate(out)


def slowest_hop(cluster: Cluster, here: list[int], there: list[int]) -> Link:
    """The slowest link between stage ``s`` and ``s + 1`` over all replicas (they move in step)."""
    crosses = any(cluster.node_of(a) != cluster.node_of(b) for a, b in zip(here, there))
    return cluster.inter if crosses else cluster.intra

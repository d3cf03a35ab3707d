"""Data x pipeline plans for a cluster you describe: ``cluster_search(profile, cluster) -> Plan``.

Usage::

    cluster = Cluster.describe(profile.devices, nodes=2, interconnect="ib-400g")   # profile of ONE node
    plan = cluster_search(profile, cluster)            # plan.data_parallel, plan.stage_ranks, plan.predicted_times

What is searched: every data-parallel degree ``dp`` with ``dp * pp = nodes * per_node`` (the world
size; ``pp <= layers``, ``dp <= batch``), both ``cluster.layouts``, and for each the pipeline cut,
micro-batch count, schedule and recompute mode of one replica (``optimize.search`` on
``cluster.replica_profile``: ``pp`` copies of the node's device, ``ceil(B / dp)`` samples, hand-overs
priced at the slowest link the layout's pipelines cross). When that best pipeline leaves some
of its ``pp`` devices idle (fewer stages are faster for one replica), ``even_cut`` cuts it into
exactly ``pp`` stages instead, for every setting: ``dp * pp`` fills the world.

What is predicted, per replica (all replicas alike; ``M`` micro-batches)::

    compute   = existing cost model's step time with free hand-overs (input from the host included)
    pipeline  = same formula with hand-over c_j = 2 * p2p(out_j, link_j) per boundary
                (activation forward, gradient back; link_j intra-node, or the interconnect where a
                replica's adjacent stages sit on different nodes)
    p2p       = pipeline - compute
    exposed   = max(0, max_s end_s)                          (the step's all-reduce: added to it)
    ties      = max(0, max_s end_s, max_t end_t) - exposed   (tied parameters' all-reduces, beyond it)
    step      = pipeline + exposed + ties

``end_s`` is when stage ``s``'s gradient all-reduce over its ``dp`` replicas (``comm.allreduce_time``
on the link its replicas span) ends, in seconds after the pipeline's last backward ends (stage
0's), following how the runtime launches it (``stage_reductions``):

* one stage (pure data parallel, ``DataParallelReplica``): DDP buckets of ``comm.BUCKET_BYTES``,
  filled in reverse layer order during the (last micro-batch's) backward, each all-reduced once
  full, one after another (``comm.buckets``, ``comm.finish_time``): only what does not fit under
  the rest of the backward is exposed, and at least the last bucket's all-reduce;
* several stages (``RankStage``): one flat buffer per stage, launched once its last backward ran;
  stage ``s`` finishes ``lead_s = sum_{s' < s} (Bw_s' + p2p(out_s'))`` before stage 0 (``Bw``: one
  micro-batch's backward, plus its recompute under ``recompute="always"``), so
  ``end_s = AR_s - lead_s``: later stages hide their reduction behind earlier stages' backward.

Tied parameters (``planner.ties``; ``RankStage``): a tie held by stages ``T`` (more than one) is all-reduced
in its own group, the ranks of ``T`` in every replica (``n = dp * |T|``), on the slowest link among them
(``cluster.link``), one flat buffer launched with the stage's own, after each rank's last backward; its
bytes leave the home stage's buffer. A collective starts when its last member joins, the stage of
``T`` that finished backward last (the least ``lead_s``), so ``end_t = AR_t - min_{s in T} lead_s``.
It runs beside the stages' all-reduces (other groups, other communicators), so only what it adds
past them is charged (``ties``). A pipeline's first and last stages finish their backward last and
first, so an embedding tied to the head (stage 0 in ``T``) is exposed in full. The replica's cut is
searched without this charge (``optimize.search`` on one replica); candidates are compared with it.

``allreduce_total`` is the longest stage's all-reduce were none of it hidden. Not modelled: the
optimizer step, an all-reduce slowing the compute it overlaps, and several stages' all-reduces
sharing one node's network link.

Memory per device is the existing model's (parameters, gradients and optimizer state of its stage;
activations for the per-replica micro-batches); all-reduce buckets are not counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..hardware import format_bytes
from ..hardware.links import Link
from ..profiler.costs import Profile
from .comm import BUCKET_BYTES, allreduce_time, buckets, finish_time, p2p_time
from .cost import CostModel
from .errors import PlanError
from .topology import Cluster, layouts, replica_profile, shard_size
from .optimize import search
from .physical import INF, host_bandwidth
from .plans import Plan
from .settings import settings_grid
from .stages import Evaluation, Stage
from .ties import TieCost, split_stages, tie_entry

__all__ = ["ClusterCandidate", "Reduction", "cluster_search", "evaluate_cluster", "even_cut", "stage_reductions", "world_splits"]


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


@dataclass(frozen=True)
class ClusterCandidate:
    """One data x pipeline choice and its predicted step: ``step = compute + p2p + allreduce`` (exposed)."""

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
    tie_reductions: tuple[tuple[TieCost, int, Reduction], ...] = ()  # (tie, ranks in its group, its all-reduce)

    @property
    def pp(self) -> int:
        return len(self.stage_ranks)

    @property
    def step(self) -> float:
        return self.compute + self.p2p + self.allreduce + self.ties

    @property
    def allreduce_total(self) -> float:
        """The longest stage's all-reduce, were none of it hidden (stages reduce at once, on disjoint ranks)."""
        return max(r.seconds for r in self.reductions)

    @property
    def reduce_links(self) -> tuple[str, ...]:
        """Per stage: the link key its all-reduce uses."""
        return tuple(r.link for r in self.reductions)

    def row(self) -> str:
        mem = "/".join(format_bytes(m.total) for m in self.evaluation.memory)
        return (
            f"dp {self.dp} x pp {self.pp} ({self.layout}), {self.cm.M} micro-batch(es), {self.cm.recompute}: "
            f"step {self.step * 1e3:.3f} ms = compute {self.compute * 1e3:.3f} + all-reduce {self.allreduce * 1e3:.3f} "
            f"exposed (of {self.allreduce_total * 1e3:.3f}) + p2p {self.p2p * 1e3:.3f}"
            + (f" + ties {self.ties * 1e3:.3f}" if self.tie_reductions else "") + f"; memory per stage {mem}"
        )


def world_splits(world: int, layers: int, batch_size: int, data_parallel: int | str = "auto") -> list[tuple[int, int]]:
    """``(dp, pp)`` pairs with ``dp * pp == world``, ``pp <= layers`` and ``dp <= batch_size``, widest dp first.

    Raises ``ValueError`` naming the equation when a fixed ``data_parallel`` does not divide the world.
    """
    if data_parallel == "auto":
        dps = [d for d in range(world, 0, -1) if world % d == 0]
    elif isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel={data_parallel!r} must be 'auto' or an int >= 1")
    elif world % data_parallel:
        raise ValueError(
            f"data_parallel={data_parallel} does not divide the world size: nodes * devices per node = {world} "
            f"= data_parallel * pipeline stages has no whole number of stages; use a divisor of {world}"
        )
    else:
        dps = [data_parallel]
    out = [(d, world // d) for d in dps if world // d <= layers and d <= batch_size]
    if not out:
        raise ValueError(
            f"no data x pipeline split of {world} ranks fits: data_parallel must be <= the batch ({batch_size}) "
            f"and world / data_parallel <= the layers ({layers}); data_parallel={data_parallel!r}. "
            "Use a larger batch, fewer nodes or fewer devices per node"
        )
    return out


def evaluate_cluster(
    cm: CostModel, ev: Evaluation, cluster: Cluster, stage_ranks: list[list[int]], layout: str, bucket_bytes: float = BUCKET_BYTES,
    ties: Sequence[TieCost] = (),
) -> ClusterCandidate:
    """Predict a replica placement ``ev`` (under ``cm``, hand-overs free) on ``cluster`` (see the module docstring).
    ``ties``: tied parameters, all-reduced in their own group where ``ev`` splits them.

    Usage: ``evaluate_cluster(cm, cm.evaluate(stages), cluster, [[0, 1]], "pipelines-in-node").step``.
    """
    S, M = len(ev.stages), cm.M
    host = host_bandwidth(cluster.device)
    c_in = 0.0 if host == INF else float(cm.inb[0]) / host
    hand: list[float] = []
    link_keys: list[str] = []
    for s in range(S - 1):
        link = _slowest_hop(cluster, stage_ranks[s], stage_ranks[s + 1])
        hand.append(2.0 * p2p_time(float(cm.out[ev.stages[s].end - 1]), link))
        link_keys.append(link.key)
    base = ev.latency_sum - sum(ev.links)  # stages only (the cost model's own links are free here)
    compute = base + c_in + (M - 1) * max(ev.bottleneck, c_in)
    pipeline = base + c_in + sum(hand) + (M - 1) * max([ev.bottleneck, c_in, *hand])
    split = [(t, split_stages(t, ev.stages)) for t in ties]
    split = [(t, st) for t, st in split if len(st) > 1]
    reductions = stage_reductions(cm, ev, cluster, stage_ranks, [h / 2 for h in hand], bucket_bytes, [t for t, _ in split])
    exposed = max(0.0, *(r.end for r in reductions))
    leads = _leads(cm, ev, [h / 2 for h in hand])
    tied = []
    for tie, held in split:
        ranks = sorted(r for s in held for r in stage_ranks[s])
        link = cluster.link(ranks)
        seconds = allreduce_time(float(tie.nbytes), len(ranks), link)
        tied.append((tie, len(ranks), Reduction(link.key, seconds, 1, seconds - min(leads[s] for s in held))))
    beyond = max(exposed, *(r.end for _, _, r in tied)) - exposed if tied else 0.0
    return ClusterCandidate(dp=len(stage_ranks[0]), layout=layout, stage_ranks=stage_ranks, cm=cm, evaluation=ev,
                            compute=compute, p2p=pipeline - compute, allreduce=exposed, links=tuple(link_keys),
                            reductions=tuple(reductions), ties=beyond, tie_reductions=tuple(tied))  # fmt: skip


def _leads(cm: CostModel, ev: Evaluation, back: list[float]) -> list[float]:
    """Per stage: how long before stage 0 it ran its last backward (``lead_s``, module docstring)."""
    out, lead = [], 0.0
    for s in range(len(ev.stages)):
        out.append(lead)
        recompute = ev.forward[s] if cm.recompute == "always" else 0.0
        lead += ev.backward[s] + recompute + (back[s] if s < len(ev.stages) - 1 else 0.0)
    return out


def stage_reductions(
    cm: CostModel, ev: Evaluation, cluster: Cluster, stage_ranks: list[list[int]], back: list[float], bucket_bytes: float = BUCKET_BYTES,
    split: Sequence[TieCost] = (),
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
        own = float(ev.memory[s].grads) - sum(t.nbytes for t in split if stage.start <= t.layers[0] < stage.end)
        ready, sizes = _bucket_ready(cm, stage, bucket_bytes) if S == 1 else ([0.0], [max(0.0, own)])
        seconds = [allreduce_time(b, dp, link) for b in sizes]
        end = finish_time([r - lead for r in ready], seconds)
        out.append(Reduction(link.key, sum(seconds), len(sizes), end))
        recompute = ev.forward[s] if cm.recompute == "always" else 0.0
        lead += ev.backward[s] + recompute + (back[s] if s < S - 1 else 0.0)
    return out


def _bucket_ready(cm: CostModel, stage: Stage, cap: float) -> tuple[list[float], list[float]]:
    """``(ready, bytes)`` of a stage's DDP buckets: layers' gradients in reverse order, a bucket ready when
    the backward of its last layer ended, in seconds relative to the end of the stage's backward (``<= 0``)."""
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
        mem = np.where(ok, cm.memory_total(np.where(ok, i, 0), np.where(ok, j, 1), cm.in_flight(s, stages)), INF)
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


def _slowest_hop(cluster: Cluster, here: list[int], there: list[int]) -> Link:
    """The slowest link between stage ``s`` and ``s + 1`` over all replicas (they move in step)."""
    crosses = any(cluster.node_of(a) != cluster.node_of(b) for a, b in zip(here, there))
    return cluster.inter if crosses else cluster.intra


def _replica_settings(microbatches: int | str, schedule: str, recompute: str) -> list[tuple[int, str, str]]:
    """The one setting a data-parallel replica runs (none when the caller fixed another)."""
    if microbatches not in ("auto", 1) or recompute not in ("auto", "never"):
        return []
    return [(1, schedule if schedule != "auto" else "gpipe", "never")]


def cluster_search(
    profile: Profile,
    cluster: Cluster,
    *,
    microbatches: int | str = "auto",
    schedule: str = "auto",
    recompute: str = "auto",
    data_parallel: int | str = "auto",
    bucket_bytes: float = BUCKET_BYTES,
    ties: Sequence[TieCost] = (),
) -> Plan:
    """The fastest data x pipeline plan of ``profile`` (one node's devices) on ``cluster``.

    ``bucket_bytes``: the data-parallel runtime's gradient bucket (``DataParallelReplica``'s 25 MiB).
    ``ties``: tied parameters (``planner.ties``), all-reduced per step where a candidate splits them.

    Usage: ``cluster_search(profile, Cluster.describe(profile.devices, nodes=2))``. Raises ``PlanError``
    when no split fits memory, ``ValueError`` when no split of the world exists.
    """
    if len(profile.devices) != cluster.per_node:
        raise ValueError(
            f"profile has {len(profile.devices)} device(s) but cluster.per_node={cluster.per_node}; "
            "profile one node's devices and describe the cluster from them"
        )
    splits = world_splits(cluster.world, len(profile.layers), profile.batch_size, data_parallel)
    candidates: list[ClusterCandidate] = []
    skipped: list[str] = []
    last_error: PlanError | None = None
    for dp, pp in splits:
        b = shard_size(profile.batch_size, dp)
        if isinstance(microbatches, int) and microbatches > b:
            skipped.append(f"dp {dp} x pp {pp}: {microbatches} micro-batches exceed the {b}-sample replica batch")
            continue
        compute_only = replica_profile(profile, pp, b)
        for layout, ranks in layouts(dp, pp):
            priced = replica_profile(profile, pp, b, _stage_link(cluster, ranks).effective_bandwidth)
            try:
                chosen = search(priced, microbatches=microbatches, schedule=schedule, recompute=recompute)
            except PlanError as exc:
                last_error = exc
                skipped.append(f"dp {dp} x pp {pp} ({layout}): a {pp}-stage replica does not fit")
                break  # the other layout has the same memory
            if len(chosen.stages) == pp and pp > 1:
                cm = CostModel(compute_only, chosen.microbatches, chosen.schedule, chosen.recompute)
                candidates.append(evaluate_cluster(cm, cm.evaluate(cm.stages_for(chosen)), cluster, ranks, layout, bucket_bytes, ties))
                continue
            # the replica's best pipeline leaves devices idle: cut it into exactly pp stages instead. One stage is a
            # data-parallel replica (DataParallelReplica): it runs its shard as one batch, without recompute
            grid = settings_grid(b, microbatches, schedule, recompute) if pp > 1 else _replica_settings(microbatches, schedule, recompute)
            if not grid:
                skipped.append(f"dp {dp} x pp 1: a data-parallel replica runs its shard as one batch (microbatches=1, recompute='never')")
                continue
            forced = [
                evaluate_cluster(cm, ev, cluster, ranks, layout, bucket_bytes, ties)
                for m, sch, rc in grid
                for cm in [CostModel(compute_only, m, sch, rc)]
                for ev in [even_cut(cm, pp)]
                if ev is not None
            ]
            if forced:
                candidates.append(min(forced, key=lambda c: c.step))
            else:
                skipped.append(f"dp {dp} x pp {pp} ({layout}): no cut into exactly {pp} stages fits")
    if not candidates:
        if last_error is not None and all("does not fit" in s for s in skipped):
            raise PlanError(
                f"no data x pipeline split of {cluster.world} ranks fits: even {splits[-1][1]} stage(s) per replica "
                f"need more memory than a device has.\n{last_error}"
            )
        raise ValueError(
            f"no data x pipeline split of {cluster.world} ranks fills the world: " + "; ".join(skipped)
            + ". Use fewer devices per node or nodes, or a larger batch"
        )
    best = min(candidates, key=lambda c: (c.step, c.pp, c.layout))
    return _to_plan(best, candidates, skipped, cluster, profile.batch_size, bucket_bytes, ties)


def _stage_link(cluster: Cluster, ranks: list[list[int]]) -> Link:
    """The slowest link any hand-over of this layout crosses (the search prices every boundary at it)."""
    hops = [_slowest_hop(cluster, ranks[s], ranks[s + 1]) for s in range(len(ranks) - 1)]
    return cluster.inter if cluster.inter in hops else cluster.intra


def _overlap_note(best: ClusterCandidate, bucket_bytes: float) -> str:
    """How much of the all-reduce the step waits for, and why; what is not modelled."""
    if best.dp == 1:
        return "no all-reduce (one replica); the optimizer step is not modelled"
    if best.pp == 1:
        how = f"DDP buckets of {format_bytes(int(bucket_bytes))}, each all-reduced while the rest of backward runs"
    else:
        how = "stage s's all-reduce runs while stages < s still run backward"
    return (
        f"all-reduce {best.allreduce_total * 1e3:.3f} ms, {best.allreduce * 1e3:.3f} ms of it exposed ({how}); "
        "the optimizer step is not modelled"
    )


def _to_plan(
    best: ClusterCandidate, all_: list[ClusterCandidate], skipped: list[str], cluster: Cluster, batch: int, bucket_bytes: float,
    ties: Sequence[TieCost] = (),
) -> Plan:
    """The chosen candidate as a ``Plan``: replica 0's stages on their ranks' devices, the others in notes."""
    notes = [f"chosen: {best.row()}"]
    notes += [f"assumed {a}" for a in cluster.assumed]
    notes.append(
        f"links: intra-node {cluster.intra.short()}, interconnect {cluster.inter.short()}; "
        "figures and sources: torchspan.hardware.links"
    )
    if best.dp > 1:
        ends = [f"stage {s}: {r.link}, {r.buckets} bucket(s), ends {r.end * 1e3:+.3f} ms" for s, r in enumerate(best.reductions)]
        notes.append("all-reduce per stage over " + ", ".join(ends))
    if best.links:
        notes.append("hand-overs over " + ", ".join(f"{s}->{s + 1}: {k}" for s, k in enumerate(best.links)))
    others = sorted((c for c in all_ if c is not best), key=lambda c: c.step)
    notes += [f"also: {c.row()}" for c in others]
    notes += [f"skipped: {s}" for s in skipped]
    notes.append(_overlap_note(best, bucket_bytes))
    plan = best.cm.to_plan(best.evaluation, "torchspan-cluster", notes=notes)
    plan.ties = _tie_records(best, ties)
    plan.notes += [
        f"tied parameter {t['name']} is used on stages {', '.join(map(str, t['stages']))} ({', '.join(t['layers'])}): each "  # type: ignore[arg-type]
        f"rank holding one keeps a copy ({int(t['bytes']):,} bytes), {t['charge']}: {float(t['seconds']) * 1e3:.3f} ms per step"  # type: ignore[arg-type]
        for t in plan.ties if "seconds" in t
    ]  # fmt: skip
    replica0 = [row[0] for row in best.stage_ranks]
    stages = [dataclasses.replace(sp, device=cluster.local_device(r)) for sp, r in zip(plan.stages, replica0)]
    peak = {f"rank {r} ({cluster.local_device(r)}, node {cluster.node_of(r)})": m.total for r, m in zip(replica0, best.evaluation.memory)}
    return dataclasses.replace(
        plan,
        stages=stages,
        batch_size=batch,
        predicted_step_time=best.step,
        peak_memory=peak,
        data_parallel=best.dp,
        nodes=cluster.nodes,
        devices_per_node=cluster.per_node,
        stage_ranks=[list(r) for r in best.stage_ranks],
        interconnect=cluster.inter.key,
        intra_link=cluster.intra.key,
        # "allreduce": the exposed part (compute + allreduce + p2p = the step); "allreduce_total": all of it
        predicted_times={
            "compute": best.compute, "allreduce": best.allreduce, "allreduce_total": best.allreduce_total, "p2p": best.p2p,
            "ties": best.ties,
        },  # fmt: skip
    )


def _tie_records(best: ClusterCandidate, ties: Sequence[TieCost]) -> list[dict[str, object]]:
    """``Plan.ties`` of the chosen candidate: a split tie's ``seconds`` is its all-reduce per step."""
    names = [lay.name for lay in best.cm.profile.layers]
    reduced = {id(t): (n, r) for t, n, r in best.tie_reductions}
    out = []
    for tie in ties:
        entry = tie_entry(tie, names, best.evaluation.stages)
        if id(tie) in reduced:
            n, r = reduced[id(tie)]
            entry["seconds"] = r.seconds
            entry["charge"] = (
                f"its gradient all-reduced every step over {n} ranks on {r.link}, ending {r.end * 1e3:+.3f} ms after "
                f"the last backward ({best.ties * 1e3:.3f} ms of all ties exposed past the stages' all-reduces)"
            )
        out.append(entry)
    return out

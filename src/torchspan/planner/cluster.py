"""Data x pipeline plans for a cluster you describe: ``cluster_search(profile, mesh) -> Plan``.

Usage::

    mesh = Mesh.describe(profile.devices, nodes=2, interconnect="ib-400g")   # profile of ONE node
    plan = cluster_search(profile, mesh)            # plan.data_parallel, plan.stage_ranks, plan.predicted_times

What is searched: every data-parallel degree ``dp`` with ``dp * pp = nodes * per_node`` (the world
size; ``pp <= layers``, ``dp <= batch``), both ``mesh.layouts``, and for each the pipeline cut,
micro-batch count, schedule and checkpoint mode of one replica (``optimize.search`` on
``mesh.replica_profile``: ``pp`` copies of the node's device, ``ceil(B / dp)`` samples, hand-overs
priced at the slowest link the layout's pipelines cross). When that best pipeline leaves some
of its ``pp`` devices idle (fewer stages are faster for one replica), ``even_cut`` cuts it into
exactly ``pp`` stages instead, for every setting: ``dp * pp`` fills the world.

What is predicted, per replica (all replicas alike; ``M`` micro-batches)::

    compute   = existing cost model's step time with free hand-overs (input from the host included)
    pipeline  = same formula with hand-over c_j = 2 * p2p(out_j, link_j) per boundary
                (activation forward, gradient back; link_j intra-node, or the interconnect where a
                replica's adjacent stages sit on different nodes)
    p2p       = pipeline - compute
    AR_s      = allreduce(grad bytes of stage s, dp, link of stage s's replicas)   (comm.py, ring bound)
    allreduce = max(0, max_s (AR_s - lead_s)),  lead_s = sum_{s' < s} (Bw_s' + p2p(out))
                (stage s finishes its last backward lead_s before stage 0 does; its all-reduce
                starts then. Overlap inside a stage's backward, as DDP's buckets do, is not modelled.)
    step      = pipeline + allreduce

Memory per device is the existing model's (parameters, gradients and optimizer state of its stage;
activations for the per-replica micro-batches); all-reduce buckets are not counted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..hardware import format_bytes
from ..hardware.links import Link
from ..profiler.costs import Profile
from .comm import allreduce_time, p2p_time
from .cost import CostModel
from .errors import PlanError
from .mesh import Mesh, layouts, replica_profile, shard_size
from .optimize import search
from .physical import INF, host_bandwidth
from .plans import Plan
from .settings import settings_grid
from .stages import Evaluation, Stage

__all__ = ["ClusterCandidate", "cluster_search", "evaluate_cluster", "even_cut", "world_splits"]


@dataclass(frozen=True)
class ClusterCandidate:
    """One data x pipeline choice and its predicted step: ``step = compute + p2p + allreduce``."""

    dp: int
    layout: str
    stage_ranks: list[list[int]]
    cm: CostModel
    evaluation: Evaluation
    compute: float
    p2p: float
    allreduce: float
    links: tuple[str, ...]  # per boundary: the link key its hand-overs use
    reduce_links: tuple[str, ...]  # per stage: the link key its all-reduce uses

    @property
    def pp(self) -> int:
        return len(self.stage_ranks)

    @property
    def step(self) -> float:
        return self.compute + self.p2p + self.allreduce

    def row(self) -> str:
        mem = "/".join(format_bytes(m.total) for m in self.evaluation.memory)
        return (
            f"dp {self.dp} x pp {self.pp} ({self.layout}), {self.cm.M} micro-batch(es), {self.cm.checkpoint}: "
            f"step {self.step * 1e3:.3f} ms = compute {self.compute * 1e3:.3f} + all-reduce {self.allreduce * 1e3:.3f} "
            f"+ p2p {self.p2p * 1e3:.3f}; memory per stage {mem}"
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


def evaluate_cluster(cm: CostModel, ev: Evaluation, mesh: Mesh, stage_ranks: list[list[int]], layout: str) -> ClusterCandidate:
    """Predict a replica placement ``ev`` (under ``cm``, hand-overs free) on ``mesh`` (see the module docstring)."""
    S, M = len(ev.stages), cm.M
    dp = len(stage_ranks[0])
    host = host_bandwidth(mesh.device)
    c_in = 0.0 if host == INF else float(cm.inb[0]) / host
    hand: list[float] = []
    back: list[float] = []
    link_keys: list[str] = []
    for s in range(S - 1):
        link = _slowest_hop(mesh, stage_ranks[s], stage_ranks[s + 1])
        one_way = p2p_time(float(cm.out[ev.stages[s].end - 1]), link)
        hand.append(2.0 * one_way)
        back.append(one_way)
        link_keys.append(link.key)
    base = ev.latency_sum - sum(ev.links)  # stages only (the cost model's own links are free here)
    compute = base + c_in + (M - 1) * max(ev.bottleneck, c_in)
    pipeline = base + c_in + sum(hand) + (M - 1) * max([ev.bottleneck, c_in, *hand])
    reduce_keys: list[str] = []
    exposed = 0.0
    lead = 0.0
    for s in range(S):
        link = mesh.link(stage_ranks[s])
        reduce_keys.append(link.key)
        exposed = max(exposed, allreduce_time(ev.memory[s].grads, dp, link) - lead)
        lead += ev.backward[s] + (back[s] if s < S - 1 else 0.0)
    return ClusterCandidate(
        dp, layout, stage_ranks, cm, ev, compute, pipeline - compute, exposed, tuple(link_keys), tuple(reduce_keys)
    )


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


def _slowest_hop(mesh: Mesh, here: list[int], there: list[int]) -> Link:
    """The slowest link between stage ``s`` and ``s + 1`` over all replicas (they move in step)."""
    crosses = any(mesh.node_of(a) != mesh.node_of(b) for a, b in zip(here, there))
    return mesh.inter if crosses else mesh.intra


def cluster_search(
    profile: Profile,
    mesh: Mesh,
    *,
    microbatches: int | str = "auto",
    schedule: str = "auto",
    checkpoint: str = "auto",
    data_parallel: int | str = "auto",
) -> Plan:
    """The fastest data x pipeline plan of ``profile`` (one node's devices) on ``mesh``.

    Usage: ``cluster_search(profile, Mesh.describe(profile.devices, nodes=2))``. Raises ``PlanError``
    when no split fits memory, ``ValueError`` when no split of the world exists.
    """
    if len(profile.devices) != mesh.per_node:
        raise ValueError(
            f"profile has {len(profile.devices)} device(s) but mesh.per_node={mesh.per_node}; "
            "profile one node's devices and describe the mesh from them"
        )
    splits = world_splits(mesh.world, len(profile.layers), profile.batch_size, data_parallel)
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
            priced = replica_profile(profile, pp, b, _stage_link(mesh, ranks).effective_bandwidth)
            try:
                chosen = search(priced, microbatches=microbatches, schedule=schedule, checkpoint=checkpoint)
            except PlanError as exc:
                last_error = exc
                skipped.append(f"dp {dp} x pp {pp} ({layout}): a {pp}-stage replica does not fit")
                break  # the other layout has the same memory
            if len(chosen.stages) == pp:
                cm = CostModel(compute_only, chosen.microbatches, chosen.schedule, chosen.checkpoint)
                candidates.append(evaluate_cluster(cm, cm.evaluate(cm.stages_for(chosen)), mesh, ranks, layout))
                continue
            # the replica's best pipeline leaves devices idle: cut it into exactly pp stages instead
            forced = [
                evaluate_cluster(cm, ev, mesh, ranks, layout)
                for m, sch, ck in settings_grid(b, microbatches, schedule, checkpoint)
                for cm in [CostModel(compute_only, m, sch, ck)]
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
                f"no data x pipeline split of {mesh.world} ranks fits: even {splits[-1][1]} stage(s) per replica "
                f"need more memory than a device has.\n{last_error}"
            )
        raise ValueError(
            f"no data x pipeline split of {mesh.world} ranks fills the world: " + "; ".join(skipped)
            + ". Use fewer devices per node or nodes, or a larger batch"
        )
    best = min(candidates, key=lambda c: (c.step, c.pp, c.layout))
    return _to_plan(best, candidates, skipped, mesh, profile.batch_size)


def _stage_link(mesh: Mesh, ranks: list[list[int]]) -> Link:
    """The slowest link any hand-over of this layout crosses (the search prices every boundary at it)."""
    hops = [_slowest_hop(mesh, ranks[s], ranks[s + 1]) for s in range(len(ranks) - 1)]
    return mesh.inter if mesh.inter in hops else mesh.intra


def _to_plan(best: ClusterCandidate, all_: list[ClusterCandidate], skipped: list[str], mesh: Mesh, batch: int) -> Plan:
    notes = [f"chosen: {best.row()}"]
    notes += [f"assumed {a}" for a in mesh.assumed]
    notes.append(
        f"links: intra-node {mesh.intra.short()}, interconnect {mesh.inter.short()}; "
        "figures and sources: torchspan.hardware.links"
    )
    if best.dp > 1:
        notes.append("all-reduce per stage over " + ", ".join(f"stage {s}: {k}" for s, k in enumerate(best.reduce_links)))
    if best.links:
        notes.append("hand-overs over " + ", ".join(f"{s}->{s + 1}: {k}" for s, k in enumerate(best.links)))
    others = sorted((c for c in all_ if c is not best), key=lambda c: c.step)
    notes += [f"also: {c.row()}" for c in others]
    notes += [f"skipped: {s}" for s in skipped]
    notes.append("all-reduce buckets and the optimizer step are not modelled; all-reduce overlap within a stage's backward is not counted")
    plan = best.cm.to_plan(best.evaluation, "torchspan-cluster", notes=notes)
    replica0 = [row[0] for row in best.stage_ranks]
    stages = [dataclasses.replace(sp, device=mesh.local_device(r)) for sp, r in zip(plan.stages, replica0)]
    peak = {f"rank {r} ({mesh.local_device(r)}, node {mesh.node_of(r)})": m.total for r, m in zip(replica0, best.evaluation.memory)}
    return dataclasses.replace(
        plan,
        stages=stages,
        batch_size=batch,
        predicted_step_time=best.step,
        peak_memory=peak,
        data_parallel=best.dp,
        nodes=mesh.nodes,
        devices_per_node=mesh.per_node,
        stage_ranks=[list(r) for r in best.stage_ranks],
        interconnect=mesh.inter.key,
        intra_link=mesh.intra.key,
        predicted_times={"compute": best.compute, "allreduce": best.allreduce, "p2p": best.p2p},
    )

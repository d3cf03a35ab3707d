"""Every strategy a cluster plan weighs, priced by one cost model and compared in one table.

``STRATEGIES``: ``replicas`` (DDP: the whole model on every rank, gradients all-reduced),
``sharded`` (FSDP2 / ZeRO-3: parameters, gradients and optimizer state sharded over the ranks),
``sharded + offload`` (the shards in host memory, the optimizer step on the CPU), ``pipeline``
(stages on ranks, one replica), ``hybrid`` (pipeline x replicas), ``pipeline x sharded`` (each
stage's replicas shard its states) and ``tensor parallel x sharded`` (each block split over ``tp``
ranks of a node, FSDP2 over the ``world / tp`` replicas: ``planner.tensorparallel``) and ``tensor parallel x
pipeline`` (``pp`` stages of ``tp`` ranks each, ``dp`` replicas: ``planner.tppipeline``).
``planner.cluster.cluster_search`` prices each split ``dp x pp`` of the world: replicas, pipelines and hybrids
as before (``planner.candidates``); the sharded ones with ``planner.sharded``:

* ``sharded`` / ``sharded + offload`` (``pp = 1``): the whole model on each rank, one batch per rank
  (as a replica runs it); memory ``sharded.sharded_memory``, time ``compute + exposed collectives
  (+ the CPU optimizer step)``, ``sharded.sharded_step``. Offload needs an accelerator (FSDP2's
  ``CPUOffloadPolicy``) and host memory: the node's ranks' shards within ``Host.budget``.
* ``pipeline x sharded`` (``pp > 1``, ``dp > 1``): the replica's cut searched with each stage's states as
  ``sharded_memory(pipeline=True)`` holds them (``sharded_profile``), the stage's gradients
  reduce-scattered instead of all-reduced (overlapping earlier stages' backward as the all-reduce
  does), plus the all-gathers its first micro-batch's forward waits for (``first_forward_exposed``).

* ``tensor parallel x sharded`` (``pp = 1``, ``tp`` in 2, 4, 8 within a node): compute divided by ``tp`` plus
  the TP all-reduces (not overlapped), then the sharded replica's collectives over ``dp``
  (``tensorparallel.tp_candidates``). ``choose`` takes it only when predicted ``SHARD_MARGIN`` faster
  than the best of the others that fit.

``planner.comparison.compare`` keeps, per strategy, the fastest candidate that fits, else the one needing the
least memory (``fits: False``, what is over), else why no split of the world is that strategy: the rows of
``Plan.comparison``.

Usage::

    host = host_of(cluster, host_memory=None)
    cands = sharded_replicas(profile, cluster, dp=16, host=host, setting=(1, "gpipe", "never"))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..hardware import format_bytes
from ..profiler.costs import Profile
from .candidates import ClusterCandidate, Reduction, evaluate_cluster
from .comm import reduce_scatter_time
from .cost import CostModel
from .physical import INF
from .sharded import (
    cpu_optimizer_time,
    first_forward_exposed,
    host_memory_bandwidth,
    pcie_link,
    sharded_memory,
    sharded_step,
)
from .stages import Evaluation, Stage
from .ties import TieCost
from .topology import Cluster, replica_profile, shard_size

__all__ = [
    "STRATEGIES",
    "Host",
    "Options",
    "host_of",
    "sharded_replicas",
    "sharded_pipeline",
    "sharded_profile",
    "unfit",
    "replica_settings",
    "choose",
    "SHARD_MARGIN",
    "TP",
    "TPP",
]

STRATEGIES = (
    "replicas",
    "sharded",
    "sharded + offload",
    "pipeline",
    "hybrid",
    "pipeline x sharded",
    "tensor parallel x sharded",
    "tensor parallel x pipeline",
)
TP = "tensor parallel x sharded"  # planner.tensorparallel's
TPP = "tensor parallel x pipeline"  # planner.tppipeline's: pp stages of tp ranks, dp replicas
HOST_PER_DEVICE = 3  # assumed host memory of a described node, in multiples of its accelerators' memory
SHARD_MARGIN = 0.02  # a sharded (offloaded) plan must be predicted this much faster than the plan without it


@dataclass(frozen=True)
class Options:
    """The caller's settings a cluster search keeps: fixed or ``"auto"`` micro-batches, schedule, recompute;
    buckets, ties."""

    microbatches: int | str
    schedule: str
    recompute: str
    bucket_bytes: float
    ties: tuple[TieCost, ...] = ()


def replica_settings(microbatches: int | str, schedule: str, recompute: str) -> list[tuple[int, str, str]]:
    """The one setting a data-parallel replica (sharded or not) runs: its shard as one batch, no recompute
    (none when the caller fixed another)."""
    if microbatches not in ("auto", 1) or recompute not in ("auto", "never"):
        return []
    return [(1, schedule if schedule != "auto" else "gpipe", "never")]


@dataclass(frozen=True)
class Host:
    """One node's host memory for offloaded states: ``budget`` bytes, ``bandwidth`` bytes/s (the CPU optimizer
    step)."""

    budget: float
    source: str
    bandwidth: float
    bandwidth_source: str


def host_of(cluster: Cluster, host_memory: float | None = None) -> Host:
    """The host memory of one of ``cluster``'s nodes: ``host_memory`` bytes when given, this machine's free
    memory for present devices, else ``HOST_PER_DEVICE`` times the node's accelerator memory (an assumption:
    DGX A100 and H100 nodes have 3.2 times: 1-2 TB for 8 GPUs of 40-80 GB)."""
    bw, bw_source = host_memory_bandwidth(cluster.device)
    if host_memory is not None:
        return Host(float(host_memory), "given", bw, bw_source)
    if cluster.device.present:
        from ..hardware import devices

        cap = devices("cpu")[0].capacity
        if cap is not None:
            return Host(float(cap), "this machine's free memory", bw, bw_source)
    per = cluster.device.total_memory or cluster.device.capacity
    if not per:
        return Host(
            INF,
            "not limited: the device's memory is unknown; pass host_memory= / --host-memory",
            bw,
            bw_source,
        )
    return Host(
        float(HOST_PER_DEVICE * cluster.per_node * per),
        f"assumed: {HOST_PER_DEVICE} x the node's accelerator memory (DGX-class nodes have 3.2 x); pass "
        "host_memory= / --host-memory",
        bw,
        bw_source,
    )


def choose(candidates: Sequence[ClusterCandidate]) -> ClusterCandidate:
    """The plan among fitting ``candidates``: the fastest unsharded one, replaced by the fastest sharded one
    only when that is more than ``SHARD_MARGIN`` faster, and that by the fastest offloaded one likewise, and
    that by the fastest tensor-parallel one likewise (what the cost model leaves out of a sharded step,
    FSDP2's per-unit hooks and shard padding, and of a tensor-parallel one, DTensor's per-op dispatch, costs
    more than it leaves out of a replica's).
    Ties: fewer stages first."""

    def fastest(group: Sequence[ClusterCandidate]) -> ClusterCandidate | None:
        return min(group, key=lambda c: (c.step, c.pp, c.layout)) if group else None

    choice = fastest([c for c in candidates if not c.shard and c.tp == 1])
    sharded = [c for c in candidates if c.shard and not c.offload and c.tp == 1]
    for group in (sharded, [c for c in candidates if c.offload], [c for c in candidates if c.tp > 1]):
        best = fastest(group)
        if best is not None and (choice is None or best.step < choice.step * (1 - SHARD_MARGIN)):
            choice = best
    if choice is None:
        raise ValueError("choose(candidates=[]) needs at least one candidate")
    return choice


def unfit(device: float, capacity: float, host: float = 0.0, host_budget: float = INF) -> str:
    """Why a candidate does not fit (``""`` when it does): device bytes over its budget, host bytes over the
    node's."""
    over = []
    if device > capacity:
        over.append(f"needs {format_bytes(device)} per device, budget {format_bytes(capacity)}")
    if host > host_budget:
        over.append(f"needs {format_bytes(host)} of host memory per node, {format_bytes(host_budget)} there")
    return "; ".join(over)


def sharded_replicas(
    profile: Profile,
    cluster: Cluster,
    dp: int,
    *,
    host: Host | None,
    setting: tuple[int, str, str],
    ties: Sequence[TieCost] = (),
) -> list[ClusterCandidate]:
    """``pp = 1`` on all ``dp`` ranks: ``sharded`` (``dp > 1``) and ``sharded + offload`` (accelerators;
    ``host`` given), fitting or not (``fits``, ``why``). ``setting``: the replica's ``(microbatches, schedule,
    recompute)``."""
    ranks = [list(range(dp))]
    cm = CostModel(replica_profile(profile, 1, shard_size(profile.batch_size, dp)), *setting)
    stage = Stage(0, 0, cm.L)
    ev = cm.evaluate([stage])
    base = evaluate_cluster(cm, ev, cluster, ranks, "pipelines-in-node")
    link = cluster.link(ranks[0])
    params = sum(lay.param_bytes for lay in profile.layers)
    out = []
    for offload in ([None] if dp > 1 else []) + (
        ["cpu"] if host is not None and cluster.device.kind != "cpu" else []
    ):
        mem = sharded_memory(cm, stage, dp, offload=offload is not None, ties=ties)
        t = sharded_step(cm, stage, dp, link, pcie=pcie_link(cluster.device) if offload else None, ties=ties)
        node = min(cluster.per_node, dp)
        step_cpu = (
            cpu_optimizer_time(node * params / dp, profile.optimizer, host.bandwidth)
            if offload and host
            else 0.0
        )
        host_bytes = node * mem.host
        why = unfit(mem.total, cm.capacity[0], host_bytes, host.budget if offload and host else INF)
        totals = [("allgather_total", t.allgather), ("reduce_scatter_total", t.reduce_scatter)]
        totals += [("pcie_total", t.pcie)] if offload else []
        reduction = Reduction(link.key, t.allgather + t.reduce_scatter, t.collectives, t.exposed)
        out.append(
            dataclasses.replace(
                base,
                allreduce=t.exposed,
                reductions=(reduction,),
                shard=True,
                offload=offload,
                memory=(mem.stage_memory(),),
                host=host_bytes,
                optimizer=step_cpu,
                totals=tuple(totals),
                fits=not why,
                why=why,
            )
        )
    return out


def sharded_profile(profile: Profile, n: int) -> Profile:
    """``profile`` with each layer's states as a stage of a pipeline sharded over ``n`` ranks holds them
    (``sharded_memory(pipeline=True)``): parameters and gradients whole for the step, and the shards of
    parameters, gradients and optimizer state at rest (counted as optimizer state), so the cut search sees its
    memory."""

    def shard(lay: Any) -> Any:
        return dataclasses.replace(
            lay, optimizer_bytes=math.ceil((lay.param_bytes + lay.grad_bytes + lay.optimizer_bytes) / n)
        )

    return dataclasses.replace(profile, layers=[shard(lay) for lay in profile.layers])


def sharded_pipeline(
    cm: CostModel,
    ev: Evaluation,
    plain: CostModel,
    cluster: Cluster,
    stage_ranks: list[list[int]],
    layout: str,
    bucket_bytes: float,
    ties: Sequence[TieCost] = (),
) -> ClusterCandidate:
    """A pipeline whose stages are sharded over their ``dp`` replicas: ``ev`` under ``cm`` (on
    ``sharded_profile``); ``plain``: the same settings on the unsharded replica profile (the states as they
    are)."""
    dp = len(stage_ranks[0])
    cand = evaluate_cluster(
        cm, ev, cluster, stage_ranks, layout, bucket_bytes, ties, reduce=reduce_scatter_time
    )
    S = len(ev.stages)
    mems = tuple(
        sharded_memory(
            plain, st, dp, pipeline=True, in_flight=plain.in_flight(i, S), ties=ties
        ).stage_memory()
        for i, st in enumerate(ev.stages)
    )
    gathers = [
        first_forward_exposed(plain, st, dp, cluster.link(r), ties) for st, r in zip(ev.stages, stage_ranks)
    ]
    # the first micro-batch meets each stage's all-gathers in turn: their sum is on its trip; reduce-scatters
    # run at once
    totals = (("allgather_total", sum(t for _, t in gathers)), ("reduce_scatter_total", cand.allreduce_total))
    return dataclasses.replace(
        cand, allreduce=cand.allreduce + sum(e for e, _ in gathers), shard=True, memory=mems, totals=totals
    )

"""A chosen cluster candidate as a ``Plan`` (``cluster_search``'s last step): replica 0's stages on their
ranks' devices with their memory, the step's predicted times, and notes saying why it won, what it runs
(sharded, tensor parallel, offloaded), the links and reductions it was priced on, tied parameters' cost, and
the others.

Usage: ``plan = to_plan(best, candidates, skipped, cluster, batch, bucket_bytes, ties, rows, host)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..hardware import format_bytes
from .candidates import ClusterCandidate
from .comparison import why_chosen
from .plans import Plan
from .sharded import optimizer_passes
from .strategies import Host
from .tensorparallel import tp_notes
from .ties import TieCost, tie_entry
from .topology import Cluster

__all__ = ["to_plan"]


def to_plan(
    best: ClusterCandidate,
    all_: list[ClusterCandidate],
    skipped: list[str],
    cluster: Cluster,
    batch: int,
    bucket_bytes: float,
    ties: Sequence[TieCost] = (),
    rows: list[dict[str, object]] | None = None,
    host: Host | None = None,
) -> Plan:
    """The chosen candidate as a ``Plan``: replica 0's stages on their ranks' devices, the others in notes."""
    notes = _notes(best, all_, skipped, cluster, bucket_bytes, rows, host)
    plan = best.cm.to_plan(best.evaluation, "torchspan-cluster", notes=notes)
    plan.ties = _tie_records(best, ties)
    plan.notes += [
        f"tied parameter {t['name']} is used on stages {', '.join(map(str, t['stages']))} "
        f"({', '.join(t['layers'])}): each "  # type: ignore[arg-type]
        f"rank holding one keeps a copy ({int(t['bytes']):,} bytes), {t['charge']}: "
        f"{float(t['seconds']) * 1e3:.3f} ms per step"  # type: ignore[arg-type]
        for t in plan.ties
        if "seconds" in t
    ]
    replica0 = [row[0] for row in best.stage_ranks]
    stages = [
        dataclasses.replace(
            sp,
            device=cluster.local_device(r),
            param_bytes=m.params,
            grad_bytes=m.grads,
            optimizer_bytes=m.optimizer,
            activation_bytes=m.activations,
            buffer_bytes=m.buffers,
            workspace_bytes=m.workspace,
        )
        for sp, r, m in zip(plan.stages, replica0, best.stage_memory)
    ]
    peak = {
        f"rank {r} ({cluster.local_device(r)}, node {cluster.node_of(r)})": m.total
        for r, m in zip(replica0, best.stage_memory)
    }
    if best.offload:
        peak["host of node 0 (cpu)"] = best.host
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
        # the parts not named *_total add up to the step ("allreduce"/"collectives": the exposed part)
        predicted_times=best.times(),
        shard=best.shard,
        offload=best.offload,
        comparison=list(rows or []),
        tp=best.tp,
    )


def _notes(
    best: ClusterCandidate,
    all_: list[ClusterCandidate],
    skipped: list[str],
    cluster: Cluster,
    bucket_bytes: float,
    rows: list[dict[str, object]] | None,
    host: Host | None,
) -> list[str]:
    """The chosen plan's notes: why it won, its sharding or tensor parallelism, links, reductions, the
    others."""
    notes = [f"chosen: {best.row()}"]
    if rows:
        notes.append(f"strategy: {why_chosen(rows)}")
    notes += tp_notes(best, cluster) or _shard_notes(best, cluster, host)
    if cluster.world > 1:
        notes += [f"assumed {a}" for a in cluster.assumed]
        notes.append(
            f"links: intra-node {cluster.intra.short()}, interconnect {cluster.inter.short()}; "
            "figures and sources: torchspan.hardware.links"
        )
    if best.dp > 1 and not best.shard:
        ends = [
            f"stage {s}: {r.link}, {r.buckets} bucket(s), ends {r.end * 1e3:+.3f} ms"
            for s, r in enumerate(best.reductions)
        ]
        notes.append("all-reduce per stage over " + ", ".join(ends))
    if best.links:
        notes.append("hand-overs over " + ", ".join(f"{s}->{s + 1}: {k}" for s, k in enumerate(best.links)))
    others = sorted((c for c in all_ if c is not best), key=lambda c: c.step)
    notes += [f"also: {c.row()}" for c in others]
    notes += [f"skipped: {s}" for s in skipped]
    notes.append(_overlap_note(best, bucket_bytes))
    return notes


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
                f"its gradient all-reduced every step over {n} ranks on {r.link}, ending "
                f"{r.end * 1e3:+.3f} ms after the last backward ({best.ties * 1e3:.3f} ms of all ties "
                "exposed past the stages' all-reduces)"
            )
        out.append(entry)
    return out


def _overlap_note(best: ClusterCandidate, bucket_bytes: float) -> str:
    """How much of the all-reduce (or the sharded collectives) the step waits for, and why; what is not
    modelled."""
    if best.shard:
        t = dict(best.totals)
        how = (
            "each unit's all-gather while the unit before it computes, each reduce-scatter while the units "
            "before it run backward"
            if best.pp == 1
            else "each stage's parameters gathered during its first forward, its gradients "
            "reduce-scattered while stages < s still run backward"
        )
        return (
            f"collectives: all-gathers {t.get('allgather_total', 0.0) * 1e3:.3f} ms, reduce-scatters "
            f"{t.get('reduce_scatter_total', 0.0) * 1e3:.3f} ms, {best.allreduce * 1e3:.3f} ms of them "
            f"exposed ({how}); the optimizer step on the device is not modelled"
        )
    if best.dp == 1:
        return (
            f"no {'data-parallel collective' if best.tp > 1 else 'all-reduce'} (one replica); the "
            "optimizer step is not modelled"
        )
    if best.pp == 1:
        how = (
            f"DDP buckets of {format_bytes(int(bucket_bytes))}, each all-reduced while the rest of "
            "backward runs"
        )
    else:
        how = "stage s's all-reduce runs while stages < s still run backward"
    return (
        f"all-reduce {best.allreduce_total * 1e3:.3f} ms, {best.allreduce * 1e3:.3f} ms of it exposed "
        f"({how}); the optimizer step is not modelled"
    )


def _shard_notes(best: ClusterCandidate, cluster: Cluster, host: Host | None) -> list[str]:
    """What a sharded plan runs: FSDP2 over each stage's replicas, units, and with offload where the states
    go."""
    if not best.shard:
        return []
    if best.pp == 1:
        how = f"fully_shard per layer, the root last, reshard_after_forward=True, over all {best.dp} ranks"
    else:
        how = (
            f"over each stage's {best.dp} replicas as torch.distributed.pipelining runs FSDP stages: "
            "parameters gathered for the step, gradients reduce-scattered after the last micro-batch"
        )
    notes = [
        f"sharded: span(model, plan) runs FSDP2 ({how}): parameters, gradients and optimizer state at rest "
        f"divided by {best.dp}; planner.sharded has the formulas"
    ]
    if best.offload and host is not None:
        t = dict(best.totals)
        params = (
            sum(lay.param_bytes for lay in best.cm.profile.layers) * min(cluster.per_node, best.dp) / best.dp
        )
        notes.append(
            f"offload: the shards live in host memory ({format_bytes(best.host)} of the node's "
            f"{format_bytes(host.budget)}, {host.source}); copies over PCIe "
            f"{t.get('pcie_total', 0.0) * 1e3:.3f} ms in the collectives; the optimizer steps on the CPU: "
            f"{best.optimizer * 1e3:.3f} ms ({optimizer_passes(best.cm.profile.optimizer)} passes over the "
            f"node's {format_bytes(params)} of parameters at {host.bandwidth_source}, planner.sharded)"
        )
    return notes

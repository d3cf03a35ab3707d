"""A cluster you describe, and where a data x pipeline plan puts each (stage, replica) on it.

``Cluster``: ``nodes`` machines of ``per_node`` identical devices joined by ``intra`` inside a node
and ``inter`` between nodes; global rank ``node * per_node + local index``. A data x pipeline
plan runs ``dp`` replicas of a ``pp``-stage pipeline: ``world = nodes * per_node = dp * pp``.
Two layouts place them (``layouts``):

* ``pipelines-in-node``: replica ``r`` holds ranks ``r*pp .. r*pp + pp - 1`` (its stages side by
  side, so hand-overs stay inside a node while ``pp <= per_node``; each stage's replicas are
  spread over the nodes, so its all-reduce crosses the interconnect);
* ``replicas-in-node``: stage ``s`` holds ranks ``s*dp .. s*dp + dp - 1`` (a stage's replicas side
  by side, so its all-reduce stays inside a node while ``dp <= per_node``; hand-overs cross nodes).

``replica_profile`` turns a node's profile into the profile of one replica: ``pp`` copies of the
node's device (times of its first entry, the smallest budget of the node) at the per-replica batch.

Usage::

    cluster = Cluster.describe(profile.devices, nodes=2, intra="nvlink", interconnect="ib-400g")
    for name, ranks in layouts(dp=4, pp=4): ...      # ranks[s][r]: rank of stage s in replica r
    rep = replica_profile(profile, pp=4, batch_size=8, link_bandwidth=cluster.intra.effective_bandwidth)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..hardware import Device
from ..hardware.links import Link, default_interconnect, default_intra, lookup
from ..profiler.costs import LayerCost, Profile
from .physical import INF, physical_names

__all__ = ["Cluster", "layouts", "replica_profile", "shard_size", "LAYOUTS"]

LAYOUTS = ("pipelines-in-node", "replicas-in-node")


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``per_node`` identical devices; ``intra``/``inter``: links inside/between nodes."""

    nodes: int
    per_node: int
    device: Device
    intra: Link
    inter: Link
    assumed: tuple[str, ...] = ()  # which links were defaults rather than named

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def link(self, ranks: Sequence[int]) -> Link:
        """The slowest link a group of ranks spans: ``intra`` on one node, ``inter`` across nodes."""
        return self.intra if len({self.node_of(r) for r in ranks}) <= 1 else self.inter

    def local_device(self, rank: int) -> str:
        """The device string of ``rank`` on its node (``'cuda:3'``; ``'cpu'`` for CPU processes)."""
        kind = self.device.kind
        return kind if kind == "cpu" else f"{kind}:{rank % self.per_node}"

    @classmethod
    def describe(
        cls, devices: Sequence[Device], nodes: int, intra: str | None = None, interconnect: str | None = None
    ) -> Cluster:
        """The cluster of ``nodes`` machines each with ``devices`` (one node's list). Raises
        ``ValueError``."""
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes={nodes!r} must be an int >= 1 (machines, each with the listed devices)")
        if not devices:
            raise ValueError("devices=[] is empty; list one node's devices, e.g. devices='h100-80gb*8'")
        first = devices[0]
        odd = sorted(
            {f"{d.device} {d.name}" for d in devices if d.kind != first.kind or d.name != first.name}
        )
        if odd:
            raise ValueError(
                f"devices: a cluster plan needs one kind of device per node, but {first.device} is "
                f"{first.name!r} and {', '.join(odd)} differ; list one kind, e.g. devices='h100-80gb*8'"
            )
        if first.kind == "cpu" and len(set(physical_names(devices))) < len(devices):
            raise ValueError(
                f"devices={[str(d.device) for d in devices]}: CPU processes of one node share its cores, "
                "so a cluster plan takes one 'cpu' per node; describe more nodes (nodes=N) instead"
            )
        assumed = []
        if intra is None:
            intra_link = default_intra(first)
            assumed.append(f"intra-node link {intra_link.key} (the device's own; pass intra_link= to change)")
        else:
            intra_link = lookup(intra, first)
        if interconnect is None:
            inter_link = default_interconnect(first)
            if nodes > 1:
                assumed.append(
                    f"interconnect {inter_link.key} (an assumption; pass interconnect= / --interconnect)"
                )
        else:
            inter_link = lookup(interconnect, first)
        return cls(nodes, len(devices), first, intra_link, inter_link, tuple(assumed))


def layouts(dp: int, pp: int) -> list[tuple[str, list[list[int]]]]:
    """``(name, stage_ranks)`` for each distinct layout of ``dp`` replicas of ``pp`` stages (see the module
    docstring)."""
    if dp < 1 or pp < 1:
        raise ValueError(f"layouts(dp={dp}, pp={pp}) needs dp >= 1 and pp >= 1")
    pipelines = [[r * pp + s for r in range(dp)] for s in range(pp)]
    replicas = [[s * dp + r for r in range(dp)] for s in range(pp)]
    out = [(LAYOUTS[0], pipelines)]
    if replicas != pipelines:
        out.append((LAYOUTS[1], replicas))
    return out


def replica_profile(profile: Profile, pp: int, batch_size: int, link_bandwidth: float = INF) -> Profile:
    """One replica's profile: ``pp`` copies of the node's first device at ``batch_size`` samples.

    Copies keep the first device's per-layer times and take the node's smallest budget; their host
    link is ``link_bandwidth`` (so the cost model prices a hand-over between stages at it; ``inf``:
    free). A CPU's copies are planned as separate ``meta`` devices (each rank is its own process on
    its own machine), whose links the cost model cannot price: ``cluster`` adds hand-overs itself.
    """
    if pp < 1 or batch_size < 1:
        raise ValueError(f"replica_profile(pp={pp}, batch_size={batch_size}) needs both >= 1")
    node = profile.devices
    first = node[0]
    caps = [d.capacity for d in node if d.capacity is not None]
    budget = min(caps) if caps else None
    kind = "meta" if first.kind == "cpu" else first.kind
    host = float(link_bandwidth) if kind != "meta" else None
    devs = [
        dataclasses.replace(first, device=torch.device(kind, k), budget=budget, host_bandwidth=host)
        for k in range(pp)
    ]

    def copy(lay: LayerCost) -> LayerCost:
        return dataclasses.replace(
            lay,
            forward_fixed=[lay.forward_fixed[0]] * pp,
            forward_per_sample=[lay.forward_per_sample[0]] * pp,
            backward_fixed=[lay.backward_fixed[0]] * pp,
            backward_per_sample=[lay.backward_per_sample[0]] * pp,
            time_source=[lay.time_source[0]] * pp if lay.time_source else [],
        )

    return dataclasses.replace(
        profile, layers=[copy(lay) for lay in profile.layers], devices=devs, batch_size=batch_size
    )


def shard_size(batch_size: int, dp: int) -> int:
    """Samples of the largest replica shard: ``ceil(batch_size / dp)`` (shards differ by at most one)."""
    return math.ceil(batch_size / dp)

"""Which engine reduces a data-parallel replica's gradients: DDP (``ranks.ddp``) or FSDP2 units
(``ranks.sharded``).

``DataParallelReplica`` writes the loss contract once over either; this is where it picks one, over a process
group or a ``DeviceMesh`` dimension (the job mesh's ``dp_replicate`` or ``dp_shard``: ``ranks.devicemesh``).

Usage::

    group, engine = replica_engine(model, device, mesh["dp_replicate"], torch.device("cpu"), shard=False)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .ddp import DDPEngine
from .metaweights import fill, materialize_replica
from .sharded import ShardedEngine

__all__ = ["replica_engine"]


def replica_engine(
    module: nn.Module,
    device: torch.device,
    process_group: Any,
    comm: torch.device,
    *,
    shard: bool,
    precision: str = "32",
    weights: Any = None,
    reshard_after_forward: bool = True,
    offload: str | None = None,
    bucket_cap_mb: float = 25.0,
    find_unused_parameters: bool = False,
    sync_buffers: bool = True,
) -> tuple[Any, Any]:
    """``(process group, engine)`` for ``module`` on ``device``: FSDP2 with ``shard`` (over the mesh dimension
    when ``process_group`` is one: it composes with tensor parallel's DTensors), else DDP (a meta-built model
    filled first: a replica holds all of it); ``comm``: where collectives run."""
    mesh = process_group if hasattr(process_group, "get_group") else None  # a DeviceMesh dimension
    group = mesh.get_group() if mesh is not None else process_group
    if shard:
        engine = ShardedEngine(
            module,
            device,
            mesh or group,
            comm,
            precision=precision,
            reshard_after_forward=reshard_after_forward,
            offload=offload,
            weights=weights,
        )
        return group, engine
    if weights is not None:
        fill(module, materialize_replica(module, device), weights, group=group, comm=comm)
    engine = DDPEngine(
        module,
        device,
        group,
        bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=find_unused_parameters,
        sync_buffers=sync_buffers,
        by_sum=precision == "fp16",
    )
    return group, engine

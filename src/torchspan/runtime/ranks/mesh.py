"""The device mesh of a launched pipeline: rank <-> (replica, stage), checked as an equation.

``replicas`` data-parallel copies of a ``stages``-stage pipeline take ``replicas * stages`` ranks,
numbered replica-major: ``rank = replica * stages + stage``. So with 2 stages × 2 replicas, ranks
0 and 1 are replica 0's stages 0 and 1, ranks 2 and 3 replica 1's; on GPUs a pipeline's stages
are neighbouring ranks (same node first), and the data-parallel groups are ``{stage, stage +
stages, ...}``. A plan's ``stage_ranks[stage][replica]`` (a cluster plan may put stages elsewhere)
replaces that numbering: ``Mesh.for_world(4, 2, table=plan.stage_ranks)``.

Usage::

    mesh = Mesh.for_world(world_size=4, stages=2)          # Mesh(stages=2, replicas=2)
    mesh.rank(replica=1, stage=0), mesh.coords(3)          # 2, (1, 1)
    mesh.stage_ranks(0), mesh.pipeline_ranks(1)            # [0, 2], [2, 3]
    Mesh.of(device_mesh)                                   # the coordinates of a DeviceMesh ("pp", "dp_...")

The communication itself runs on the job's ``DeviceMesh`` (``ranks.devicemesh``): ``Mesh.of`` reads these
coordinates from its rank tensor, so the two always agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .devicemesh import check_degrees, dim_size

__all__ = ["Mesh", "launched_stages"]


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    return value


@dataclass(frozen=True)
class Mesh:
    """``replicas`` copies of a ``stages``-stage pipeline; ``table[stage][replica]`` is the rank
    (default: replica-major, ``replica * stages + stage``)."""

    stages: int
    replicas: int = 1
    table: tuple[tuple[int, ...], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        _positive("stages", self.stages)
        _positive("replicas", self.replicas)
        table = self.table or tuple(
            tuple(r * self.stages + s for r in range(self.replicas)) for s in range(self.stages)
        )
        table = tuple(tuple(row) for row in table)
        flat = sorted(r for row in table for r in row)
        if (
            len(table) != self.stages
            or any(len(row) != self.replicas for row in table)
            or flat != list(range(self.world_size))
        ):
            raise ValueError(
                f"table={[list(r) for r in table]} must list, for each of pp({self.stages}) stages, the "
                f"ranks of its dp({self.replicas}) replicas, naming every rank 0..{self.world_size - 1} once"
            )
        object.__setattr__(self, "table", table)

    @classmethod
    def for_world(
        cls,
        world_size: int,
        stages: int,
        replicas: int | None = None,
        table: Sequence[Sequence[int]] | None = None,
    ) -> Mesh:
        """The mesh filling ``world_size`` ranks; ``replicas`` defaults to ``world_size // stages``.

        Raises ``ValueError`` printing the failing equation, e.g. ``dp(2) * pp(2) != WORLD_SIZE(6)``.
        """
        _positive("world_size", world_size)
        _positive("stages", stages)
        if replicas is None:
            if world_size % stages:
                raise ValueError(
                    f"WORLD_SIZE({world_size}) is not a multiple of pp({stages}): the pipeline's {stages} "
                    f"stages cannot be replicated over {world_size} ranks. Launch a multiple of {stages} "
                    f"processes (e.g. --nproc-per-node {stages * max(1, world_size // stages)}) or use a "
                    f"plan with a stage count that divides {world_size}"
                )
            replicas = world_size // stages
        _positive("data_parallel", replicas)
        fit = world_size // stages if world_size % stages == 0 else "?"
        check_degrees(
            {"pp": stages, "dp_replicate": replicas},
            world_size,
            f"launch {replicas * stages} processes, or set the plan's data-parallel degree to {fit}",
        )
        return cls(stages, replicas, tuple(tuple(row) for row in table) if table else ())

    @classmethod
    def of(cls, device_mesh: Any) -> Mesh:
        """The coordinates of a job's ``DeviceMesh`` (``ranks.devicemesh``): ``pp`` its stages, its
        ``dp_replicate`` or ``dp_shard`` dimension the replicas, the rank tensor the table."""
        names = tuple(device_mesh.mesh_dim_names or ())
        dp = next((n for n in ("dp_replicate", "dp_shard") if n in names), None)
        stages, replicas = dim_size(device_mesh, "pp"), dim_size(device_mesh, dp) if dp else 1
        if stages * replicas != device_mesh.size():
            raise ValueError(
                f"a pipeline's mesh has dimensions pp and one dp (dp_replicate or dp_shard), not {names}"
            )
        ranks = device_mesh.mesh
        if "pp" in names and dp is not None and names.index("pp") > names.index(dp):
            ranks = ranks.transpose(0, 1)
        table = tuple(tuple(int(r) for r in row) for row in ranks.reshape(stages, replicas).tolist())
        return cls(stages, replicas, table)

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    def rank(self, replica: int, stage: int) -> int:
        """The rank holding ``stage`` of ``replica``."""
        if not (0 <= replica < self.replicas and 0 <= stage < self.stages):
            raise ValueError(
                f"(replica={replica}, stage={stage}) is outside the mesh dp({self.replicas}) x "
                f"pp({self.stages})"
            )
        return self.table[stage][replica]

    def coords(self, rank: int) -> tuple[int, int]:
        """``(replica, stage)`` of ``rank``."""
        for stage, row in enumerate(self.table):
            if rank in row:
                return row.index(rank), stage
        raise ValueError(f"rank={rank} is outside [0, WORLD_SIZE({self.world_size}))")

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks holding ``stage`` in every replica: its data-parallel group."""
        return [self.rank(r, stage) for r in range(self.replicas)]

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The ranks of one replica's pipeline, stage 0 first."""
        return [self.rank(replica, s) for s in range(self.stages)]

    def tie_ranks(self, stages: Sequence[int]) -> list[int]:
        """The ranks holding any of ``stages`` in any replica (a tied parameter's group), sorted."""
        return sorted(self.rank(r, s) for r in range(self.replicas) for s in set(stages))


def launched_stages(plan: Any, devices: Any, balance: Sequence[int] | None) -> int:
    """How many pipeline stages a ``span`` call in a launched job asks for.

    A plan: its stage count. Hand placement: ``len(balance)``, else the number of ``devices``
    entries (a list, or a comma string), else 1 (pure data parallel).
    """
    if plan is not None:
        return len(plan.stages)
    if balance is not None:
        return len(balance)
    if devices is None:
        return 1
    if isinstance(devices, str):
        return len([d for d in devices.split(",") if d.strip()])
    if isinstance(devices, Sequence):
        return len(devices)
    return 1

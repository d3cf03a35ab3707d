"""A pipeline across ranks, optionally replicated data-parallel: ``span(model, ...)`` in a launched job.

Each rank runs one stage of one replica (``Mesh``: ``rank = replica * stages + stage``, the job's
``DeviceMesh`` ``("pp", "dp_replicate")``). It holds
what the local ``PipelinedExecutor`` holds with another ``Transport``: the same stage functions
(``StageFunctions``), schedule walk (``Pipeline``) and loss weights, but values to other stages
travel by point-to-point (``RankTransport``). What several processes need (other stages' layers as
``meta``, the data-parallel and tied-parameter groups, the global loss normalizer, this step's
gradient reductions started once the rank's last backward ran) is the ``RankStage`` it holds, as
``RankOwnForwardExecutor`` (models that run their own forward) does. Here:

- **Loss**: the last stage's summed weighted loss rides down the pipeline on the last backward
  messages (no collective in a single pipeline); with replicas it is summed (float64) in the
  stage's group alongside the gradients, so ``train_step`` returns the full-batch loss on every rank.
- ``spanned(x)`` runs a forward without autograd (a graph cannot cross processes) and returns the
  last stage's outputs on every rank of the pipeline; train with ``train_step``.
- **Sharded** (``shard=True`` with replicas): each stage's layers are sharded by FSDP2 over the
  stage's replicas (``ranks.stageshard``); a layer an fx trace reads a parameter of directly
  (``get_attr``) stays replicated. Every forward is then a collective of the stage's replicas.
- **A model built on meta** (``weights=``): only this stage's layers (and the model's own tensors) are made
  real on this rank, then filled from ``weights`` (``ranks.metaweights``) before the replicas start alike.

Usage (``span`` does this in a launched job)::

    ex = RankPipelineExecutor(model, "sequential", None, groups, settings, recorder, meter, Mesh(2, 2),
                              rank_info())
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...layers import top_level_modules
from ..executor import Settings, Work
from ..local.looped import LoopedPipeline
from ..local.pipelined import stage_functions
from ..local.stagefns import StageFunctions
from ..lossweights import LossSpec
from ..memory import ActivationMeter
from ..metainit import bind
from ..placement import check_shared, place
from ..record import Recorder
from .env import RankInfo, rank_info
from .looped import LastBackwards, LoopedTransport, looped_mesh, position_groups
from .mesh import Mesh, launched_stages
from .metaweights import fill, materialize_stage
from .p2p import RankTransport
from .stage import RankStage, StageExecutor

__all__ = ["RankPipelineExecutor", "launched_mesh"]


class RankPipelineExecutor(StageExecutor):
    """This rank's stage of a ``mesh.replicas`` x ``mesh.stages`` pipeline mesh (see the module docstring)."""

    stage_type: type[RankStage] = RankStage  # ranks.tpstages: a tensor-parallel stage

    def __init__(
        self,
        model: nn.Module,
        mode: str,
        graph: Any,
        groups: Sequence[Sequence[str]],
        settings: Settings,
        recorder: Recorder,
        meter: ActivationMeter,
        mesh: Mesh,
        info: RankInfo,
        *,
        shard: bool = False,
        reshard_after_forward: bool = True,
        weights: Any = None,
    ) -> None:
        # RankStage counts positions (one per rank of a pipeline), each holding its looped stages
        # (ranks.looped)
        self.ranks = self.stage_type(
            model, mesh, info, mesh.stages, settings.precision, settings=settings, shard=shard
        )
        mesh = (
            self.ranks.mesh
        )  # the coordinates of the job's DeviceMesh (a user's span(mesh=) may number otherwise)
        if mode not in ("sequential", "fx"):
            raise ValueError(
                f"RankPipelineExecutor runs stage functions (sequential or fx), not {mode!r}: span uses "
                "RankOwnForwardExecutor"
            )
        super().__init__([info.device] * len(groups), groups)
        self.mode, self.model, self.settings = mode, model, settings
        self.stage = self.ranks.stage  # this rank's position in its pipeline; it runs stages ``self.local``
        self.local = list(range(self.stage, len(groups), mesh.stages))
        self.mine = position_groups(self.groups, mesh.stages)[
            self.stage
        ]  # the layers of every stage of this rank
        transport = (
            RankTransport(mesh, info.rank, info.device, self.ranks.comm)
            if len(groups) == mesh.stages
            else LoopedTransport(mesh, info.rank, info.device, self.ranks.comm, stages=len(groups))
        )
        self.shards_batch = mesh.replicas > 1  # each pipeline trains one shard of the global batch
        self.fns = StageFunctions(model, mode, self.groups)
        self._pipeline = LoopedPipeline(
            self.devices,
            recompute=settings.recompute,
            precision=settings.precision,
            recorder=recorder,
            meter=meter,
            transport=transport,
        )
        stage = [top_level_modules(model)[name] for name in self.mine]  # and the model's own tensors:
        slots = materialize_stage(model, stage, info.device, roots=True) if weights is not None else None
        self._place(graph)
        if slots is not None:  # values for this stage only, before the replicas are made alike
            bind(slots, model)
            fill(model, slots, weights, comm=self.ranks.comm)
        self.ranks.start()
        if shard:
            self._shard(graph, reshard_after_forward)
            self._pipeline.split = (
                False  # FSDP reduces a layer once its inputs' gradients are done: no split backward
            )

    def _shard(self, graph: Any, reshard_after_forward: bool) -> None:
        """This stage's layers sharded over its replicas, except those whose tensors the fx graph reads
        directly."""
        layers = top_level_modules(self.model)
        read = [str(n.target) for n in (graph.nodes if graph is not None else ()) if n.op == "get_attr"]
        mine = [(name, layers[name]) for name in self.mine if not any(t.startswith(name + ".") for t in read)]
        self.ranks.shard(mine, reshard_after_forward)

    def _place(self, graph: Any) -> None:
        """Only this stage's layers move to this rank's device; the other stages' become meta. An fx split
        still cuts every stage (the transport needs their boundaries), placing only ours."""
        layers = top_level_modules(self.model)
        positions = self.ranks.mesh.stages
        local = self.ranks.find_ties(layers, position_groups(self.groups, positions))
        for s, group in enumerate(self.groups):
            if s % positions != self.stage:
                for name in group:
                    self.ranks.to_meta(layers[name], local)
        stage_of = self.stage_of
        mine = {name: s for name, s in stage_of.items() if s % positions == self.stage}
        check_shared(self.model, stage_of)

        def put(attrs: dict[str, int]) -> None:
            self.root_attrs = dict(attrs)
            place(self.model, mine, self.devices, self.root_attrs)

        self.fns.split(graph, put)
        self.ranks.roots_to_meta({q: s % positions for q, s in self.root_attrs.items()}, local)

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
        return self.fns.prepare(args, kwargs, self.settings.microbatches)

    def meters(self) -> bool:
        """Until one training step has counted its saved activations; later steps skip the saved-tensor
        hooks (~5% of a small 2-rank step) unless their micro-batches' shapes, dtypes or structure differ
        from the metered step's (``memory.MeteredSteps``: then that step is metered and starts a new peak).
        A launched job repeats one shape, so ``memory()`` keeps reporting a step of the shape it trains."""
        return not self._pipeline.metered

    def train(
        self,
        work: Work,
        targets: Sequence[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        weights: Sequence[float],
        spec: LossSpec | None = None,
    ) -> torch.Tensor:
        s = self.settings
        self.ranks.check_same_batch(
            work.chunks, targets, self._pipeline.transport
        )  # verdict before the first transfer
        buffers = self.fns.buffers(self.root_attrs, s.recompute)
        with (
            self.ranks.reducing() as reduction
        ):  # this step's gradients summed in each group once its last backward ran
            loss = self._pipeline.train(
                stage_functions(work),
                work.chunks,
                targets,
                loss_fn,
                weights,
                s.schedule,
                s.scaler,
                buffers,
                finished=LastBackwards(len(self.local), reduction.finished),
                before_last=(lambda s, outs: reduction.before_last(outs)) if len(self.local) == 1 else None,
            )
        total = reduction.total
        return total[0].to(loss.device, loss.dtype) if total is not None else loss

    def forward(self, work: Work) -> list[Any]:
        """Outputs of every micro-batch on every rank of this pipeline (no autograd across processes)."""
        with torch.no_grad():
            outs = self._pipeline.forward(
                stage_functions(work), work.chunks, self.fns.buffers(self.root_attrs, self.settings.recompute)
            )
        return self.ranks.shared_outputs(outs)


def launched_mesh(plan: Any, devices: Any, balance: Sequence[int] | None) -> tuple[Mesh, RankInfo] | None:
    """``(mesh, rank info)`` when ``span`` runs in a launched job (a process group of size > 1) and
    asks for more than one stage; ``None`` for one process or one stage (data parallel).

    Stages: the plan's, else ``len(balance)``, else ``len(devices)``; replicas: the plan's
    ``data_parallel`` (with its ``stage_ranks``), else ``WORLD_SIZE // stages``. Raises ``ValueError``
    printing ``pp(2) * dp_replicate(3) * dp_shard(1) != WORLD_SIZE(4)`` when they do not fill the world. The
    ``DeviceMesh`` over these coordinates is made by the executor's ``RankStage`` (``ranks.devicemesh``). More
    stages than ranks: one pipeline over every rank, stage ``s`` on rank ``s % WORLD_SIZE``
    (``ranks.looped``).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    stages = launched_stages(plan, devices, balance)
    if stages == 1:
        return None
    info = rank_info()
    table = getattr(plan, "stage_ranks", None) or None
    looped = None if table else looped_mesh(info.world_size, stages)
    if looped is not None:
        return looped, info
    replicas = getattr(plan, "data_parallel", None) if table else None
    return Mesh.for_world(info.world_size, stages, replicas, table), info

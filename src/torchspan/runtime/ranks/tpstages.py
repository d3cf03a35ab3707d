"""3-D parallelism: a pipeline across ranks whose stages are each tensor-parallel, with data-parallel
replicas.

``span(model, tp=T, balance=[...])`` (or ``devices=`` with one entry per stage) in a job of ``pp * dp * T``
processes builds the job's ``DeviceMesh`` ``("pp", "dp_replicate", "tp")``, ``tp`` innermost (torchtitan's
order), and runs the stage functions of ``ranks.pipelined`` on it:

- **Pipelines**: the ranks of one ``tp`` coordinate ``t`` form ``dp`` pipelines of their own; rank ``(s, r,
t)``
  sends to ``(s + 1, r, t)``. Activations at stage boundaries are whole and identical on every ``tp`` rank
  (the styles' ``use_local_output``), so each ``tp`` coordinate's pipeline carries the same values.
- **Layers**: this stage's layers are split over ``mesh["tp"]`` by ``parallelize_module``, by the plan
filtered to
  them (``tensorparallel.parallelize(within=)``); the other stages' layers are ``meta``. Every tensor starts
  as the ``tp`` rank 0's (broadcast over ``tp``), then as replica 0's and the tied copies'
  (``RankStage.start``).
- **Reductions**: the loss and the gradients are summed over ``dp`` only (a ``DTensor`` gradient by its local
  shard, which every replica of that ``tp`` coordinate holds alike); a parameter tied across stages (kept
  whole on every ``tp`` rank) over its stages' ranks of this ``tp`` coordinate only.
- **Clipping** (``runtime.gradients``): a split parameter's norm is its shards' norms combined over ``tp``,
then
  the pipeline-wide sum runs over ``mesh["pp"]`` of this ``tp`` coordinate, so a whole parameter held on every
  ``tp`` rank counts once.

Both executors: stage functions (an ``nn.Sequential`` or fx-traceable model, ``TpPipelineExecutor``) and the
model's own forward (a transformers model by its ``base_model_tp_plan``, ``TpOwnForwardExecutor``: the
recording forward runs whole, the stage is split once placed). Refused (``ValueError`` naming the argument):
sequence parallel in a plan, several stages per rank, ``shard=True``, ``weights=``, ``plan=``.

Usage (``span`` does this in a launched job of 4 processes)::

    plan = {"1.up": "colwise", "1.down": "rowwise"}
    spanned = span(model, tp=2, balance=[2, 2], microbatches=3, tp_plan=plan)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .devicemesh import derived_group, job_mesh, sub_mesh
from .env import RankInfo
from .mesh import Mesh
from .ownforward import RankOwnForwardExecutor
from .pipelined import RankPipelineExecutor
from .stage import RankStage

__all__ = ["TpOwnForwardExecutor", "TpPipelineExecutor", "TpRankStage", "check_tp_pipeline", "tp_pipeline"]


@dataclass(frozen=True)
class _TpSlice(Mesh):
    """The ``pp x dp`` ranks of one ``tp`` coordinate (``table[stage][replica]``, not numbered from 0)."""

    def __post_init__(self) -> None:
        table = tuple(tuple(int(r) for r in row) for row in self.table)
        if len(table) != self.stages or any(len(row) != self.replicas for row in table):
            raise ValueError(f"table={table} must have pp({self.stages}) rows of dp({self.replicas}) ranks")
        object.__setattr__(self, "table", table)


def check_tp_pipeline(tp: Any, tp_plan: Any, plan: Any, sharding: dict[str, Any], weights: Any) -> None:
    """What ``span(model, tp=..., balance=...)`` (a pipeline of tensor-parallel stages) refuses, before any
    work."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be an int >= 1 (the processes each stage's layers are split over)")
    given = {"plan": plan, "weights": weights, "offload": sharding.get("offload")}
    given["shard"] = True if sharding.get("shard") else None
    named = [k for k, v in given.items() if v is not None]
    if named:
        raise ValueError(
            f"span(model, tp={tp}) with pipeline stages and {', '.join(named)}=: a pipeline of "
            "tensor-parallel stages runs with data-parallel replicas (dp_replicate), on a model built with "
            "its weights, placed by balance=/devices=; drop "
            + ", ".join(f"{k}=" for k in named)
            + ", or drop balance=/devices= (tp x dp_shard)"
        )
    if isinstance(tp_plan, dict) and any(style == "sequence_parallel" for style in tp_plan.values()):
        raise ValueError(
            f"tp_plan={tp_plan!r} names 'sequence_parallel' inside a pipeline stage: activations cross "
            "stages whole, and sequence-sharded ones are not built yet; drop the 'sequence_parallel' "
            "entries (their rowwise projections then all-reduce) or drop balance=/devices= (one "
            "tensor-parallel stage)"
        )


class TpRankStage(RankStage):
    """A ``RankStage`` on the mesh ``("pp", "dp_replicate", "tp")`` (see the module docstring); ``tp_mesh``:
    this stage's ``tp`` sub-mesh, ``mesh``: the ``pp x dp`` ranks of this rank's ``tp`` coordinate."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        info: RankInfo,
        stages: int,
        precision: str = "32",
        *,
        settings: Any,
        shard: bool = False,
    ) -> None:
        tp = settings.tp[0]  # (tp, tp_plan): build's
        if precision == "fp16":
            raise ValueError(
                "precision='fp16' across ranks is not supported: each rank's gradient scaler would decide "
                "alone to skip a step on inf and the stages would drift apart; use precision='bf16' (no "
                "scaler needed) or '32'"
            )
        world = dist.get_world_size()
        replicas = max(1, world // (stages * tp))
        self.device = info.device
        self.comm = info.device if info.backend and "nccl" in info.backend else torch.device("cpu")
        self.dp_name = "dp_replicate"
        advice = f"launch pp({stages}) x tp({tp}) x replicas processes (e.g. {stages * tp})"
        degrees = {"pp": stages, "dp_replicate": replicas, "tp": tp}
        self.device_mesh = job_mesh(
            self.comm.type, degrees, keep=("pp", "tp"), given=settings.mesh, advice=advice
        )
        settings.mesh = self.device_mesh
        ranks = self.device_mesh.mesh
        self.tp_index = int((ranks == info.rank).nonzero()[0, -1])
        self.tp_mesh = self.device_mesh["tp"]
        self.mesh = _TpSlice(
            stages,
            replicas,
            tuple(map(tuple, ranks.select(-1, self.tp_index).reshape(stages, replicas).tolist())),
        )
        self.model, self.info = model, info
        self.replica, self.stage = self.mesh.coords(info.rank)
        self.dp_mesh = sub_mesh(self.device_mesh, self.dp_name) if replicas > 1 else None
        self.stage_group: Any = self.dp_mesh.get_group() if self.dp_mesh is not None else None
        self.pipe_group: Any = self.device_mesh["pp"].get_group()
        self._tie_stages: list[tuple[int, ...]] = []
        self._tie_of: dict[int, int] = {}
        self._tie_groups: list[tuple[Any, int]] = []
        self._batch_checked: Any = None
        self.shards = None

    def start(self) -> None:
        """Tie groups per ``tp`` coordinate (collective: every rank makes every group, in one order), then
        every tensor this rank holds as its ``tp`` rank 0's, replica 0's and the tied copies' lowest
        rank's."""
        for (
            stages
        ) in self._tie_stages:  # those stages' ranks of this tp coordinate, every replica (ranks.devicemesh)
            group, ranks = derived_group(self.device_mesh, "pp", stages, per="tp")
            self._tie_groups.append((group, ranks[0]))
        held = [t for t in [*self.model.parameters(), *self.model.buffers()] if t.device.type != "meta"]
        with torch.no_grad():
            src = int(self.tp_mesh.mesh[0])
            for t in held:
                self._broadcast(t, src, self.tp_mesh.get_group())
            if self.stage_group is not None:
                for t in held:
                    if id(t) not in self._tie_of:
                        self._broadcast(t, self.mesh.rank(0, self.stage), self.stage_group)
            for p in self.model.parameters():
                i = self._tie_of.get(id(p))
                if i is not None:
                    self._broadcast(p, self._tie_groups[i][1], self._tie_groups[i][0])

    def state_dict(self, **options: Any) -> Any:
        """The model's state as this rank holds it (other stages' entries ``meta``), split entries as full
        tensors (gathered over ``tp``: every rank calls it)."""
        from .tensorparallel import full_tensors

        if options.get("keep_vars"):
            raise ValueError(
                "keep_vars=True would return the split parameters; use "
                "spanned.module.state_dict(keep_vars=True)"
            )
        return full_tensors(self.model.state_dict(**options))

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load the model's own keys; a split entry given as a full tensor keeps this rank's shard of it."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        own = self.model.state_dict()
        state = dict(state_dict)
        for key, value in state.items():
            held = own.get(key)
            if isinstance(held, DTensor) and not isinstance(value, DTensor):
                state[key] = distribute_tensor(
                    value.to(held.device), held.device_mesh, held.placements, src_data_rank=None
                )
        return self.model.load_state_dict(state, strict=strict)

    def launch(self, params: list[nn.Parameter], group: Any) -> list[tuple[Any, Any]]:
        """SUMs of ``params``' gradients over ``group`` (a ``DTensor``'s by its local shard), one buffer per
        dtype."""
        from torch.distributed.tensor import DTensor

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        out = []
        for ps in by_dtype.values():
            parts = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in ps]
            flat = torch.cat([g.reshape(-1) for g in parts]).to(self.comm)

            def unpack(ps: list[nn.Parameter] = ps, flat: torch.Tensor = flat) -> None:
                k = 0
                for p in ps:
                    shard = local(p)
                    g = flat[k : k + shard.numel()].view_as(shard).to(shard.device)
                    k += shard.numel()
                    if p.grad is not None or bool(g.any()):
                        is_d = isinstance(p, DTensor)
                        p.grad = (
                            DTensor.from_local(
                                g,
                                p.device_mesh,
                                p.placements,
                                run_check=False,
                                shape=p.shape,
                                stride=p.stride(),
                            )
                            if is_d
                            else g
                        )

            out.append((dist.all_reduce(flat, group=group, async_op=True), unpack))
        return out


def split_stage(model: nn.Module, mesh: Any, tp_plan: Any, layers: Any) -> None:
    """This stage's ``layers`` split over the ``tp`` sub-mesh by the plan filtered to them; a plan (a model's
    own too) with sequence parallel there is refused (its activations would cross stages sequence-sharded)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    from .tensorparallel import parallelize, tp_styles

    styles = tp_styles(model, tp_plan)
    sequence = [n for n, st in styles.items() if isinstance(st, SequenceParallel)]
    if sequence:
        raise ValueError(
            f"the tensor-parallel plan (tp_plan={tp_plan!r}, else the model's own) runs {sequence[:3]} "
            "sequence parallel, inside a pipeline of tensor-parallel stages that is not built; pass a "
            "tp_plan= without 'sequence_parallel' entries, or drop balance=/devices= (one tensor-parallel "
            "stage)"
        )
    parallelize(model, mesh, tp_plan, within=layers)


class TpPipelineExecutor(RankPipelineExecutor):
    """``RankPipelineExecutor`` on a ``TpRankStage``: this rank's stage split over its ``tp`` ranks after it
    started."""

    stage_type = TpRankStage

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        split_stage(self.model, self.ranks.tp_mesh, self.settings.tp[1], self.mine)  # type: ignore[attr-defined]


def tp_pipeline_executor(
    model: nn.Module, lay: Any, settings: Any, recorder: Any, meter: Any, **options: Any
) -> Any:
    """``choose``'s executor for ``settings.tp`` in a launched pipeline: stage functions (``lay.mode``
    sequential or fx) or the model's own forward; ``options``: the own forward's (``choose``)."""
    tp = settings.tp[0]
    _, info = lay.ranked
    world, stages = dist.get_world_size(), len(lay.groups)
    if world % (stages * tp):
        raise ValueError(
            f"span(model, tp={tp}) with {stages} stages (balance=/devices=) on WORLD_SIZE({world}): a "
            f"pipeline of tensor-parallel stages takes pp x tp({tp}) x replicas processes, one stage per "
            "rank (several stages per rank with tp are not built); pass balance= with a number of entries "
            f"dividing {world // tp}, or launch a multiple of {stages * tp} processes"
        )
    mesh = Mesh(
        stages, world // (stages * tp)
    )  # the degrees; TpRankStage reads the ranks from the job's DeviceMesh
    if lay.mode == "own-forward":
        return TpOwnForwardExecutor(model, lay.groups, settings, recorder, meter, mesh, info, **options)
    return TpPipelineExecutor(model, lay.mode, lay.graph, lay.groups, settings, recorder, meter, mesh, info)


class TpOwnForwardExecutor(RankOwnForwardExecutor):
    """``RankOwnForwardExecutor`` on a ``TpRankStage``: this rank's stage split over its ``tp`` ranks once
    placed (the recording forward runs the whole model, whole)."""

    stage_type = TpRankStage

    def place(self, work: Any) -> None:
        if self._placed:
            return
        super().place(work)
        split_stage(self.model, self.ranks.tp_mesh, self.settings.tp[1], self.groups[self.stage])  # type: ignore[attr-defined]
        self._kept = {id(t) for t in [*self.model.parameters(), *self.model.buffers()]}


def tp_pipeline(tp: Any, tp_plan: Any, plan: Any, sharding: dict[str, Any], where: dict[str, Any]) -> bool:
    """Whether ``span(model, tp=...)`` asks for a pipeline of tensor-parallel stages (a launched job, no plan,
    and ``balance=``/``devices=`` naming several stages); checked (``check_tp_pipeline``) when it does."""
    from .mesh import launched_stages

    launched = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if (
        plan is not None
        or tp is None
        or not launched
        or launched_stages(None, where["devices"], where["balance"]) < 2
    ):
        return False
    check_tp_pipeline(tp, tp_plan, plan, sharding, where["weights"])
    return True

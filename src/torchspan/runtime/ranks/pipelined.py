"""A pipeline across ranks, optionally replicated data-parallel: ``span(model, ...)`` in a launched job.

Each rank runs one stage of one replica (``Mesh``: ``rank = replica * stages + stage``). It is the
local ``PipelinedExecutor`` with another ``Transport``: the same stage functions, schedule walk
(``Pipeline``) and loss weights, but values to other stages travel by point-to-point
(``RankTransport``). What differs is only what several processes need:

- **Memory**: layers of other stages become ``meta`` tensors (``requires_grad=False``) on this
  rank, so only this stage's parameters take memory and reach the optimizer.
- **Weights**: with several replicas the loss normalizer (samples, class weights, non-ignored
  tokens) is all-reduced among the last stages (the only ones weighing losses), so every replica
  weighs its micro-batches against the global batch; the other stages start at once.
- **Gradients**: once a rank has run its stage's last backward (earlier stages may still be
  computing), its gradients are all-reduced (SUM, async, one flat buffer per dtype) in its
  data-parallel group (the ranks holding that stage). A parameter shared by layers on different
  stages (tied embeddings) lives on every rank that uses it and is all-reduced in its own group
  (the ranks holding any of those stages, all replicas: Megatron's embedding group), so its
  copies stay identical. Replicas and tied copies start identical: broadcast at construction.
- **Loss**: the last stage's summed weighted loss rides down the pipeline on the last backward
  messages (no collective in a single pipeline); with replicas it is summed (float64) in the
  stage's group alongside the gradients, so ``train_step`` returns the full-batch loss on every rank.
- ``spanned(x)`` runs a forward without autograd (a graph cannot cross processes) and returns the
  last stage's outputs on every rank of the pipeline; train with ``train_step``.

Usage (``span`` does this in a launched job)::

    ex = RankPipelineExecutor(model, "sequential", None, groups, settings, recorder, meter, Mesh(2, 2), rank_info())
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...layers import fxsplit as split
from ...layers import layer_modules
from ..executor import Settings, Work
from ..local.pipeline import Pipeline
from ..local.pipelined import PipelinedExecutor, _concrete_id
from ..lossweights import LossSpec
from ..memory import ActivationMeter
from ..placement import check_shared, place
from ..record import Recorder
from .env import RankInfo, rank_info
from .mesh import Mesh, launched_stages
from .p2p import RankTransport

__all__ = ["RankPipelineExecutor", "launched_mesh"]


def _meta_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


class RankPipelineExecutor(PipelinedExecutor):
    """This rank's stage of a ``mesh.replicas`` x ``mesh.stages`` pipeline mesh (see the module docstring)."""

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
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("no process group: call torchspan.init_distributed() before span() in a launched job")
        if mode not in ("sequential", "fx"):
            raise ValueError(
                f"a pipeline across ranks needs stage functions, but this model runs by {mode!r} (its layers are blocks "
                "inside containers, or it is not fx-traceable); make it an nn.Sequential or fx-traceable, or run it "
                "data-parallel only (span(model) without balance/devices/plan stages)"
            )
        if info.world_size != mesh.world_size:
            raise ValueError(f"dp({mesh.replicas}) * pp({mesh.stages}) != WORLD_SIZE({info.world_size})")
        if len(groups) != mesh.stages:
            raise ValueError(f"{len(groups)} layer group(s) for pp({mesh.stages}) stages; give one group per stage")
        self.mesh, self.info = mesh, info
        self.replica, self.stage = mesh.coords(info.rank)
        self.device = info.device
        self._comm = info.device if info.backend and "nccl" in info.backend else torch.device("cpu")
        super().__init__(model, mode, graph, [info.device] * mesh.stages, groups, settings, recorder, meter)
        self._pipeline = Pipeline(
            self.devices,
            checkpoint=settings.checkpoint,
            precision=settings.precision,
            recorder=recorder,
            meter=meter,
            transport=RankTransport(mesh, info.rank, info.device, self._comm),
        )
        self._make_groups()
        self._sync_start()

    # ------------------------------------------------------------------ placement
    def _holders(self) -> dict[int, set[int]]:
        """id(parameter) -> the stages whose layers hold it (before any is made meta)."""
        found: dict[int, set[int]] = {}
        layers = layer_modules(self.model)
        for s, group in enumerate(self.groups):
            for name in group:
                for p in layers[name].parameters():
                    found.setdefault(id(p), set()).add(s)
        return found

    def _place(self, graph: Any) -> None:
        holders = self._holders()
        layers = layer_modules(self.model)
        local = {id(t) for name in self.groups[self.stage] for t in [*layers[name].parameters(), *layers[name].buffers()]}
        # Tied parameters: one group per set of stages sharing parameters, the same list on every rank.
        self._tie_stages = sorted({tuple(sorted(st)) for st in holders.values() if len(st) > 1})
        self._tie_of: dict[int, int] = {}
        for pid, st in holders.items():
            if len(st) > 1 and pid in local:
                self._tie_of[pid] = self._tie_stages.index(tuple(sorted(st)))
        for s, group in enumerate(self.groups):
            if s != self.stage:
                for name in group:
                    self._to_meta(layers[name], local)
        # Only this stage's layers move to this rank's device (the others are meta by now); an fx
        # split still cuts every stage (the transport needs their boundaries), placing only ours.
        stage_of = self.stage_of
        mine = {name: s for name, s in stage_of.items() if s == self.stage}
        check_shared(self.model, stage_of)

        def put(attrs: dict[str, int]) -> None:
            self.root_attrs = dict(attrs)
            place(self.model, mine, self.devices, self.root_attrs)

        if graph is None:
            put({})
        else:
            mods, _ = split.split_graph(self.model, graph, stage_of, len(self.devices), before_build=put)
            self._default_trace = (_concrete_id(split.default_concrete_args(self.model)), mods)
        for qname, s in self.root_attrs.items():  # the model's own tensors read by other stages
            if s != self.stage:
                path, _, attr = qname.rpartition(".")
                self._to_meta(self.model.get_submodule(path) if path else self.model, local, only=attr)

    @staticmethod
    def _to_meta(module: nn.Module, keep: set[int], only: str | None = None) -> None:
        for mod in module.modules() if only is None else [module]:
            for key, p in list(mod._parameters.items()):
                if p is not None and id(p) not in keep and (only is None or key == only) and p.device.type != "meta":
                    mod._parameters[key] = nn.Parameter(_meta_copy(p), requires_grad=False)
            for key, b in list(mod._buffers.items()):
                if b is not None and id(b) not in keep and (only is None or key == only):
                    mod._buffers[key] = _meta_copy(b)

    def local_parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters (its stage's, tied ones included), in model order."""
        return [p for p in self.model.parameters() if p.device.type != "meta" and p.requires_grad]

    # ------------------------------------------------------------------ groups and start
    def _make_groups(self) -> None:
        """Every rank creates every group, in one order (``new_group`` is collective)."""
        m = self.mesh
        self._stage_group: Any = None
        if m.replicas > 1:
            for s in range(m.stages):
                g = dist.new_group(m.stage_ranks(s))
                if s == self.stage:
                    self._stage_group = g
        self._pipe_group: Any = None
        if m.replicas > 1:
            for r in range(m.replicas):
                g = dist.new_group(m.pipeline_ranks(r))
                if r == self.replica:
                    self._pipe_group = g
        self._tie_groups: list[tuple[Any, int]] = []  # (group, its lowest rank)
        for stages in self._tie_stages:
            ranks = m.tie_ranks(stages)
            self._tie_groups.append((dist.new_group(ranks), ranks[0]))

    def _sync_start(self) -> None:
        """Replicas of a stage and tied copies start identical: broadcast from the lowest holding rank."""
        with torch.no_grad():
            if self._stage_group is not None:
                src = self.mesh.rank(0, self.stage)
                for t in [*self.model.parameters(), *self.model.buffers()]:
                    if t.device.type != "meta" and id(t) not in self._tie_of:
                        self._broadcast(t, src, self._stage_group)
            for p in self.model.parameters():
                i = self._tie_of.get(id(p))
                if i is not None:
                    group, src = self._tie_groups[i]
                    self._broadcast(p, src, group)

    def _broadcast(self, t: torch.Tensor, src: int, group: Any) -> None:
        buf = t.detach().to(self._comm)
        dist.broadcast(buf, src=src, group=group)
        if buf is not t:
            t.detach().copy_(buf)

    # ------------------------------------------------------------------ steps
    def meters(self) -> bool:
        """Until one training step has counted its saved activations; later steps skip the saved-tensor
        hooks (~5% of a small 2-rank step) unless their micro-batches' shapes, dtypes or structure differ
        from the metered step's (``Pipeline._meters``: then that step is metered and starts a new peak).
        A launched job repeats one shape, so ``memory()`` keeps reporting a step of the shape it trains."""
        return not self._pipeline.metered

    def weights(self, spec: LossSpec, targets: Sequence[Any], sizes: Sequence[int]) -> list[float]:
        """Micro-batch weights against the global batch. Only the last stages weigh losses: they all-reduce
        their normalizers among themselves (the other stages start their forward at once)."""
        if self.mesh.replicas == 1 or spec.kind == "sum" or self.stage != self.mesh.stages - 1:
            return spec.weights(targets, sizes)
        local = sum(spec.normalizer(t, n) for t, n in zip(targets, sizes))
        total = torch.tensor([local], dtype=torch.float64, device=self._comm)
        dist.all_reduce(total, group=self._stage_group)
        return spec.weights(targets, sizes, total=float(total.item()))

    def train(
        self,
        work: Work,
        targets: Sequence[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        weights: Sequence[float],
    ) -> torch.Tensor:
        params = self.local_parameters()
        earlier = [p.grad for p in params]  # gradients accumulate as on one device: reduce only this step's
        for p in params:
            p.grad = None
        launched: list[tuple[Any, Any]] = []
        totals: list[torch.Tensor] = []

        def finished(stage: int, loss: torch.Tensor) -> None:
            """This rank's last backward ran: start its reductions while the earlier stages still compute."""
            if self._stage_group is not None:
                total = loss.detach().to(self._comm, torch.float64).reshape(1)
                launched.append((dist.all_reduce(total, group=self._stage_group, async_op=True), None))
                totals.append(total)
                launched.extend(self._launch([p for p in params if id(p) not in self._tie_of], self._stage_group))
            for i, (group, _) in enumerate(self._tie_groups):
                launched.extend(self._launch([p for p in params if self._tie_of.get(id(p)) == i], group))

        try:
            s = self.settings
            fns = self._fns(work)
            loss = self._pipeline.train(
                fns, work.chunks, targets, loss_fn, weights, s.schedule, s.scaler, self._stage_buffers(), finished=finished
            )
            for handle, unpack in launched:  # the SUMs of this step's gradients and the replicas' losses
                handle.wait()
                if unpack is not None:
                    unpack()
        finally:
            for p, g in zip(params, earlier):
                if g is not None:
                    p.grad = g if p.grad is None else g.add_(p.grad)
        return totals[0][0].to(loss.device, loss.dtype) if totals else loss

    def _launch(self, params: list[nn.Parameter], group: Any) -> list[tuple[Any, Any]]:
        """Start SUMs of ``params``' gradients over ``group``: one flat buffer per dtype (a missing grad counts as 0)."""
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        out = []
        for ps in by_dtype.values():
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps]).to(self._comm)

            def unpack(ps: list[nn.Parameter] = ps, flat: torch.Tensor = flat) -> None:
                k = 0
                for p in ps:
                    g = flat[k : k + p.numel()].view_as(p).to(p.device)
                    k += p.numel()
                    if p.grad is not None or bool(g.any()):  # a gradient no replica produced stays None
                        p.grad = g

            out.append((dist.all_reduce(flat, group=group, async_op=True), unpack))
        return out

    def forward(self, work: Work) -> list[Any]:
        """Outputs of every micro-batch on every rank of this pipeline (no autograd across processes)."""
        with torch.no_grad():
            outs = super().forward(work)
        last = self.mesh.rank(self.replica, self.mesh.stages - 1)
        box = [outs if self.info.rank == last else None]
        dist.broadcast_object_list(box, src=last, group=self._pipe_group, device=self._comm)
        dev = self.device
        return [torch.utils._pytree.tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, o) for o in box[0]]


def launched_mesh(plan: Any, devices: Any, balance: Sequence[int] | None) -> tuple[Mesh, RankInfo] | None:
    """``(mesh, rank info)`` when ``span`` runs in a launched job (a process group of size > 1) and
    asks for more than one stage; ``None`` for one process or one stage (data parallel).

    Stages: the plan's, else ``len(balance)``, else ``len(devices)``; replicas: the plan's
    ``data_parallel`` (with its ``stage_ranks``), else ``WORLD_SIZE // stages``. Raises ``ValueError``
    printing ``dp(2) * pp(2) != WORLD_SIZE(6)`` when they do not fill the world.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    stages = launched_stages(plan, devices, balance)
    if stages == 1:
        return None
    info = rank_info()
    table = getattr(plan, "stage_ranks", None) or None
    replicas = getattr(plan, "data_parallel", None) if table else None
    return Mesh.for_world(info.world_size, stages, replicas, table), info

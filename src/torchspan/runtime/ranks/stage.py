"""What every executor holding one pipeline stage per rank holds, whatever runs the stage.

``RankStage`` is an object that ``RankPipelineExecutor`` (stage functions) and
``RankOwnForwardExecutor`` (the model's own forward) each hold. It keeps:

- **Memory**: layers of other stages become ``meta`` tensors (``requires_grad=False``) on this
  rank, so only this stage's parameters take memory and reach the optimizer.
- **Groups**: sub-meshes of the job's ``DeviceMesh`` (``ranks.devicemesh``, ``("pp", "dp_replicate")``): this
  stage's replicas ``mesh["dp_replicate"]`` (``"dp_shard"`` sharded), this replica's pipeline ``mesh["pp"]``,
  and one group per set of stages sharing parameters, derived from the mesh's rank tensor (tied embeddings:
  Megatron's embedding group, every replica included). Replicas and tied copies start identical (broadcast).
- **Weights**: with replicas, the last stages all-reduce the loss normalizer so every replica
  weighs its micro-batches against the global batch.
- **Gradients**: a stage's replicas SUM this step's gradients in DDP's buckets during its last backward
  (``ranks.bucketed``, armed by ``Reduction.before_last``; a later stage over ``bucket_later_above`` bytes);
  else (ties, merged weights) one async flat SUM per dtype after it. Earlier steps' gradients
  stay accumulated.
- **Sharding** (``shard``, after ``start``): this stage's layers sharded by FSDP2 over its
  data-parallel group (``ranks.stageshard``); their gradients are reduce-scattered by FSDP2 at the
  same moment, the rest (ties, the model's own tensors) all-reduced as above.

Usage (an executor does this)::

    ranks = RankStage(model, mesh, info, stages=len(groups))
    keep = ranks.find_ties(layers, groups); ...; ranks.start()
    ranks.shard([(name, layers[name]) for name in groups[ranks.stage]])   # pipeline x sharded only
    with ranks.reducing() as reduction:
        ...; reduction.finished(loss)          # after this rank's last backward
    total = reduction.total                      # the step's loss over replicas (None without)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from ..executor import Executor
from ..losscheck import LossChecks
from ..lossweights import LossSpec
from .bucketed import Bucketed
from .devicemesh import derived_group, job_mesh, sub_mesh
from .env import RankInfo
from .fingerprint import batch_fingerprint
from .mesh import Mesh
from .stageshard import StageShards, resolve_together
from .together import every_rank

__all__ = ["RankStage"]


def _meta_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


class RankStage:
    """This rank's stage of a ``mesh.replicas`` x ``mesh.stages`` mesh (see the module docstring).

    ``comm``: the device collectives run on (this rank's GPU under nccl, else the CPU); ``device_mesh``: the
    job's mesh (a user's ``span(mesh=)``, else built here; ``settings.mesh``); ``pipe_group``/``stage_group``:
    this replica's pipeline and this stage's replicas (``None`` without replicas), groups of its sub-meshes.
    """

    bucketed: bool = True  # replicas reduce in DDP's buckets during the last backward where it applies
    # a later stage buckets over this many bytes of gradients: below, DDP's 1 and 25 MiB buckets are all
    # ready only as its backward ends, so bucketing only delays the gradient it sends (RESULTS.md)
    bucket_later_above: int = 26 << 20

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        info: RankInfo,
        stages: int,
        precision: str = "32",
        *,
        settings: Any = None,
        shard: bool = False,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "no process group: call torchspan.init_distributed() before span() in a launched job"
            )
        if precision == "fp16":
            raise ValueError(
                "precision='fp16' across ranks is not supported: each rank's gradient scaler would decide "
                "alone to skip a step on inf and the stages would drift apart; use precision='bf16' (no "
                "scaler needed) or '32'"
            )
        if stages != mesh.stages:
            raise ValueError(
                f"{stages} layer group(s) for pp({mesh.stages}) stages; give one group per stage"
            )
        self.device = info.device
        self.comm = info.device if info.backend and "nccl" in info.backend else torch.device("cpu")
        self.dp_name = "dp_shard" if shard else "dp_replicate"
        self.device_mesh = job_mesh(
            self.comm.type,
            {"pp": mesh.stages, self.dp_name: mesh.replicas},
            keep=("pp",),
            table=mesh.table,
            given=getattr(settings, "mesh", None),
            advice=f"launch {mesh.world_size} processes",
        )  # the job's DeviceMesh (ranks.devicemesh): a user's span(mesh=), else the plan's numbering
        if settings is not None:
            settings.mesh = self.device_mesh
        mesh = Mesh.of(self.device_mesh)
        self.model, self.mesh, self.info = model, mesh, info
        self.replica, self.stage = mesh.coords(info.rank)
        self.dp_mesh = (
            sub_mesh(self.device_mesh, self.dp_name) if mesh.replicas > 1 else None
        )  # this stage's replicas
        self.stage_group: Any = self.dp_mesh.get_group() if self.dp_mesh is not None else None
        pp = sub_mesh(self.device_mesh, "pp")
        self.pipe_group: Any = pp.get_group() if pp is not None else None  # this replica's pipeline
        self._tie_stages: list[tuple[int, ...]] = []
        self._tie_of: dict[int, int] = {}  # id(tied parameter this stage holds) -> index of its tie group
        self._tie_groups: list[tuple[Any, int]] = []  # (group, its lowest rank)
        self._batch_checked: Any = None  # (structure, its hash) of the last batch checked in the pipeline
        self.shards: StageShards | None = None  # this stage's FSDP2 units (pipeline x sharded), by shard()
        self._buckets: Bucketed | None = None  # DDP's reducer over the replicated parameters (ranks.bucketed)

    @property
    def last(self) -> bool:
        """Whether this rank holds the last stage (where the loss is taken)."""
        return self.stage == self.mesh.stages - 1

    def rank_of(self, stage: int) -> int:
        """The rank holding ``stage`` in this rank's replica."""
        return self.mesh.rank(self.replica, stage)

    # ------------------------------------------------------------------ placement
    def find_ties(self, layers: Mapping[str, nn.Module], groups: Sequence[Sequence[str]]) -> set[int]:
        """Find parameters shared across stages (before any is made meta); returns the ids of every
        tensor this stage's layers hold (kept real)."""
        holders: dict[int, set[int]] = {}
        for s, group in enumerate(groups):
            for name in group:
                for p in layers[name].parameters():
                    holders.setdefault(id(p), set()).add(s)
        local = {
            id(t)
            for name in groups[self.stage]
            for t in [*layers[name].parameters(), *layers[name].buffers()]
        }
        self._tie_stages = sorted({tuple(sorted(st)) for st in holders.values() if len(st) > 1})
        self._tie_of = {}
        for pid, st in holders.items():
            if len(st) > 1 and pid in local:
                self._tie_of[pid] = self._tie_stages.index(tuple(sorted(st)))
        return local

    @staticmethod
    def to_meta(module: nn.Module, keep: set[int], only: str | None = None) -> None:
        """Tensors of ``module`` (or only its attribute ``only``) not in ``keep`` become frozen meta
        copies."""
        for mod in module.modules() if only is None else [module]:
            for key, p in list(mod._parameters.items()):
                if (
                    p is not None
                    and id(p) not in keep
                    and (only is None or key == only)
                    and p.device.type != "meta"
                ):
                    mod._parameters[key] = nn.Parameter(_meta_copy(p), requires_grad=False)
            for key, b in list(mod._buffers.items()):
                if b is not None and id(b) not in keep and (only is None or key == only):
                    mod._buffers[key] = _meta_copy(b)

    def roots_to_meta(self, root_attrs: Mapping[str, int], keep: set[int]) -> None:
        """The model's own tensors read by other stages become meta."""
        for qname, s in root_attrs.items():
            if s != self.stage:
                path, _, attr = qname.rpartition(".")
                self.to_meta(self.model.get_submodule(path) if path else self.model, keep, only=attr)

    def local_parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters (its stage's, tied ones included), in model order."""
        return [p for p in self.model.parameters() if p.device.type != "meta" and p.requires_grad]

    # ------------------------------------------------------------------ groups and start
    def start(self) -> None:
        """Make the tie groups (all ranks, one order: collective; the stage and pipeline groups are the
        mesh's) and start identical: replicas of a stage and tied copies are broadcast from the lowest holding
        rank."""
        for (
            stages
        ) in self._tie_stages:  # not a sub-mesh: those stages' ranks in every replica (ranks.devicemesh)
            group, ranks = derived_group(self.device_mesh, "pp", stages)
            self._tie_groups.append((group, ranks[0]))
        with torch.no_grad():
            if self.stage_group is not None:
                src = self.mesh.rank(0, self.stage)
                for t in [*self.model.parameters(), *self.model.buffers()]:
                    if t.device.type != "meta" and id(t) not in self._tie_of:
                        self._broadcast(t, src, self.stage_group)
            for p in self.model.parameters():
                i = self._tie_of.get(id(p))
                if i is not None:
                    group, src = self._tie_groups[i]
                    self._broadcast(p, src, group)

    def shard(self, layers: Sequence[tuple[str, nn.Module]], reshard_after_forward: bool = True) -> None:
        """After ``start``: this stage's ``layers`` (``(name, module)``) sharded by FSDP2 over its
        data-parallel group (``ranks.stageshard``); a layer holding a parameter tied across stages stays
        replicated."""
        if self.stage_group is None:
            raise ValueError(
                f"shard=True with pp({self.mesh.stages}) x dp({self.mesh.replicas}): each stage has one "
                "rank, so there is nothing to shard it over; launch replicas x stages processes (e.g. 4 "
                "for 2 stages x 2 replicas) or pipeline without shard=True"
            )
        self.shards = StageShards(
            self.model,
            layers,
            self.dp_mesh,
            self.device,
            tied=set(self._tie_of),
            reshard_after_forward=reshard_after_forward,
        )

    def state_dict(self, **options: Any) -> Any:
        """The model's state dict as this rank holds it (other stages' entries ``meta``); sharded entries as
        full tensors (gathered in the stage's group: every rank calls it)."""
        if self.shards is None:
            return self.model.state_dict(**options)
        if options.get("keep_vars"):
            raise ValueError(
                "keep_vars=True would return the sharded parameters; use "
                "spanned.module.state_dict(keep_vars=True)"
            )
        return self.shards.full_state(self.model.state_dict(**options))

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load the model's own keys; a sharded entry given as a full tensor keeps this rank's shard of it."""
        if self.shards is None:
            return self.model.load_state_dict(state_dict, strict=strict)
        return self.shards.load_full(self.model, state_dict, strict=strict)

    def _broadcast(self, t: torch.Tensor, src: int, group: Any) -> None:
        buf = t.detach().to(self.comm)
        dist.broadcast(buf, src=src, group=group)
        if buf is not t:
            t.detach().copy_(buf)

    # ------------------------------------------------------------------ steps
    def check_same_batch(self, chunks: Sequence[Any], targets: Sequence[Any], transport: Any = None) -> None:
        """Every rank of a pipeline must be given the same batch (its replica's shard): a rank's stage reads
        its own copy of the inputs (and the last stage its targets). Checked on every training step: each
        rank's ``batch_fingerprint`` (structure, and integer sums of the values' bits, plain and
        position-weighted) is all-gathered in the pipeline (3 integers per rank); a rank given other data
        raises ``ValueError`` on every rank of the pipeline, before any gradient reaches ``.grad``.

        Without ``transport`` the verdict is waited for here, before any compute. With the step's
        ``RankTransport`` the all-gather runs while the stage computes and the verdict is its ``gate``:
        waited for before this rank's first send or receive, so no rank has sent or received anything
        of a refused step (its channels stay consistent) and the check costs no rendezvous of its own
        (the first stage may have run its first micro-batch's forward: random state and BatchNorm
        statistics advanced, nothing else).
        """
        mine, self._batch_checked = batch_fingerprint((list(chunks), list(targets)), self._batch_checked)
        mine = mine.to(self.comm)
        views = [torch.empty_like(mine) for _ in range(self.mesh.stages)]
        work = dist.all_gather(views, mine, group=self.pipe_group, async_op=transport is not None)

        def verdict() -> None:
            if work is not None:
                work.wait()
            other = [s for s, v in enumerate(views) if not torch.equal(v, views[0])]
            if other:  # every rank of the pipeline sees the same fingerprints: every rank raises this
                ranks = [self.mesh.rank(self.replica, s) for s in other]
                raise every_rank(
                    ValueError(
                        f"rank(s) {ranks} of pipeline replica {self.replica} were given another batch than "
                        f"rank {self.mesh.rank(self.replica, 0)}: every rank of a pipeline must call "
                        "train_step with the same batch (with replicas, its replica's shard: "
                        f"torchspan.shard_batch(batch, rank // {self.mesh.stages}, {self.mesh.replicas})); "
                        "seed the data the same on every rank of a pipeline"
                    )
                )

        if transport is None:
            verdict()
        else:
            transport.gate = verdict

    def shared_outputs(self, outs: list[Any] | None) -> list[Any]:
        """The last stage's outputs (``outs`` there, ignored elsewhere) on every rank of this pipeline, on
        this rank's device."""
        last = self.rank_of(self.mesh.stages - 1)
        box = [outs if self.info.rank == last else None]
        dist.broadcast_object_list(box, src=last, group=self.pipe_group, device=self.comm)
        return [
            tree_map(lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, o)
            for o in box[0] or []
        ]

    def shared_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's ``loss`` (a scalar there, ignored elsewhere) on every rank of this pipeline,
        float32."""
        box = loss.detach().reshape(1).to(self.comm, torch.float64)
        dist.broadcast(box, src=self.rank_of(self.mesh.stages - 1), group=self.pipe_group)
        return box[0].to(self.device, torch.float32)

    def weights(self, spec: LossSpec, targets: Sequence[Any], sizes: Sequence[int]) -> list[float]:
        """Micro-batch weights against the global batch. Only the last stages weigh losses: they all-reduce
        their normalizers among themselves (the other stages start their forward at once)."""
        if self.mesh.replicas == 1 or spec.kind == "sum" or not self.last:
            return spec.weights(targets, sizes)
        local = sum(spec.normalizer(t, n) for t, n in zip(targets, sizes))
        total = torch.tensor([local], dtype=torch.float64, device=self.comm)
        dist.all_reduce(total, group=self.stage_group)
        return spec.weights(targets, sizes, total=float(total.item()))

    @contextmanager
    def reducing(self) -> Iterator[Reduction]:
        """Around one training step: yields the step's ``Reduction`` (call ``finished(loss)`` once this rank's
        last backward ran). Only this step's gradients are reduced; on exit they are settled and earlier
        steps' gradients added back."""
        params = self.local_parameters()
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        reduction = Reduction(self, params)
        if self.shards is not None:
            self.shards.begin()  # backwards accumulate; Reduction.finished reduce-scatters once
        try:
            yield reduction
            reduction.settle()
        except BaseException:
            if self.shards is not None:
                self.shards.abandon()
            if reduction.buckets is not None:  # the reducer may be mid-step: a fresh one next step
                self.drop_buckets()
            raise
        finally:
            for p, g in zip(params, earlier):
                if g is not None:
                    p.grad = g if p.grad is None else g.add_(p.grad)

    def buckets_for(self, params: list[nn.Parameter]) -> Bucketed | None:
        """DDP's reducer over ``params``' replicated ones (not tied, not sharded) in this stage's replica
        group, made once; ``None`` where the flat reduction stays (no replicas, sharded, tensor-parallel)."""
        if not self.bucketed or self.stage_group is None or self.shards is not None:
            return None
        mine = [p for p in params if id(p) not in self._tie_of]
        if not mine or self.comm.type != self.device.type or any(isinstance(p, DTensor) for p in mine):
            return None  # tensor-parallel stages (DTensors) keep the flat reduction
        if self.stage > 0 and sum(p.numel() * p.element_size() for p in mine) <= self.bucket_later_above:
            return None
        if self._buckets is None or [id(p) for p in self._buckets.params] != [id(p) for p in mine]:
            self.drop_buckets()
            self._buckets = Bucketed(mine, self.stage_group)
        return self._buckets

    def drop_buckets(self) -> None:
        """Forget the reducer (after a failed step, or a changed set of parameters)."""
        if self._buckets is not None:
            self._buckets.close()
            self._buckets = None

    def launch(self, params: list[nn.Parameter], group: Any) -> list[tuple[Any, Any]]:
        """Start SUMs of ``params``' gradients over ``group``: one flat buffer per dtype (a missing grad
        counts as 0)."""
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        out = []
        for ps in by_dtype.values():
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps]
            ).to(self.comm)

            def unpack(ps: list[nn.Parameter] = ps, flat: torch.Tensor = flat) -> None:
                k = 0
                for p in ps:
                    g = flat[k : k + p.numel()].view_as(p).to(p.device)
                    k += p.numel()
                    if p.grad is not None or bool(g.any()):  # a gradient no replica produced stays None
                        p.grad = g

            out.append((dist.all_reduce(flat, group=group, async_op=True), unpack))
        return out

    def norm_parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters that count in a norm over its pipeline, each once: a parameter
        tied across stages counts on the lowest stage holding it (``runtime.gradients``)."""
        return [
            p
            for p in self.local_parameters()
            if id(p) not in self._tie_of or self.stage == self._tie_stages[self._tie_of[id(p)]][0]
        ]


class Reduction:
    """One step's gradient reductions on this rank: started by ``finished``, settled when the step ends.

    ``total``: the step's loss summed over the replicas of the last stage (float64, shape ``(1,)``),
    once settled; ``None`` without replicas."""

    def __init__(self, ranks: RankStage, params: list[nn.Parameter]) -> None:
        self.ranks, self.params = ranks, params
        self.total: torch.Tensor | None = None
        self.buckets: Bucketed | None = None  # armed by before_last
        self._launched: list[tuple[Any, Any]] = []

    def before_last(self, outputs: Sequence[torch.Tensor]) -> None:
        """Right before this rank's last backward of the step (from ``outputs``, maybe none; one stage per
        rank): its replicated gradients are then reduced in DDP's buckets during it (``ranks.bucketed``)."""
        buckets = self.ranks.buckets_for(self.params)  # the same answer on every replica of the stage
        if buckets is not None:
            buckets.prepare(outputs)
            self.buckets = buckets

    def finished(self, loss: torch.Tensor) -> None:
        """This rank ran its last backward (``loss``: its summed loss): start the SUMs in every group."""
        r = self.ranks
        if r.stage_group is not None:
            if self.buckets is not None:  # the loss summed in the reducer's last bucket
                self.total = self.buckets.done(loss)
            else:
                total = loss.detach().to(torch.float64).reshape(1).to(r.comm)
                self._launched.append((dist.all_reduce(total, group=r.stage_group, async_op=True), None))
                self.total = total
            done = set(map(id, self.buckets.params)) if self.buckets is not None else set()
            replicated = [
                p
                for p in self.params
                if id(p) not in r._tie_of
                and id(p) not in done
                and not (r.shards is not None and r.shards.holds(p))
            ]
            self._launched.extend(r.launch(replicated, r.stage_group))
        for i, (group, _) in enumerate(r._tie_groups):
            self._launched.extend(r.launch([p for p in self.params if r._tie_of.get(id(p)) == i], group))
        if r.shards is not None:  # FSDP2 units: one reduce-scatter each, while the all-reduces above run
            r.shards.reduce()

    def settle(self) -> None:
        """Wait for the SUMs of this step's gradients and the replicas' losses, and unpack them."""
        for handle, unpack in self._launched:
            handle.wait()
            if unpack is not None:
                unpack()
        self._launched = []


class StageExecutor(Executor):
    """An executor whose rank holds one pipeline stage (``self.ranks``, a ``RankStage``): the loss weights, a
    sharded stage's loss calibration and the state dict are the stage's. ``RankPipelineExecutor`` (stage
    functions) and ``RankOwnForwardExecutor`` (the model's own forward) build on it."""

    ranks: RankStage

    def weights(self, spec: LossSpec, targets: Sequence[Any], sizes: Sequence[int]) -> list[float]:
        return self.ranks.weights(spec, targets, sizes)

    def replica_of(self) -> tuple[int, int]:
        return self.ranks.replica, self.ranks.mesh.replicas

    def plain_forward(self, training: bool) -> None:
        """A pipeline across ranks cannot run its schedule from a plain ``loss.backward()``: refused in
        training."""
        if training and torch.is_grad_enabled() and self.ranks.mesh.stages > 1:
            raise RuntimeError(
                f"spanned(...) in training on a pipeline across ranks (pp({self.ranks.mesh.stages}), this "
                f"rank holds stage {self.ranks.stage}): a plain loss.backward() cannot run the pipeline's "
                "schedule, so its gradients would not be one device's. Train with loss = "
                "spanned.train_step(inputs, target, loss_fn) (or spanned.train_step(batch) for a model's "
                "own loss) on every rank; for evaluation call spanned(...) under torch.no_grad() or after "
                "spanned.eval()"
            )

    def resolve_loss(
        self,
        checks: LossChecks,
        spec: LossSpec,
        targets: Sequence[Any],
        sizes: Sequence[int],
        dry_outputs: Callable[[], Sequence[Any]],
        target: Any = None,
    ) -> LossSpec:
        """As for the hybrid; sharded, a calibration's dry forward runs on every rank when any rank needs
        one."""
        if self.ranks.shards is None:
            return super().resolve_loss(checks, spec, targets, sizes, dry_outputs, target)
        return resolve_together(checks, spec, targets, sizes, dry_outputs, target, self.ranks.comm)

    def state_dict(self, module: nn.Module, **options: Any) -> Any:
        return self.ranks.state_dict(**options)

    def load_state_dict(self, module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        return self.ranks.load_state_dict(state_dict, strict=strict)

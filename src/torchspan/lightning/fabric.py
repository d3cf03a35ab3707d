"""``SpanFabricStrategy``: ``lightning.fabric.Fabric(strategy=SpanFabricStrategy(**span_kwargs))`` on
``torchspan.span``.

``fabric.setup(model, optimizer)`` returns the model spanned (``torchspan.span(model, **span_kwargs)``:
replicas under a launcher, ``shard=True`` sharded, ``devices=[...]`` a local pipeline in one process and
launched a pipeline across ranks: the loss applied to its outputs runs the step, ``fabric.backward`` adds its
gradients, as under ``SpanStrategy``: ``lightning.staged``). ``fabric.backward(loss)`` is the plain loop,
exact on replicas; ``fabric.clip_gradients`` clips by the whole model's norm; ``fabric.save``/``fabric.load``
hold the model's own keys as full tensors (a pipeline's: every stage's, and every stage's optimizer state). A
DataLoader given to ``fabric.setup_dataloaders`` yields this rank's rows of each global batch (its
``batch_size`` is the global batch; ``shard_batch``, never padded; a pipeline's stages its replica's rows);
pass an evaluation loader without it to evaluate whole batches on every rank.

Usage::

    fabric = Fabric(strategy=SpanFabricStrategy(), accelerator="cpu")
    fabric.launch()
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters()))
    for x, y in fabric.setup_dataloaders(loader):
        optimizer.zero_grad(); fabric.backward(criterion(model(x), y)); optimizer.step()
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.ranks import shard_batch
from . import core, staged

try:
    from lightning.fabric.strategies import ParallelStrategy
    from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    _MISSING: ImportError | None = None
except ImportError as exc:
    ParallelStrategy = object  # type: ignore[assignment,misc]
    _MISSING = exc

__all__ = ["SpanFabricStrategy", "RankRows"]


class RankRows:
    """A DataLoader whose every batch is cut to this process's rows (``torchspan.shard_batch``): its rank's,
    or on a pipeline across ranks its replica's (``cut``, read when each batch comes: the model may be set up
    later)."""

    def __init__(self, loader: Any, cut: Any = None) -> None:
        self.loader = loader
        self.cut = cut or core.rows

    def __iter__(self) -> Iterator[Any]:
        return (self.cut(batch) for batch in self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


class SpanFabricStrategy(core.Placement, ParallelStrategy):  # type: ignore[misc,valid-type]
    """A Fabric ``Strategy`` that spans the model given to ``fabric.setup`` with ``torchspan.span(model,
    **span_kwargs)``.

    ``timeout``: seconds a collective waits (``torchspan.init_distributed``); every other keyword is
    ``torchspan.span``'s, an unknown one a ``ValueError`` here. ``spanned``: the last model set up.
    """

    def __init__(
        self,
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        timeout: float | None = None,
        **span_kwargs: Any,
    ) -> None:
        if _MISSING is not None:
            from .trainer import NEEDS_LIGHTNING

            raise ImportError(NEEDS_LIGHTNING) from _MISSING
        core.check_span_kwargs("SpanFabricStrategy", span_kwargs)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision_plugin,
        )
        self.span_kwargs = dict(span_kwargs)
        self._timeout = timeout
        self._num_nodes = 1
        self.spanned: Any = None

    @property
    def distributed_sampler_kwargs(self) -> None:  # type: ignore[override]
        return None  # no DistributedSampler (it pads by repeats): process_dataloader cuts rows instead

    def _set_world_ranks(self) -> None:
        env = self.cluster_environment
        if env is not None:
            launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
            env.set_global_rank(
                int(os.environ["RANK"]) if launched else self.node_rank * self.num_processes + self.local_rank
            )
            env.set_world_size(
                int(os.environ["WORLD_SIZE"]) if launched else self.num_nodes * self.num_processes
            )
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _configure_launcher(self) -> None:
        env = self.cluster_environment
        if (
            env is not None
            and not env.creates_processes_externally
            and self.num_processes * self.num_nodes > 1
        ):
            self._launcher = _SubprocessScriptLauncher(env, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        core.check_precision(
            "SpanFabricStrategy", getattr(self.precision, "precision", "32-true"), "Fabric precision"
        )
        self._set_world_ranks()
        core.join_job(self.global_rank, self.world_size, self.local_rank, self._timeout)
        core.check_devices("SpanFabricStrategy", self.num_processes * self.num_nodes, "Fabric")
        super().setup_environment()

    # ------------------------------------------------------------------ model, optimizers, data
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Any], scheduler: Any = None
    ) -> Any:
        names = {id(p): n for n, p in module.named_parameters()}
        spanned = self.setup_module(module)
        for optimizer in optimizers:  # a sharded span replaced the parameters the optimizer was built with
            core.swap_parameters(optimizer, names, spanned.module)
        return spanned, optimizers, scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        self.spanned = core.span_module(module, dict(self.span_kwargs), "SpanFabricStrategy")
        if core.rank_pipeline(
            self.spanned
        ):  # the loss on its outputs runs the step, fabric.backward adds its gradients
            staged.defer_training(self.spanned)
        return self.spanned

    def module_to_device(self, module: nn.Module) -> None:
        if core.spanned_in(module) is None:
            module.to(self.root_device)

    def process_dataloader(self, dataloader: Any) -> Any:
        return RankRows(dataloader, self._rows) if core.world() > 1 else dataloader

    def _rows(self, batch: Any) -> Any:
        if not core.rank_pipeline(self.spanned):
            return core.rows(batch)
        replica, replicas = self.spanned.data_parallel
        return shard_batch(batch, replica, replicas) if replicas > 1 else batch

    def clip_gradients_norm(
        self,
        module: Any,
        optimizer: Any,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        spanned = core.spanned_in(module) or self.spanned
        return spanned.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # ------------------------------------------------------------------ checkpoints
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        spanned = core.spanned_in(module)
        state = (spanned or module).state_dict()
        return staged.gathered_state(state) if core.rank_pipeline(spanned) else state

    def load_module_state_dict(
        self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True
    ) -> None:
        spanned = core.spanned_in(module)
        (spanned or module).load_state_dict(state_dict, strict=strict)

    def get_optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "optimizer", optimizer)
        if core.rank_pipeline(self.spanned):
            return staged.gathered_optimizer_state(optimizer)
        return core.full_optimizer_state(self.spanned, optimizer)

    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: Any = None
    ) -> dict[str, Any]:
        """Fabric's, with a sharded optimizer's full state loaded into each rank's shard, a pipeline's into
        each rank's stage."""
        pipeline = core.rank_pipeline(self.spanned)
        sharded = self.spanned is not None and self.spanned.mode == "sharded"
        if not (isinstance(state, dict) and (sharded or pipeline)):
            return super().load_checkpoint(path, state, strict, weights_only=weights_only)
        optimizers = {
            k: v for k, v in state.items() if isinstance(getattr(v, "optimizer", v), torch.optim.Optimizer)
        }
        rest = super().load_checkpoint(
            path, {k: v for k, v in state.items() if k not in optimizers}, False, weights_only
        )
        for key, opt in optimizers.items():
            if pipeline:
                staged.local_optimizer_state(getattr(opt, "optimizer", opt), rest.pop(key))
            else:
                core.load_full_optimizer_state(self.spanned, getattr(opt, "optimizer", opt), rest.pop(key))
        return rest

    def teardown(self) -> None:
        if (
            self.cluster_environment is not None and not dist.is_initialized()
        ):  # it unsets WORLD_SIZE: the job goes on
            self.cluster_environment.teardown()
        super().teardown()

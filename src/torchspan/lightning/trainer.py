"""``SpanStrategy``: ``lightning.pytorch.Trainer(strategy=SpanStrategy(**span_kwargs))`` trains on
``torchspan.span``.

The LightningModule's module that holds every trainable parameter (``self.model``) is replaced by
``torchspan.span(self.model, **span_kwargs)`` at setup, so ``self.criterion(self(x), y)`` in ``training_step``
runs the span and its outputs keep the plain loop's contract (``runtime.ranks.plainloop``): the gradients of
one device on the whole global batch.

- One process: ``SpanStrategy(devices=["cpu", "cpu"], microbatches=4)`` is a local pipeline (plain autograd).
- Launched (``torchspan launch --nproc-per-node 2 train.py``, torchrun, or Lightning's own launcher with
  ``Trainer(devices=2)``): ``SpanStrategy()`` is one exact data-parallel replica per process,
  ``SpanStrategy(shard=True)`` a sharded one (FSDP2), ``SpanStrategy(devices=["cpu", "cpu"], microbatches=4)``
  a pipeline across ranks (with replicas when the job has more ranks than stages): ``training_step``'s loss
  runs its schedule and ``loss.backward()`` adds the step's gradients (``lightning.staged``,
  ``lightning.deferred``).
- Data: the DataLoader's ``batch_size`` is the global batch, as on one device; each training batch is cut to
  this rank's rows (``shard_batch``: uneven, never padded; a pipeline's stages take their replica's rows);
  validation, test and predict run whole batches on every rank, so what they log and return is one device's.
- ``gradient_clip_val`` clips by the whole model's norm (``spanned.clip_grad_norm_``); checkpoints hold the
  model's own keys as full tensors (sharded: optimizer state too, keyed by parameter name; a pipeline across
  ranks: every stage's weights and optimizer state, gathered); fp16 is refused.

Usage::

    trainer = L.Trainer(strategy=SpanStrategy(), accelerator="cpu", devices="auto", max_epochs=3)
    trainer.fit(lit_module, DataLoader(dataset, batch_size=64))
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..runtime.ranks import shard_batch
from . import core, staged
from .modules import inner, load_around, module_path, move_around, swap_in

try:
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available
    from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    _MISSING: ImportError | None = None
except (
    ImportError
) as exc:  # torchspan without the lightning extra: the class exists, building it says what to install
    ParallelStrategy = object  # type: ignore[assignment,misc]
    _MISSING = exc

__all__ = ["SpanStrategy"]

NEEDS_LIGHTNING = "torchspan.lightning needs Lightning: pip install 'torchspan[lightning]' (lightning>=2.2)"


class SpanStrategy(core.Placement, ParallelStrategy):  # type: ignore[misc,valid-type]
    """A Lightning ``Strategy`` that trains the LightningModule's model with ``torchspan.span(model,
    **span_kwargs)``.

    ``module``: the LightningModule's attribute to span (dotted; default: the one child holding every
    trainable parameter). ``timeout``: seconds a collective waits (``torchspan.init_distributed``). Every
    other keyword is ``torchspan.span``'s (``devices=``, ``balance=``, ``microbatches=``, ``schedule=``,
    ``shard=``, ...); an unknown one is a ``ValueError`` here. ``spanned`` is the ``Spanned`` once the Trainer
    has set up.
    """

    def __init__(
        self,
        module: str | None = None,
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
            raise ImportError(NEEDS_LIGHTNING) from _MISSING
        core.check_span_kwargs("SpanStrategy", span_kwargs)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.span_kwargs = dict(span_kwargs)
        self._module_name = module
        self._path: str | None = None
        self._timeout = timeout
        self._num_nodes = 1
        self.spanned: Any = None

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel replicas (a pipeline's stages read the same rows); the strategy itself cuts rows,
        unpadded."""
        if core.rank_pipeline(self.spanned):
            replica, replicas = self.spanned.data_parallel
            return {"num_replicas": replicas, "rank": replica}
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
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
            "SpanStrategy", getattr(self.precision_plugin, "precision", "32-true"), "Trainer precision"
        )
        core.join_job(self.global_rank, self.world_size, self.local_rank, self._timeout)
        core.check_devices("SpanStrategy", self.num_processes * self.num_nodes)
        super().setup_environment()

    # ------------------------------------------------------------------ the model
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._span()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._clip_with_span()
        if fitting and len(set(self.spanned.devices)) == 1:
            _optimizers_to_device(self.optimizers, self.root_device)
        if (
            self.spanned.mode == "sharded"
        ):  # FSDP2 under inference_mode: pytorch/pytorch#95957, as Lightning's FSDP
            for loop in (
                trainer.fit_loop.epoch_loop.val_loop,
                trainer.validate_loop,
                trainer.test_loop,
                trainer.predict_loop,
            ):
                loop.inference_mode = False

    def _span(self) -> None:
        lm = self.lightning_module
        found = core.spanned_in(lm)
        if found is not None and found is self.spanned:  # a later fit/validate/test of the same module
            return
        self._path = module_path(lm, "SpanStrategy", self._module_name)
        kwargs = dict(self.span_kwargs)
        staged_ = (
            core.world() == 1 or core.stages_asked(kwargs) > 1
        )  # stages in threads or other ranks' steps
        if (
            getattr(self.precision_plugin, "precision", "") == "bf16-mixed"
            and staged_
            and not kwargs.get("shard")
        ):
            kwargs.setdefault("precision", "bf16")  # each stage autocasts itself
        self.spanned = core.span_module(inner(lm, self._path), kwargs, "SpanStrategy")
        swap_in(lm, self._path, self.spanned)
        if core.rank_pipeline(
            self.spanned
        ):  # training_step's loss runs the pipeline's step (lightning.staged)
            staged.defer_training(self.spanned)

    def _clip_with_span(self) -> None:
        """Lightning's ``gradient_clip_val`` (norm) clips by the whole model's norm, as one device would."""
        if self._precision_plugin is None:
            self._precision_plugin = Precision()
        spanned = self.spanned

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            spanned.clip_grad_norm_(clip_val)

        self._precision_plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    def model_to_device(self) -> None:
        assert self.model is not None
        spanned = core.spanned_in(self.model)
        if spanned is None:
            self.model.to(self.root_device)
        else:
            move_around(self.model, spanned, self.root_device)

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Training batches: this rank's rows of the global batch; evaluation batches: whole, on every
        rank."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.training:
            batch = self._rows(batch)
        return super().batch_to_device(batch, device, dataloader_idx)

    def _rows(self, batch: Any) -> Any:
        """This process's rows: its replica's (every stage of a pipeline across ranks the same), else its
        rank's."""
        if not core.rank_pipeline(self.spanned):
            return core.rows(batch)
        replica, replicas = self.spanned.data_parallel
        return shard_batch(batch, replica, replicas) if replicas > 1 else batch

    # ------------------------------------------------------------------ collectives
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
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
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The LightningModule's state dict; a pipeline across ranks: every stage's weights (a collective)."""
        state = super().lightning_module_state_dict()
        return staged.gathered_state(state) if core.rank_pipeline(self.spanned) else state

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if core.rank_pipeline(self.spanned):
            return staged.gathered_optimizer_state(optimizer)
        return core.full_optimizer_state(self.spanned, optimizer)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            if core.rank_pipeline(self.spanned):
                staged.local_optimizer_state(optimizer, state)
            else:
                core.load_full_optimizer_state(self.spanned, optimizer, state)
            if len(set(self.spanned.devices)) == 1 and self.spanned.mode != "sharded":
                _optimizer_to_device(optimizer, self.root_device)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        lm = self.lightning_module
        if self.spanned is None or core.spanned_in(lm) is not self.spanned or self._path is None:
            lm.load_state_dict(checkpoint["state_dict"], strict=strict)  # before setup: the plain module
            return
        load_around(lm, self._path, self.spanned, dict(checkpoint["state_dict"]), strict)

    def teardown(self) -> None:
        """As Lightning's, without moving the model to the CPU (torchspan owns the span's placement)."""
        if (
            self.cluster_environment is not None and not dist.is_initialized()
        ):  # it unsets WORLD_SIZE: the job goes on
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

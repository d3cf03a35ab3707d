"""The executor interface: what runs a ``Spanned``'s forward and training steps on its stages.

``Spanned`` (the façade) validates arguments, opens and closes each step (timeline, activation
meter) and gathers outputs; an executor owns placement and execution. ``runtime.choose`` is the one
place that picks one. In one process (``runtime.local``): ``PipelinedExecutor`` (stage functions
from an ``nn.Sequential`` or an fx split, run by the threaded ``Pipeline``), ``OwnForwardExecutor``
(the model's own forward, micro-batches pipelined by threads) and ``SerialExecutor`` (the same,
micro-batches one after another). Across processes (``runtime.ranks``): ``RankPipelineExecutor``,
``RankOwnForwardExecutor`` and ``ReplicaExecutor``, the same methods.

Usage (``Spanned`` does this)::

    work = executor.prepare(args, kwargs)          # micro-batch chunks (+ stage functions)
    executor.place(work)                           # placement that needs an input, once
    outputs = executor.forward(work)               # one output per micro-batch
    loss = executor.train(work, targets, loss_fn, weights, spec)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .losscheck import LossChecks
from .lossweights import LossSpec

__all__ = ["Executor", "Settings", "Work"]


@dataclass
class Settings:
    """How a ``Spanned`` runs its steps, validated by ``span``; ``scaler`` is the fp16 gradient scaler (else
    None)."""

    microbatches: int
    schedule: str
    recompute: str
    precision: str
    workers: str = "device"
    scaler: Any = None
    nonfinite: str = "raise"  # train_step on an inf/NaN loss: "raise" or "warn" (runtime.nonfinite)
    loss_reduction: str | None = (
        None  # the plain loop's declared loss on replicas: None (read it), "mean", "sum"
    )
    tp: Any = None  # (tp, tp_plan) of a pipeline of tensor-parallel stages (runtime.ranks.tpstages)
    mesh: Any = (
        None  # the DeviceMesh the span's parallel dimensions live on (tensor parallel: its "tp" dimension)
    )


@dataclass
class Work:
    """One call's inputs as an executor runs them.

    ``chunks``: per micro-batch, what the first stage receives (an argument list for stage
    functions; an ``(args, kwargs)`` pair where the model's own forward runs). ``fns``: the
    stage functions this call runs, or ``None`` where the model's own forward runs.
    """

    chunks: list[Any]
    fns: list[Callable[..., Any]] | None = None


class Executor(ABC):
    """Runs micro-batches over stages ``devices[s]`` holding layers ``groups[s]``.

    ``root_attrs`` maps each parameter or buffer the model owns directly (not through a layer) to
    its stage, once placed. ``groups`` may change until the first ``place`` (an order that
    only a recording forward can find).
    """

    # how it runs the model: "sequential", "fx", "own-forward", "own-forward-serial", "data-parallel",
    # "sharded"
    mode: str
    empty_batches = (
        False  # True where a batch of zero rows is a valid step (a data-parallel rank's empty shard)
    )
    shards_batch = (
        False  # True where this process's batch is one shard of a larger one (data-parallel replicas)
    )

    def __init__(self, devices: Sequence[torch.device], groups: Sequence[Sequence[str]]) -> None:
        self.devices = list(devices)
        self.groups = [list(g) for g in groups]
        self.root_attrs: dict[str, int] = {}

    @property
    def stage_of(self) -> dict[str, int]:
        """Layer name → stage index."""
        return {name: s for s, g in enumerate(self.groups) for name in g}

    @abstractmethod
    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
        """Check the inputs and split them into micro-batches (raises ``TypeError``/``ValueError`` on bad
        ones)."""

    def place(self, work: Work) -> None:
        """Placement that needs an example input (runs before the step opens); default: already placed."""

    def placed_layers(self) -> Mapping[str, nn.Module] | None:
        """Layer name -> module where the layers are blocks (the own-forward executors); ``None``: top-level
        children."""
        return None

    def resolve_loss(
        self,
        checks: LossChecks,
        spec: LossSpec,
        targets: Sequence[Any],
        sizes: Sequence[int],
        dry_outputs: Callable[[], Sequence[Any]],
        target: Any = None,
    ) -> LossSpec:
        """``spec`` made exact for this batch: an opaque loss calibrated on ``dry_outputs()`` (see
        ``losscheck``)."""
        return checks.resolve(spec, targets, sizes, dry_outputs, target=target, shards=self.shards_batch)

    def join(self, optimizer: torch.optim.Optimizer | None = None) -> int:
        """End-of-epoch join of a data-parallel rank; in one process there is no other rank to wait for (0
        steps)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"join() is not supported by a {self.mode!r} executor across ranks: give every rank the "
                "same number of steps (torchspan.runtime.ranks.rank_batches splits each global batch over "
                "the ranks, empty shards included)"
            )
        return 0

    def state_dict(self, module: nn.Module, **options: Any) -> Any:
        """``module``'s state dict as one device would hold it (a sharded replica gathers full tensors)."""
        return module.state_dict(**options)

    def load_state_dict(self, module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load the model's own keys into ``module`` as placed (a sharded replica keeps its shards)."""
        return module.load_state_dict(state_dict, strict=strict)

    def meters(self) -> bool:
        """Whether the coming step counts saved activations (the façade resets the meter's peak only then).

        Local executors count every step; a data-parallel replica only until one step has saved some
        (its shards repeat that shape; the saved-tensor hooks cost ~10% of a small MLP's step,
        benchmarks/RESULTS.md).
        """
        return True

    def weights(self, spec: LossSpec, targets: Sequence[Any], sizes: Sequence[int]) -> list[float]:
        """Each micro-batch's loss weight; an executor whose batch is part of a larger one passes
        ``total=``."""
        return spec.weights(targets, sizes)

    def replica_of(self) -> tuple[int, int]:
        """``(replica index, replicas)`` of this process: one process is one replica."""
        return 0, 1

    def plain_forward(self, training: bool) -> None:
        """Before ``spanned(...)``: refuse a forward whose plain ``loss.backward()`` could not be exact (a
        pipeline across ranks in training); in one process autograd runs the backward across devices
        exactly."""

    def plain_output(
        self, out: Any, kwargs: dict[str, Any], nonfinite: Callable[[torch.Tensor], None]
    ) -> Any:
        """What ``spanned(...)`` hands the user's own loop; in one process the outputs as they are."""
        return out

    @abstractmethod
    def forward(self, work: Work) -> list[Any]:
        """Forward of every micro-batch, autograd kept; one output per micro-batch."""

    @abstractmethod
    def train(
        self,
        work: Work,
        targets: Sequence[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        weights: Sequence[float],
        spec: LossSpec | None = None,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch; ``weights[i]`` scales micro-batch ``i``'s loss
        (``spec``: the loss contract they came from, for executors whose shard is part of a larger batch).

        Returns the summed weighted loss (detached) on the last stage's device.
        """

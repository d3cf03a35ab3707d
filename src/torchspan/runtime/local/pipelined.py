"""The pipelined executor: stage functions on local devices, run by the threaded ``Pipeline``.

Stage functions come from an ``nn.Sequential`` (``mode="sequential"``) or an fx split
(``mode="fx"``): ``StageFunctions``. Every stage's layers are placed on its device in this process.

Usage (``Spanned`` does this)::

    ex = PipelinedExecutor(model, "fx", graph, devices, groups, settings, recorder, meter)
    loss = ex.train(ex.prepare((x,), {}), targets, loss_fn, weights, spec)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..executor import Executor, Settings, Work
from ..lossweights import LossSpec
from ..memory import ActivationMeter
from ..placement import check_shared, place
from ..record import Recorder
from .looped import LoopedPipeline
from .stagefns import StageFunctions
from .worker import worker_groups

__all__ = ["PipelinedExecutor", "stage_functions"]


def stage_functions(work: Work) -> list[Callable[..., Any]]:
    """The stage functions a ``StageFunctions.prepare`` put in ``work`` (``ValueError`` for other work)."""
    if work.fns is None:
        raise ValueError(
            "work.fns is None: this Work was not made by PipelinedExecutor.prepare; call prepare(args, "
            "kwargs) first"
        )
    return work.fns


class PipelinedExecutor(Executor):
    """``mode`` ``"sequential"`` or ``"fx"``; places the model on construction."""

    def __init__(
        self,
        model: nn.Module,
        mode: str,
        graph: Any,
        devices: Sequence[torch.device],
        groups: Sequence[Sequence[str]],
        settings: Settings,
        recorder: Recorder,
        meter: ActivationMeter,
    ) -> None:
        if mode not in ("sequential", "fx"):
            raise ValueError(
                f"mode={mode!r} is not a pipelined mode; use 'sequential' or 'fx' (the model's own forward "
                "is OwnForwardExecutor)"
            )
        super().__init__(devices, groups)
        self.mode = mode
        self.model = model
        self.settings = settings
        self.fns = StageFunctions(model, mode, self.groups)
        per_stage = settings.workers == "stage"
        self._pipeline = LoopedPipeline(
            self.devices,
            recompute=settings.recompute,
            precision=settings.precision,
            recorder=recorder,
            meter=meter,
            groups=worker_groups(self.devices, per_stage) if per_stage else None,
        )
        check_shared(model, self.stage_of)
        self.fns.split(graph, self._put)

    def _put(self, root_attrs: dict[str, int]) -> None:
        """Every stage's layers on its device; the model's own tensors on the stage that first reads them."""
        self.root_attrs = dict(root_attrs)
        place(self.model, self.stage_of, self.devices, self.root_attrs)

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
        return self.fns.prepare(args, kwargs, self.settings.microbatches)

    def forward(self, work: Work) -> list[Any]:
        return self._pipeline.forward(
            stage_functions(work), work.chunks, self.fns.buffers(self.root_attrs, self.settings.recompute)
        )

    def train(
        self,
        work: Work,
        targets: Sequence[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        weights: Sequence[float],
        spec: LossSpec | None = None,
    ) -> torch.Tensor:
        s = self.settings
        buffers = self.fns.buffers(self.root_attrs, s.recompute)
        return self._pipeline.train(
            stage_functions(work), work.chunks, targets, loss_fn, weights, s.schedule, s.scaler, buffers
        )

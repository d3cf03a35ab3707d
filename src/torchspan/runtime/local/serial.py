"""The serial own-forward executor: each layer on its device, the model's own forward run unchanged.

For models ``torch.fx`` cannot trace when threads cannot pipeline them (one stage, one micro-batch,
or recompute with a GPU stage): ``PlacedModel``'s hooks move each layer's inputs to its device and
micro-batches run one after another (``mode="own-forward-serial"``: no pipelining).

Usage (``span`` does this)::

    ex = SerialExecutor(model, devices, groups, settings, recorder, meter, balance_given=True)
    work = ex.prepare((x,), {}); ex.place(work); loss = ex.train(work, targets, loss_fn, weights, spec)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ...hardware import to_device
from ..executor import Executor, Settings, Work
from ..layercall import autocast_for, recomputes
from ..lossweights import LossSpec, weighted_loss
from ..memory import ActivationMeter
from ..record import Recorder
from .placed import PlacedModel

__all__ = ["SerialExecutor"]


class SerialExecutor(Executor):
    """A ``PlacedModel`` run one micro-batch after another (options: as ``OwnForwardLayers``)."""

    mode = "own-forward-serial"

    def __init__(
        self,
        model: nn.Module,
        devices: Sequence[torch.device],
        groups: Sequence[Sequence[str]],
        settings: Settings,
        recorder: Recorder,
        meter: ActivationMeter,
        **options: Any,
    ) -> None:
        self.model, self.settings = model, settings
        self.placed = PlacedModel(model, devices, groups, settings, recorder, meter, **options)
        self.placed.place_now()

    @property
    def devices(self) -> list[torch.device]:  # type: ignore[override]
        return self.placed.devices

    @property
    def groups(self) -> list[list[str]]:  # type: ignore[override]
        return self.placed.groups

    @property
    def root_attrs(self) -> dict[str, int]:  # type: ignore[override]
        return self.placed.root_attrs

    def placed_layers(self) -> Mapping[str, nn.Module] | None:
        return self.placed.layers

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
        return self.placed.prepare(args, kwargs)

    def place(self, work: Work) -> None:
        self.placed.place(work)

    def forward(self, work: Work) -> list[Any]:
        hooks, m = self.placed.hooks, self.settings.microbatches
        outs = []
        for i, (a, k) in enumerate(work.chunks):
            a, k = self.placed.to_first_stage(a, k)
            with hooks.recording(i, recomputes(self.settings.recompute, i, m)):
                outs.append(self.model(*a, **k))
        self.placed.check_order()
        return outs

    def train(
        self,
        work: Work,
        targets: Sequence[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        weights: Sequence[float],
        spec: LossSpec | None = None,
    ) -> torch.Tensor:
        hooks = self.placed.hooks
        s, last = self.settings, self.devices[-1]
        losses = []
        for i, (a, k) in enumerate(work.chunks):
            a, k = self.placed.to_first_stage(a, k)
            with hooks.recording(i, recomputes(s.recompute, i, s.microbatches)):
                out = self.model(*a, **k)
            self.placed.check_order()
            leaf = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
            dev = leaf.device if leaf is not None else last
            with autocast_for(dev, s.precision):
                loss = weighted_loss(loss_fn, out, to_device(targets[i], dev), weights[i])
            hooks.backward(i, s.scaler.scale(loss) if s.scaler is not None else loss)
            losses.append(loss.detach().to(last).float())
        return torch.stack(losses).sum()

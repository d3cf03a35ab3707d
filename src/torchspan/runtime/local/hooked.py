"""The hooked executor: each layer on its device, the model's own forward run unchanged.

For models ``torch.fx`` cannot trace. ``HookPlacement``'s pre-hooks move each layer's inputs to its
device; micro-batches run one after another (no pipelining). When a balance was given (the
execution order is then unknown) or the model owns tensors directly on several devices, the first
call's recording forward finds the order and where those tensors are first read, then places.

Usage (``Spanned`` does this)::

    ex = HookedExecutor(model, devices, groups, settings, recorder, meter, balance_given=True)
    work = ex.prepare((x,), {}); ex.place(work); loss = ex.train(work, targets, loss_fn, weights)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ...hardware import to_device
from ...layers import LayerSet, buffer_slots, kept, model_layers
from ..executor import Executor, Settings, Work
from ..lossweights import weighted_loss
from ..memory import ActivationMeter
from ..microbatch import split_batch
from ..placement import check_shared, even_balance, place, stages_from_balance
from ..ties import TiedCopies
from ..record import Recorder
from .hooks import HookPlacement
from .pipeline import autocast_for, checkpointed

__all__ = ["HookedExecutor"]


class HookedExecutor(Executor):
    """Hook placement over ``layers`` (the façade's ``model_layers(model)``).

    ``balance_given``: the groups are counts over an order the first call records (an even split
    is redone over the recorded layers when ``even``); otherwise they come from a plan, whose
    layer names and order the recording checks. ``split_points``/``no_split``: as ``find_layers``.
    """

    mode = "hooks"

    def __init__(
        self,
        model: nn.Module,
        devices: Sequence[torch.device],
        groups: Sequence[Sequence[str]],
        settings: Settings,
        recorder: Recorder,
        meter: ActivationMeter,
        *,
        balance_given: bool,
        layers: LayerSet | None = None,
        even: bool = False,
        split_points: Any = None,
        no_split: Any = None,
    ) -> None:
        super().__init__(devices, groups)
        self.model = model
        self.settings = settings
        self.recorder = recorder
        self.meter = meter
        self.hooks: HookPlacement | None = None
        self.copies: TiedCopies | None = None
        self._options = (split_points, no_split)
        self.layer_set = layers if layers is not None else model_layers(model, split_points=split_points, no_split=no_split)
        self.layers = {layer.name: layer.module for layer in self.layer_set}
        self._even = even
        self._lazy_balance = balance_given and len(self.devices) > 1
        self._order_checked = False
        self._blocks = any("." in name for name in self.layers) or bool(split_points or no_split)
        check_shared(model, self.stage_of, self.layers, self.devices)
        # Tensors held outside every layer go where the forward first reads them, and blocks are
        # confirmed (merged, skipped, ordered) by a recording forward: both wait for the first call.
        multi = len(set(self.devices)) > 1
        if not (self._lazy_balance or (self.layer_set.roots and multi) or self._blocks):
            self._place({})

    def _place(self, root_attrs: dict[str, int]) -> None:
        stage_of = self.stage_of
        check_shared(self.model, stage_of, self.layers, self.devices)
        self.root_attrs = dict(root_attrs)
        roots = [r.name for r in self.layer_set.roots]
        self.copies = place(self.model, stage_of, self.devices, self.root_attrs, self.layers, roots)
        self.hooks = HookPlacement(
            self.model, stage_of, self.devices, self.recorder, self.meter, self.settings.precision, self.layers, self.copies
        )
        self.hooks.install()

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
        return Work(split_batch(args, kwargs, self.settings.microbatches))

    def place(self, work: Work) -> None:
        """One recording forward finds the execution order (to apply a balance) and where the model's
        own parameters are first read (they are placed on that stage), then places."""
        if self.hooks is not None:
            return
        first_args, first_kwargs = work.chunks[0]
        split_points, no_split = self._options
        # The recording forward must leave no trace: BatchNorm statistics, counters and the random
        # state (dropout masks of the real step) stay as they were.
        cuda = sorted({d.index if d.index is not None else 0 for d in self.devices if d.type == "cuda"})
        with torch.random.fork_rng(devices=cuda), kept(buffer_slots([self.model])):
            found = model_layers(self.model, tuple(first_args), dict(first_kwargs), split_points=split_points, no_split=no_split)
        order = found.names()
        if self._lazy_balance:
            counts = even_balance(len(order), len(self.devices)) if self._even else [len(g) for g in self.groups]
            self.groups = stages_from_balance(order, self.devices, counts)
        else:
            self._check_planned(order)
        self.layer_set = found
        self.layers = {layer.name: layer.module for layer in found}
        self._order_checked = True
        stage_of = self.stage_of
        self._place({r.name: stage_of.get(r.reader, 0) if r.reader else 0 for r in found.roots})

    def _check_planned(self, order: list[str]) -> None:
        """The planned groups name exactly the recorded layers, in execution order."""
        planned = [n for g in self.groups for n in g]
        if set(planned) != set(order):
            extra = [n for n in planned if n not in order]
            missing = [n for n in order if n not in planned]
            raise ValueError(
                f"the plan's layers are not this model's: it places {extra or 'no'} unknown layer(s) and leaves "
                f"{missing or 'none'} out (the model's layers, in execution order: {', '.join(order)}). "
                "Re-plan for this model with the same inputs: torchspan.plan(model, example_inputs, ...)"
            )
        for i, (want, got) in enumerate(zip(order, planned)):
            if want != got:
                raise ValueError(
                    f"the placement puts layer {got!r} at position {i}, but the model runs {want!r} there "
                    f"(execution order: {', '.join(order)}); stages must follow execution order. "
                    "Re-plan with torchspan.plan(model, x, ...) or pass devices and balance"
                )

    def _placed_hooks(self) -> HookPlacement:
        if self.hooks is None:
            raise RuntimeError("HookedExecutor ran before it was placed; call place(work) with the prepared work first")
        return self.hooks

    def _check_order(self) -> None:
        hooks = self._placed_hooks()
        if self._order_checked or not hooks.order:
            return
        planned = [n for g in self.groups for n in g if n in hooks.order]
        for i, (want, got) in enumerate(zip(hooks.order, planned)):
            if want != got:
                raise ValueError(
                    f"the placement puts layer {got!r} at position {i}, but the model runs {want!r} there "
                    f"(execution order: {', '.join(hooks.order)}); stages must follow execution order. "
                    "Re-plan with torchspan.plan(model, x, ...) or pass devices and balance"
                )
        self._order_checked = True

    def _to_first_stage(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Inputs go to stage 0's device before the model's own forward touches them (its code may
        use them before calling the first layer, e.g. ``x + self.shift``)."""
        dev = self.devices[0]
        return to_device((args, kwargs), dev, non_blocking=dev.type == "cuda")

    def forward(self, work: Work) -> list[Any]:
        hooks = self._placed_hooks()
        m = self.settings.microbatches
        outs = []
        for i, (a, k) in enumerate(work.chunks):
            a, k = self._to_first_stage(a, k)
            with hooks.recording(i, checkpointed(self.settings.checkpoint, i, m)):
                outs.append(self.model(*a, **k))
        self._check_order()
        return outs

    def train(
        self,
        work: Work,
        targets: Sequence[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        weights: Sequence[float],
    ) -> torch.Tensor:
        hooks = self._placed_hooks()
        s, last = self.settings, self.devices[-1]
        losses = []
        for i, (a, k) in enumerate(work.chunks):
            a, k = self._to_first_stage(a, k)
            with hooks.recording(i, checkpointed(s.checkpoint, i, s.microbatches)):
                out = self.model(*a, **k)
            self._check_order()
            leaf = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
            dev = leaf.device if leaf is not None else last
            with autocast_for(dev, s.precision):
                loss = weighted_loss(loss_fn, out, to_device(targets[i], dev), weights[i])
            hooks.backward(i, s.scaler.scale(loss) if s.scaler is not None else loss)
            losses.append(loss.detach().to(last).float())
        return torch.stack(losses).sum()

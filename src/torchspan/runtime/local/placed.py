"""A model that runs its own forward: its layers, their stages, and where they are placed.

For models that are neither an ``nn.Sequential`` nor fx-traceable (every transformers model). The
executors that run such a model's own forward hold these objects instead of inheriting them:

- ``OwnForwardLayers``: the layers (``torchspan.layers.model_layers``: blocks by qualified name)
  and, when the stages are counts over an order not known yet (a ``balance``), blocks to confirm,
  or model-owned tensors on several devices, the recording forward of the first call that finds
  the execution order and where those tensors are first read. Held by every own-forward executor
  (in one process and across ranks).
- ``PlacedModel``: those layers moved to their stages' devices, tied parameters kept one
  (``TiedCopies``), and ``HookPlacement``'s hooks moving each layer's inputs to its device. Held by
  the executors of one process (``SerialExecutor``, ``OwnForwardExecutor``).

Usage (an executor does this)::

    placed = PlacedModel(model, devices, groups, settings, recorder, meter, balance_given=True)
    work = placed.prepare((x,), {}); placed.place(work)    # records once, then places
    with placed.hooks.recording(mb, recompute=False): out = model(*args)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...hardware import to_device
from ...layers import LayerSet, buffer_slots, kept, model_layers
from ...profiler.sizing import meta_forward, on_meta
from ..executor import Settings, Work
from ..memory import ActivationMeter
from ..microbatch import split_batch
from ..placement import check_calls, check_shared, even_balance, place, stages_from_balance
from ..record import Recorder
from ..ties import TiedCopies
from .hooks import HookPlacement

__all__ = ["OwnForwardLayers", "PlacedModel", "to_first_stage"]


def to_first_stage(
    device: torch.device, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Inputs on stage 0's device before the model's own forward touches them (its code may use them
    before calling the first layer, e.g. ``x + self.shift``)."""
    return to_device((args, kwargs), device, non_blocking=device.type == "cuda")


def _check_order(groups: Sequence[Sequence[str]], order: Sequence[str], fix: str) -> None:
    """The placement follows execution order ``order`` (only layers in it are compared)."""
    planned = [n for g in groups for n in g if n in order]
    for i, (want, got) in enumerate(zip(order, planned)):
        if want != got:
            raise ValueError(
                f"the placement puts layer {got!r} at position {i}, but the model runs {want!r} there "
                f"(execution order: {', '.join(order)}); stages must follow execution order. {fix}"
            )


class OwnForwardLayers:
    """The layers of a model run by its own forward (see the module docstring).

    ``balance_given``: the groups are counts over an order the first call records (an even split is
    redone over the recorded layers when ``even``); otherwise they come from a plan, whose layer names
    and order the recording checks. ``split_points``/``no_split``: as ``find_layers``.
    """

    def __init__(
        self,
        model: nn.Module,
        devices: Sequence[torch.device],
        groups: Sequence[Sequence[str]],
        *,
        balance_given: bool,
        layers: LayerSet | None = None,
        even: bool = False,
        split_points: Any = None,
        no_split: Any = None,
    ) -> None:
        self.model = model
        self.options = (split_points, no_split)
        self.layer_set = (
            layers
            if layers is not None
            else model_layers(model, split_points=split_points, no_split=no_split)
        )
        self.layers = {layer.name: layer.module for layer in self.layer_set}
        self.even = even
        self.balance_given = balance_given  # groups are counts over the order the first call records
        self.lazy_balance = balance_given and len(devices) > 1
        blocks = any("." in name for name in self.layers) or bool(split_points or no_split)
        # Tensors held outside every layer go where the forward first reads them, and blocks are confirmed
        # (merged, skipped, ordered) by a recording forward: both wait for the first call.
        self.waits = self.lazy_balance or (bool(self.layer_set.roots) and len(set(devices)) > 1) or blocks
        self.order_checked = False

    def record(
        self, work: Work, devices: Sequence[torch.device], groups: Sequence[Sequence[str]]
    ) -> tuple[list[list[str]], dict[str, int]]:
        """One recording forward of the first micro-batch (leaving no trace: BatchNorm statistics, counters
        and the random state stay as they were) finds the layers in execution order; returns the stages'
        layer groups (a balance applied to that order, or the plan's, checked) and each model-owned
        tensor's stage (where the forward first reads it)."""
        first_args, first_kwargs = work.chunks[0]
        split_points, no_split = self.options
        cuda = sorted({d.index if d.index is not None else 0 for d in devices if d.type == "cuda"})
        if on_meta(
            self.model
        ):  # built on meta (span(..., weights=)): recorded on meta inputs under FakeTensorMode
            first_args, first_kwargs = to_device((first_args, first_kwargs), torch.device("meta"))
        with torch.random.fork_rng(devices=cuda), kept(buffer_slots([self.model])), meta_forward(self.model):
            found = model_layers(
                self.model,
                tuple(first_args),
                dict(first_kwargs),
                split_points=split_points,
                no_split=no_split,
            )
        order = found.names()
        if self.balance_given:  # one stage too: its layers are simply all of them, in the recorded order
            counts = even_balance(len(order), len(devices)) if self.even else [len(g) for g in groups]
            groups = stages_from_balance(order, devices, counts)
        else:
            self._check_planned(groups, order)
        check_calls(self.model, found, groups)  # a module called more than once: all its calls in one stage
        self.layer_set = found
        self.layers = {layer.name: layer.module for layer in found}
        self.order_checked = True
        stage_of = {name: s for s, g in enumerate(groups) for name in g}
        return [list(g) for g in groups], {
            r.name: stage_of.get(r.reader, 0) if r.reader else 0 for r in found.roots
        }

    @staticmethod
    def _check_planned(groups: Sequence[Sequence[str]], order: list[str]) -> None:
        """The planned groups name exactly the recorded layers, in execution order."""
        planned = [n for g in groups for n in g]
        if set(planned) != set(order):
            extra = [n for n in planned if n not in order]
            missing = [n for n in order if n not in planned]
            raise ValueError(
                f"the plan's layers are not this model's: it places {extra or 'no'} unknown layer(s) and "
                f"leaves {missing or 'none'} out (the model's layers, in execution order: "
                f"{', '.join(order)}). Re-plan for this model with the same inputs: torchspan.plan(model, "
                "example_inputs, ...)"
            )
        _check_order(groups, order, "Re-plan with torchspan.plan(model, x, ...) or pass devices and balance")

    def check_order(self, groups: Sequence[Sequence[str]], order: Sequence[str]) -> None:
        """Once, after the first real forward: the stages follow the execution order it took."""
        if self.order_checked or not order:
            return
        _check_order(groups, order, "Re-plan with torchspan.plan(model, x, ...) or pass devices and balance")
        self.order_checked = True


class PlacedModel:
    """``OwnForwardLayers`` placed on ``devices`` by hooks (see the module docstring).

    ``devices``, ``groups`` and ``root_attrs`` are the executor's; ``on_placed`` callbacks run once the
    hooks are installed (an executor adds its own hooks in front of them there).
    """

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
        self.model, self.settings, self.recorder, self.meter = model, settings, recorder, meter
        self.devices = list(devices)
        self.groups = [list(g) for g in groups]
        self.root_attrs: dict[str, int] = {}
        self.own = OwnForwardLayers(model, self.devices, self.groups, **options)
        self.on_placed: list[Callable[[], None]] = []
        self._hooks: HookPlacement | None = None
        check_shared(model, self.stage_of, self.own.layers, self.devices)

    @property
    def stage_of(self) -> dict[str, int]:
        return {name: s for s, g in enumerate(self.groups) for name in g}

    @property
    def layers(self) -> dict[str, nn.Module]:
        return self.own.layers

    @property
    def hooks(self) -> HookPlacement:
        if self._hooks is None:
            raise RuntimeError(
                "the executor ran before it was placed; call place(work) with the prepared work first"
            )
        return self._hooks

    @property
    def copies(self) -> TiedCopies | None:
        """The tied parameters read on other devices (``None`` until placed)."""
        return self._hooks.copies if self._hooks is not None else None

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
        return Work(split_batch(args, kwargs, self.settings.microbatches))

    def place_now(self) -> None:
        """Place at once when nothing waits for the first call's recording forward."""
        if not self.own.waits:
            self._place({})

    def place(self, work: Work) -> None:
        """Placement, once: after the recording forward where one is needed."""
        if self._hooks is not None:
            return
        self.groups, root_attrs = self.own.record(work, self.devices, self.groups)
        self._place(root_attrs)

    def _place(self, root_attrs: dict[str, int]) -> None:
        stage_of = self.stage_of
        check_shared(self.model, stage_of, self.layers, self.devices)
        self.root_attrs = dict(root_attrs)
        roots = [r.name for r in self.own.layer_set.roots]
        copies = place(self.model, stage_of, self.devices, self.root_attrs, self.layers, roots)
        self._hooks = HookPlacement(
            self.model,
            stage_of,
            self.devices,
            self.recorder,
            self.meter,
            self.settings.precision,
            self.layers,
            copies,
        )
        self._hooks.install()
        for callback in self.on_placed:
            callback()

    def check_order(self) -> None:
        self.own.check_order(self.groups, self.hooks.order)

    def to_first_stage(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return to_first_stage(self.devices[0], args, kwargs)

"""How one layer runs, for every executor: precision, recompute, tied-parameter copies.

Every executor runs a model's layers through this module, so a policy that applies to a layer
call is written once:

- **precision**: ``autocast_for(device, precision)``, bf16/fp16 autocast on the layer's device;
- **recompute** (activation checkpointing): ``recomputes(mode, mb, m)`` says whether micro-batch
  ``mb`` recomputes its forward in backward; a recompute leaves buffers as the real forward left
  them (``once_context``: BatchNorm statistics are updated once);
- **tied parameters**: a layer reading a parameter that lives on another device gets a copy on its
  own device for the call, the recompute included (``runtime.ties.TiedCopies``).

``run_layer`` applies all three to one call; ``LayerCalls`` installs it around the forward of
every layer of a model for one step (the own-forward executors), and stage functions call
``autocast_for``/``recomputes`` themselves (the pipeline recomputes a whole stage).

Usage::

    calls = LayerCalls(layers, stage_of, devices, precision="bf16", copies=copies)
    with calls.installed(recompute=lambda: True):
        out = model(x)                      # each layer autocast on its device, recomputed in backward
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from ..layers import Slot, buffer_slots, kept
from .ties import TiedCopies

__all__ = ["autocast_for", "recomputes", "once_context", "run_layer", "LayerCalls"]


_NOTHING = contextlib.nullcontext()  # reusable: entering it does nothing


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """The autocast context of one stage: none for ``"32"``, bf16/fp16 autocast on its device type."""
    if precision == "32" or device.type == "meta":
        return _NOTHING
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def recomputes(mode: str, mb: int, microbatches: int) -> bool:
    """Whether micro-batch ``mb`` of ``microbatches`` recomputes its forward in backward under ``mode``."""
    return mode == "always" or (mode == "except_last" and mb < microbatches - 1)


def once_context(slots: Sequence[Slot]) -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` for ``torch.utils.checkpoint``: the recompute undoes the buffer updates the forward
    made."""

    def make() -> tuple[Any, Any]:
        return contextlib.nullcontext(), kept(slots)

    return make


def run_layer(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    device: torch.device,
    precision: str,
    recompute: bool,
    slots: Sequence[Slot] = (),
) -> Any:
    """``fn(*args, **kwargs)`` autocast on ``device``; recomputed in backward when ``recompute`` (and grad is
    on)."""
    if precision == "32" and not recompute:  # nothing around the call (the usual case, once per layer call)
        return fn(*args, **kwargs)
    with autocast_for(device, precision):
        if recompute and torch.is_grad_enabled():
            context = once_context(slots)
            return torch.utils.checkpoint.checkpoint(
                fn, *args, use_reentrant=False, context_fn=context, **kwargs
            )
        return fn(*args, **kwargs)


def _swapping(fn: Callable[..., Any], copies: TiedCopies, name: str) -> Callable[..., Any]:
    """``fn`` with layer ``name``'s tied parameters read on its device (a recompute outside the hooks too)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with copies.swapped(name):
            return fn(*args, **kwargs)

    return run


class LayerCalls:
    """The call policy installed around each layer's forward, one step at a time.

    ``layers``: name -> module; only those in ``stage_of`` run here, on ``devices[stage_of[name]]``.
    ``copies``: the placement's ``TiedCopies`` (tied parameters living on another device).
    """

    def __init__(
        self,
        layers: Mapping[str, nn.Module],
        stage_of: Mapping[str, int],
        devices: Sequence[torch.device],
        precision: str,
        copies: TiedCopies | None = None,
    ) -> None:
        self.layers = {name: mod for name, mod in layers.items() if name in stage_of}
        self.devices = {name: devices[stage_of[name]] for name in self.layers}
        self.precision = precision
        self.copies = copies

    def wrap(self, name: str, fn: Callable[..., Any], recompute: Callable[[], bool]) -> Callable[..., Any]:
        """``fn`` (layer ``name``'s forward) run by the policy; ``recompute()`` is asked at each call."""
        if self.copies is not None and name in self.copies.remote:
            fn = _swapping(fn, self.copies, name)
        device, precision = self.devices[name], self.precision
        slots = buffer_slots([self.layers[name]])

        def forward(*args: Any, **kwargs: Any) -> Any:
            return run_layer(
                fn, args, kwargs, device=device, precision=precision, recompute=recompute(), slots=slots
            )

        return forward

    @contextlib.contextmanager
    def installed(self, recompute: Callable[[], bool], *, may_recompute: bool = True) -> Iterator[None]:
        """Every layer's forward wrapped for the duration; nothing is wrapped when the policy is a no-op
        (``precision="32"`` and no recompute possible: ``may_recompute=False``)."""
        if self.precision == "32" and not may_recompute:
            yield
            return
        done: list[tuple[nn.Module, Any]] = []
        for name, module in self.layers.items():
            had = module.__dict__.get("forward")
            module.forward = self.wrap(name, module.forward, recompute)  # type: ignore[method-assign]
            done.append((module, had))
        try:
            yield
        finally:
            for module, had in done:
                if had is None:
                    del module.forward
                else:  # pragma: no cover - a layer with its own instance-level forward
                    module.forward = had

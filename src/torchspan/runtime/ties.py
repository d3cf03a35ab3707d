"""Tied parameters across devices: one logical parameter, however many stages use it.

A parameter shared by layers on two stages (GPT-2's ``transformer.wte.weight`` is
``lm_head.weight``) lives once, on the device of the first layer (in execution order) that holds
it. The optimizer sees that original ``nn.Parameter`` only (``model.parameters()`` yields it once)
and ``state_dict`` keeps every key the model's own has (tied keys included, same tensor). A
layer on another device gets ``original.to(its device)`` in place of the parameter for the
duration of its forward (and of a recompute, through ``swapped``): autograd sums the
gradient of every use into the one parameter exactly, and there are no copies that could drift.
On stages that share a device nothing is copied.

Usage (``placement.place`` does this)::

    copies = TiedCopies(layers, stage_of, devices); copies.install()
    with copies.swapped("lm_head"): out = model.lm_head(h)      # a recompute outside the hooks
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["Hook", "TiedCopies"]


def _inert(*_args: Any, **_kwargs: Any) -> None:
    """What a torchspan hook becomes in a pickled or deep-copied model: nothing."""
    return None


def _inert_hook() -> Any:
    return _inert


class Hook:
    """A hook that does not travel: ``torch.save(spanned.module)`` and ``copy.deepcopy`` give a plain
    model."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> Any:
        return (_inert_hook, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _inert


class TiedCopies:
    """For each layer, the parameters inside it that live on another device (tied ones, once placed)."""

    def __init__(
        self, layers: Mapping[str, nn.Module], stage_of: Mapping[str, int], devices: Sequence[torch.device]
    ) -> None:
        self.devices = {name: devices[stage_of[name]] for name in layers if name in stage_of}
        self.layers = dict(layers)
        self.remote: dict[str, list[tuple[nn.Module, str, nn.Parameter]]] = {}
        for name, dev in self.devices.items():
            found = []
            for sub in self.layers[name].modules():
                for attr, p in sub._parameters.items():
                    if p is not None and p.device != dev:
                        found.append((sub, attr, p))
            if found:
                self.remote[name] = found
        self._handles: list[Any] = []
        self._depth: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.remote)

    def names(self) -> list[str]:
        """Layers that read a parameter living on another device."""
        return list(self.remote)

    def _enter(self, name: str) -> None:
        depth = self._depth.get(name, 0)
        self._depth[name] = depth + 1
        if depth == 0:
            dev = self.devices[name]
            for sub, attr, p in self.remote[name]:
                # a differentiable copy, for this call
                sub._parameters[attr] = p.to(dev)  # type: ignore[assignment]

    def _exit(self, name: str) -> None:
        self._depth[name] -= 1
        if self._depth[name] == 0:
            for sub, attr, p in self.remote[name]:
                sub._parameters[attr] = p

    @contextlib.contextmanager
    def swapped(self, name: str) -> Iterator[None]:
        """Layer ``name``'s remote parameters replaced by copies on its device (nothing if it has none)."""
        if name not in self.remote:
            yield
            return
        self._enter(name)
        try:
            yield
        finally:
            self._exit(name)

    def install(self) -> TiedCopies:
        """Swap around every forward of the layers concerned (idempotent); returns ``self``."""
        if self._handles:
            return self
        for name in self.remote:
            mod = self.layers[name]
            self._handles.append(mod.register_forward_pre_hook(Hook(lambda *_a, _n=name: self._enter(_n))))
            self._handles.append(
                mod.register_forward_hook(Hook(lambda *_a, _n=name: self._exit(_n)), always_call=True)
            )
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

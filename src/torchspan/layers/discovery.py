"""Turn a model into ordered layers: the unit that profiling, planning and placement work with.

A *layer* is a top-level child of the model (``model.named_children()``), named by its attribute
name. Layers are ordered by first execution in a recording forward (for ``nn.Sequential``, the
Sequential order). The profiler, the planner and ``span`` all receive their layers from here.

Usage: ``execution_order(model, x)`` → ``["embed", "blocks", "head"]``; ``layer_modules(model)["head"]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["top_level_layers", "layer_modules", "execution_order", "record_forward"]


def top_level_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's top-level children, in registration order. Raises if it has none."""
    children = list(model.named_children())
    if not children:
        raise ValueError(
            f"model ({type(model).__name__}) has no child modules, so there is nothing to place on "
            "separate devices; wrap its pieces in nn.Module attributes or an nn.Sequential"
        )
    return children


def layer_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's layers by name (registration order), as placement, hooks and metering look them up.

    Usage: ``layer_modules(model)["head"]``. Raises like ``top_level_layers`` if there are none.
    """
    return dict(top_level_layers(model))


def execution_order(model: nn.Module, *args: Any, **kwargs: Any) -> list[str]:
    """Names of top-level children in the order a forward with ``args``/``kwargs`` first runs them.

    ``nn.Sequential`` needs no example input. Children that never run in the recording forward
    are appended at the end in registration order (they still own parameters to place).
    """
    children = top_level_layers(model)
    if isinstance(model, nn.Sequential) or (not args and not kwargs):
        return [name for name, _ in children]
    return record_forward(model, args, kwargs)[0]


class _RootUses(TorchFunctionMode):
    """Notes, for each tensor the model owns directly, which child had last started when an op first read it."""

    def __init__(self, owned: dict[int, str], last: list[str | None]) -> None:
        super().__init__()
        self.owned = owned
        self.last = last
        self.uses: dict[str, str | None] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            name = self.owned.get(id(t)) if isinstance(t, torch.Tensor) else None
            if name is not None and name not in self.uses:
                self.uses[name] = self.last[0]
        return func(*args, **kwargs)


def record_forward(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[str], dict[str, str | None]]:
    """One no-grad forward: the children in execution order, and for each parameter or buffer the
    model owns directly, the child that ran last before it was first read (``None``: before any).

    Usage: ``order, uses = record_forward(model, (x,), {})`` → ``["a", "b"], {"scale": "a"}``.
    """
    owned = {id(t): n for n, t in list(model._parameters.items()) + list(model._buffers.items()) if t is not None}
    order: list[str] = []
    last: list[str | None] = [None]
    handles = []
    for name, child in model.named_children():

        def pre(_mod: nn.Module, _inp: Any, _name: str = name) -> None:
            last[0] = _name
            if _name not in order:
                order.append(_name)

        handles.append(child.register_forward_pre_hook(pre))
    watch = _RootUses(owned, last)
    try:
        with torch.no_grad(), watch:
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    order.extend(name for name, _ in model.named_children() if name not in order)
    return order, watch.uses

"""Turn a model into ordered layers: the unit that planning and placement work with.

A *layer* is a top-level child of the model (``model.named_children()``), named by its attribute
name. Layers are ordered by first execution in a recording forward (for ``nn.Sequential``, the
Sequential order). The profiler, the planner and ``span`` all use these same names.

Usage: ``execution_order(model, x)`` → ``["embed", "blocks", "head"]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["top_level_layers", "execution_order"]


def top_level_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's top-level children, in registration order. Raises if it has none."""
    children = list(model.named_children())
    if not children:
        raise ValueError(
            f"model ({type(model).__name__}) has no child modules, so there is nothing to place on "
            "separate devices; wrap its pieces in nn.Module attributes or an nn.Sequential"
        )
    return children


def execution_order(model: nn.Module, *args: Any, **kwargs: Any) -> list[str]:
    """Names of top-level children in the order a forward with ``args``/``kwargs`` first runs them.

    ``nn.Sequential`` needs no example input. Children that never run in the recording forward
    are appended at the end in registration order (they still own parameters to place).
    """
    children = top_level_layers(model)
    if isinstance(model, nn.Sequential) or (not args and not kwargs):
        return [name for name, _ in children]
    order: list[str] = []
    handles = []
    for name, child in children:

        def hook(_mod: nn.Module, _inp: Any, _name: str = name) -> None:
            if _name not in order:
                order.append(_name)

        handles.append(child.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    order.extend(name for name, _ in children if name not in order)
    return order

"""Move nested objects to a device: tensors, containers, dataclasses, modules, optimizer state.

Usage::

    from torchspan import to_device
    batch = to_device({"x": x, "y": [y1, y2]}, "cuda:0")
    to_device(criterion, "cuda")          # a CrossEntropyLoss(weight=...) buffer moves too
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from .device import Device
from .inventory import resolve_device

__all__ = ["to_device"]

T = TypeVar("T")


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _move_tensor(t: torch.Tensor, dev: torch.device, non_blocking: bool) -> torch.Tensor:
    if t.device == dev:
        return t
    if t.is_meta and dev.type != "meta":
        raise ValueError(
            f"cannot move a meta tensor (shape {tuple(t.shape)}, no data) to {dev}; "
            "materialise the module with module.to_empty(device=...) and load its weights instead"
        )
    return t.to(dev, non_blocking=non_blocking)


def _move_optimizer(opt: torch.optim.Optimizer, dev: torch.device, non_blocking: bool) -> None:
    for group in opt.param_groups:
        keep_step_on_host = not (group.get("capturable", False) or group.get("fused", False))
        for p in group["params"]:
            state = opt.state.get(p)
            if not state:
                continue
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor):
                    # PyTorch keeps Adam-style `step` counters on the host unless capturable/fused.
                    if key == "step" and keep_step_on_host:
                        continue
                    state[key] = _move_tensor(value, dev, non_blocking)


def to_device(obj: T, device: str | int | torch.device | Device, non_blocking: bool = False) -> T:
    """Move every tensor inside ``obj`` to ``device``, keeping the structure.

    Handles tensors; dicts, lists, tuples, namedtuples and dataclasses (same type back); ``nn.Module``
    (parameters **and buffers**, in place, returned); ``torch.optim.Optimizer`` state (in place,
    returned). A ``torch.Generator`` on another device is a ``ValueError`` (it cannot move); anything
    else is returned unchanged.

    Usage: ``batch = to_device({"x": x, "y": [y1, y2]}, "cuda:0")``;
    ``to_device(criterion, "cuda")`` moves a ``CrossEntropyLoss(weight=...)`` buffer too.
    """
    if isinstance(device, torch.device) and _already_on(obj, device):  # nothing to move: no resolve, no walk
        return list(obj) if type(obj) is list else obj  # type: ignore[return-value]
    dev = resolve_device(device)
    return _to(obj, dev, non_blocking)


def _already_on(obj: Any, dev: torch.device) -> bool:
    """Whether ``obj`` is a tensor on ``dev``, or a plain list/tuple of them (a micro-batch's usual form)."""
    if isinstance(obj, torch.Tensor):
        return obj.device == dev
    return type(obj) in (list, tuple) and all(isinstance(v, torch.Tensor) and v.device == dev for v in obj)


def _to(obj: Any, dev: torch.device, non_blocking: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        return _move_tensor(obj, dev, non_blocking)
    if isinstance(obj, nn.Module):
        for name, t in list(obj.named_parameters()) + list(obj.named_buffers()):
            if t.is_meta and dev.type != "meta":
                raise ValueError(
                    f"cannot move {type(obj).__name__}: {name!r} is on meta (no data); use "
                    f"module.to_empty(device={str(dev)!r}) and load its weights"
                )
        return obj.to(dev, non_blocking=non_blocking)
    if isinstance(obj, torch.optim.Optimizer):
        _move_optimizer(obj, dev, non_blocking)
        return obj
    if isinstance(obj, (str, bytes)) or obj is None:
        return obj
    if isinstance(obj, torch.Generator):
        if obj.device != dev:
            raise ValueError(
                f"to_device got a torch.Generator on {obj.device}, which cannot move to {dev}: its state "
                "belongs to its device; make one there, e.g. "
                f"torch.Generator(device={str(dev)!r}).manual_seed(seed), and leave the generator out of "
                "what you move"
            )
        return obj
    if _is_namedtuple(obj):
        return type(obj)(*(_to(v, dev, non_blocking) for v in obj))
    if isinstance(obj, tuple):
        return tuple(_to(v, dev, non_blocking) for v in obj)
    if isinstance(obj, list):
        return [_to(v, dev, non_blocking) for v in obj]
    if isinstance(obj, Mapping):
        moved = {k: _to(v, dev, non_blocking) for k, v in obj.items()}
        if type(obj) is dict:
            return moved
        try:
            if hasattr(obj, "default_factory"):
                return type(obj)(obj.default_factory, moved)  # type: ignore[attr-defined]
            return type(obj)(moved)
        except TypeError:
            return moved
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, _to(getattr(obj, f.name), dev, non_blocking))
        return new
    return obj

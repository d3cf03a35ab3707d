"""Optimizer-state bytes per parameter, by optimizer name, class or instance.

The state is sized by running one ``step()`` of the real optimizer class on ``meta`` copies of each
distinct parameter shape: exact for every ``torch.optim`` optimizer (and most custom ones, scalars
such as Adam's ``step`` included) and nothing is allocated. Optimizers whose arithmetic needs data
(``.item()``) still create their state before failing on ``meta``; that state is what is counted.

Usage: ``optimizer_state_bytes(list(nn.Linear(4, 2).parameters()), "adam") == 2 * 40 + 2 * 4``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["OPTIMIZERS", "optimizer_state_bytes"]

OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("", {}),
    "sgd": ("SGD", {}),
    "sgd-momentum": ("SGD", {"momentum": 0.9}),
    "momentum": ("SGD", {"momentum": 0.9}),
    "adam": ("Adam", {}),
    "adamw": ("AdamW", {}),
    "adam-amsgrad": ("Adam", {"amsgrad": True}),
    "adamax": ("Adamax", {}),
    "nadam": ("NAdam", {}),
    "radam": ("RAdam", {}),
    "rmsprop": ("RMSprop", {}),
    "adagrad": ("Adagrad", {}),
    "adadelta": ("Adadelta", {}),
    "rprop": ("Rprop", {}),
    "asgd": ("ASGD", {}),
    "adafactor": ("Adafactor", {}),
}


@dataclass(frozen=True)
class OptimizerSpec:
    label: str
    cls: type[torch.optim.Optimizer] | None
    kwargs: dict[str, Any]
    groups: dict[int, dict[str, Any]] | None  # id(param) -> hyper-parameters, from an instance


def optimizer_spec(optimizer: Any) -> OptimizerSpec:
    if optimizer is None:
        return OptimizerSpec("none", None, {}, None)
    if isinstance(optimizer, str):
        key = optimizer.strip().lower().replace("_", "-").replace(" ", "-")
        if key not in OPTIMIZERS:
            raise ValueError(
                f"optimizer={optimizer!r} is not known; use one of {', '.join(OPTIMIZERS)}, "
                "a torch.optim.Optimizer subclass, or an optimizer instance"
            )
        cls_name, kwargs = OPTIMIZERS[key]
        cls = getattr(torch.optim, cls_name, None) if cls_name else None
        if cls_name and cls is None:
            raise ValueError(
                f"optimizer={optimizer!r} needs torch.optim.{cls_name}, which this PyTorch "
                f"({torch.__version__}) lacks"
            )
        return OptimizerSpec(key, cls, dict(kwargs), None)
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return OptimizerSpec(optimizer.__name__.lower(), optimizer, {}, None)
    if isinstance(optimizer, torch.optim.Optimizer):
        groups: dict[int, dict[str, Any]] = {}
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                groups[id(p)] = hyper
        return OptimizerSpec(type(optimizer).__name__.lower(), type(optimizer), {}, groups)
    raise ValueError(
        f"optimizer={optimizer!r} ({type(optimizer).__name__}) is not an optimizer; use a name "
        f"({', '.join(OPTIMIZERS)}), a torch.optim.Optimizer subclass, or an instance"
    )


def _constructor_kwargs(cls: type, hyper: dict[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(hyper)
    return {k: v for k, v in hyper.items() if k in params}


def _state_bytes_for(
    cls: type[torch.optim.Optimizer], hyper: dict[str, Any], shape: torch.Size, dtype: torch.dtype
) -> int:
    """Bytes of optimizer state one parameter of ``shape``/``dtype`` gets, from a step on ``meta``."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
    p.grad = torch.empty_like(p)
    kwargs = _constructor_kwargs(cls, hyper)
    kwargs.pop("foreach", None)
    kwargs.pop("fused", None)
    try:
        opt = cls([p], **kwargs)
    except Exception as exc:
        raise ValueError(
            f"optimizer {cls.__name__}({kwargs}) could not be built to size its state "
            f"({type(exc).__name__}: {exc}); pass an optimizer name such as 'adam' or 'sgd' instead"
        ) from None
    try:
        opt.step()
    except Exception:
        # Optimizers create their state before the arithmetic; a data-dependent step (.item() on
        # meta) still leaves the state behind, which is all that is needed here.
        pass
    state = opt.state.get(p, {})
    total = 0
    for value in state.values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


def optimizer_state_bytes(
    params: Sequence[nn.Parameter], optimizer: Any = "adam", dtype: torch.dtype | None = None
) -> int:
    """Bytes of optimizer state ``optimizer`` keeps for ``params`` (trainable ones only).

    Usage: ``optimizer_state_bytes(list(nn.Linear(4, 2).parameters()), "adam") == 2 * 40 + 2 * 4``
    (two moments per weight and bias, plus Adam's float32 ``step`` scalar per tensor).
    """
    spec = optimizer_spec(optimizer)
    return sum(param_state_bytes(spec, p, dtype, {}) for p in params)


def param_state_bytes(
    spec: OptimizerSpec, p: torch.Tensor, dtype: torch.dtype | None, cache: dict[Any, int]
) -> int:
    if spec.cls is None or not p.requires_grad:
        return 0
    if spec.groups is not None:
        hyper = spec.groups.get(id(p))
        if hyper is None:
            return 0  # the optimizer instance does not update this parameter
    else:
        hyper = spec.kwargs
    dt = dtype if dtype is not None and p.is_floating_point() else p.dtype
    key = (spec.cls, tuple(sorted((k, repr(v)) for k, v in hyper.items())), tuple(p.shape), dt)
    if key not in cache:
        cache[key] = _state_bytes_for(spec.cls, hyper, p.shape, dt)
    return cache[key]

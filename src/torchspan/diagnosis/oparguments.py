"""An op's tensor arguments as the watcher sees them: walk them, compare their devices, label them.

The two device checks are the watcher's hot path: ``devices_disagree`` only compares devices;
``real_mismatch`` (run only when they differ) forgives CPU 0-dim tensors, which PyTorch accepts
as scalars anywhere, and compares ``_foreach`` lists element by element. ``label_pairs`` names
each tensor by the op's own argument names (``input``, ``weight``, ``tensors[1]``).

Usage: ``if devices_disagree(args, kwargs) and real_mismatch(func, args, kwargs): ...``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .mismatch import base_name, is_cpu_scalar

__all__ = ["iter_tensors", "devices_disagree", "real_mismatch", "arg_names", "label_pairs"]

_Tensor = torch.Tensor
_DOC_SIG = re.compile(r"^\s*\w+\((.*?)\)")


def iter_tensors(args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[tuple[int | str, int, _Tensor]]:
    """``(position or keyword, index in a list or -1, tensor)`` for every tensor argument."""
    for i, a in enumerate(args):
        if isinstance(a, _Tensor):
            yield i, -1, a
        elif type(a) in (list, tuple):
            for j, b in enumerate(a):
                if isinstance(b, _Tensor):
                    yield i, j, b
    for k, v in kwargs.items():
        if isinstance(v, _Tensor):
            yield k, -1, v
        elif type(v) in (list, tuple):
            for j, b in enumerate(v):
                if isinstance(b, _Tensor):
                    yield k, j, b


def devices_disagree(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Fast check: any two tensor arguments on different devices (scalars not excluded yet)."""
    dev = None
    for a in args:
        if isinstance(a, _Tensor):
            d = a.device
            if dev is None:
                dev = d
            elif d != dev:
                return True
        elif type(a) in (list, tuple):
            for b in a:
                if isinstance(b, _Tensor):
                    d = b.device
                    if dev is None:
                        dev = d
                    elif d != dev:
                        return True
    if kwargs:
        for v in kwargs.values():
            if isinstance(v, _Tensor):
                d = v.device
                if dev is None:
                    dev = d
                elif d != dev:
                    return True
    return False


def real_mismatch(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Slow check, run only when devices differ: CPU 0-dim tensors are legal scalars anywhere."""
    if base_name(func).startswith("_foreach"):
        lists = [a for a in list(args) + list(kwargs.values()) if type(a) in (list, tuple)]
        singles = {
            t.device
            for t in list(args) + list(kwargs.values())
            if isinstance(t, _Tensor) and not is_cpu_scalar(t)
        }
        n = max((len(x) for x in lists), default=0)
        for i in range(n):
            devs = set(singles)
            for x in lists:
                if i < len(x) and isinstance(x[i], _Tensor) and not is_cpu_scalar(x[i]):
                    devs.add(x[i].device)
            if len(devs) > 1:
                return True
        return False
    devs = {t.device for _, _, t in iter_tensors(args, kwargs) if not is_cpu_scalar(t)}
    return len(devs) > 1


def arg_names(func: Any) -> list[str]:
    """The op's positional argument names: from its schema, its signature, or its docstring."""
    if isinstance(func, torch._ops.OpOverload):
        return [a.name for a in func._schema.arguments]
    try:
        params = inspect.signature(func).parameters.values()
        return [
            p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
    except (TypeError, ValueError):
        pass
    doc = (getattr(func, "__doc__", None) or "").strip()
    m = _DOC_SIG.match(doc.splitlines()[0]) if doc else None
    names: list[str] = []
    if m:
        for part in m.group(1).split(","):
            part = part.strip()
            if part.startswith("*"):
                break
            names.append(part.split("=", 1)[0].split(":", 1)[0].strip())
    qual = getattr(func, "__qualname__", "")
    if qual.startswith(("TensorBase.", "Tensor.")):
        names.insert(0, "self")
    return names


def label_pairs(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[str, _Tensor]]:
    """``(argument label, tensor)`` for every tensor argument that is not a CPU scalar."""
    names = arg_names(func)
    out: list[tuple[str, _Tensor]] = []
    for key, j, t in iter_tensors(args, kwargs):
        if is_cpu_scalar(t):
            continue
        if isinstance(key, int):
            base = names[key] if key < len(names) else f"arg {key}"
        else:
            base = key
        out.append((f"{base}[{j}]" if j >= 0 else base, t))
    return out

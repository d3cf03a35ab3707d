"""The autograd engine's side of a watched backward: walk its graph, translate its device errors.

Some device errors never reach an op the watcher sees: the engine itself refuses a gradient a
custom ``autograd.Function`` returned on the wrong device, or one a tensor hook changed. Its
message names only a node (``Function MyFn returned an invalid gradient at index 0 ...``);
``engine_error`` turns it into a :class:`DeviceMismatchError` naming the module, the tensor,
the ``backward`` to fix and where it is. ``walk_graph`` gives every node reachable from the
backward's roots with the nearest module whose output it belongs to.

Usage: ``err = engine_error(str(exc), roots, make_namer)`` (None when the text is not a device error).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .mismatch import DeviceMismatchError
from .naming import Namer
from .report import TensorArg
from .tracking import node_module

__all__ = ["walk_graph", "node_module_in", "engine_error"]

_ENGINE_GRAD = re.compile(
    r"Function (\w+) returned an invalid gradient at index (\d+) - expected device (\S+) but got (\S+)"
)
_ENGINE_HOOK = re.compile(r"hook '(.+?)' has changed the type of value \(was (\S+) got (\S+)\)")


def walk_graph(roots: Sequence[Any]) -> Iterator[tuple[Any, nn.Module | None]]:
    """Autograd nodes reachable from ``roots``, each with its own module, else the nearest enclosing one."""
    seen: set[int] = set()
    todo: list[tuple[Any, nn.Module | None]] = [(n, node_module(n)) for n in roots]
    while todo:
        node, mod = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        own = node_module(node) or mod
        yield node, own
        for nxt, _ in getattr(node, "next_functions", ()):
            if nxt is not None:
                todo.append((nxt, node_module(nxt) or own))


def node_module_in(node: Any, roots: Sequence[Any]) -> tuple[nn.Module | None, bool]:
    """``(module, exact)`` for the backward node ``node``: its own module, else the enclosing one found from
    ``roots``."""
    mod = node_module(node)
    if mod is not None:
        return mod, True
    for n, m in walk_graph(roots):
        if n is node:
            return m, False
    return None, False


def _type_to_device(name: str) -> str:
    low = name.lower()
    for dev in ("meta", "cuda", "mps", "xpu"):
        if dev in low:
            return dev
    return "cpu"


def _source_of(func: Callable[..., Any] | None) -> str | None:
    if func is None:
        return None
    try:
        file = inspect.getsourcefile(func)
        _, line = inspect.getsourcelines(func)
    except (OSError, TypeError):
        return None
    return f"{(file or '?').rsplit('/', 1)[-1]}:{line}"


def engine_error(
    text: str, roots: Sequence[Any], make_namer: Callable[[], Namer]
) -> DeviceMismatchError | None:
    """The engine's error ``text`` as a :class:`DeviceMismatchError`, or None when it is not a device error.

    ``make_namer`` is called only for a device error (naming walks the user's frames).
    """
    m = _ENGINE_GRAD.search(text)
    if m:
        return _gradient_error(text, m, roots, make_namer())
    m = _ENGINE_HOOK.search(text)
    if m:
        namer = make_namer()
        hook, was, got = m.group(1), _type_to_device(m.group(2)), _type_to_device(m.group(3))
        return DeviceMismatchError(
            op=f"tensor hook {hook}",
            phase="backward",
            module=None,
            tensors=[
                TensorArg(
                    "returned gradient", got, (), "?", "gradient", None, f"returned by hook {hook}", odd=True
                )
            ],
            expected=was,
            headline=f"the tensor hook {hook} returned a gradient on {got} for a tensor on {was}",
            fix=f"make {hook} return a tensor on the gradient's device: `return new_grad.to(grad.device)`",
            location=namer.location,
            original=text.splitlines()[0],
            code="backward-hook-device",
        )
    return None


def _gradient_error(text: str, m: re.Match[str], roots: Sequence[Any], namer: Namer) -> DeviceMismatchError:
    """A custom Function's ``backward`` returned gradient ``index`` on the wrong device."""
    fname, index, expected, got = m.group(1), int(m.group(2)), m.group(3), m.group(4)
    node, mod = next(((n, md) for n, md in walk_graph(roots) if n.name() == fname), (None, None))
    target = None
    if node is not None and index < len(node.next_functions):
        var = getattr(node.next_functions[index][0], "variable", None)
        if isinstance(var, torch.Tensor):
            named = namer.tensor(var)
            target = named[1] if named else None
    fwd = getattr(type(node), "_forward_cls", None) if node is not None else None
    where = _source_of(getattr(fwd, "backward", None)) if fwd is not None else None
    for_what = f" for {target}" if target else ""
    fix_where = f"{fwd.__name__}.backward" if fwd is not None else f"the backward of {fname}"
    return DeviceMismatchError(
        op=f"{fname} (backward)",
        phase="backward",
        module=f"backward of {fname}" + (f" in {namer.module_label(mod)}" if mod is not None else ""),
        tensors=[
            TensorArg(
                f"grad_input[{index}]", got, (), "?", "gradient", target, f"returned by {fname}", odd=True
            )
        ],
        expected=expected,
        headline=f"{fname} returned gradient {index}{for_what} on {got}, but that input lives on {expected}",
        fix=(
            f"in {fix_where}{' (' + where + ')' if where else ''} create every returned tensor on the "
            f"input's device, e.g. `torch.ones(..., device=grad_output.device)` or "
            f"`result.to(grad_output.device)`"
        ),
        location=namer.location,
        original=text.splitlines()[0],
        code="backward-gradient-device",
    )

"""Know which module is running: a stack kept by global forward hooks.

The forward pre-hook pushes the module, the forward hook (``always_call=True``, so it also runs
when the forward raises) pops it. Module outputs get their autograd node tagged with the module,
so a backward error can say whose backward it is. Each call costs a list push/pop; naming
happens only when something is wrong.

Usage::

    tracker = ModuleTracker()
    tracker.install()
    model(x)              # tracker.current() is the innermost running module during the call
    tracker.uninstall()
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

__all__ = ["ModuleTracker", "NODE_KEY", "node_module"]

NODE_KEY = "torchspan.module"
_Tensor = torch.Tensor


def node_module(node: Any) -> nn.Module | None:
    """The module whose forward produced autograd node ``node`` (when it was a module output)."""
    if node is None:
        return None
    try:
        return node.metadata.get(NODE_KEY)
    except (AttributeError, RuntimeError):
        return None


def _tag(output: Any, module: nn.Module) -> None:
    # Post-hooks run innermost first; setdefault keeps the innermost module for a shared output.
    if isinstance(output, _Tensor):
        gf = output.grad_fn
        if gf is not None:
            gf.metadata.setdefault(NODE_KEY, module)
    elif type(output) in (tuple, list):
        for o in output:
            if isinstance(o, _Tensor):
                gf = o.grad_fn
                if gf is not None:
                    gf.metadata.setdefault(NODE_KEY, module)


class ModuleTracker:
    """The stack of running modules (per thread) and the top-level modules seen.

    ``on_enter(module)`` is called for every module entry; the watcher uses it to check
    ``nn.DataParallel`` wrappers before they copy anything.
    """

    def __init__(self, on_enter: Callable[[nn.Module], None] | None = None) -> None:
        self._main = threading.get_ident()
        self.stack: list[nn.Module] = []
        self._others: dict[int, list[nn.Module]] = {}
        self.roots: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.calls = 0
        self._on_enter = on_enter
        self._handles: list[Any] = []

    def _stack(self) -> list[nn.Module]:
        ident = threading.get_ident()
        if ident == self._main:
            return self.stack
        return self._others.setdefault(ident, [])

    def _pre(self, module: nn.Module, args: Any) -> None:
        stack = self._stack()
        if not stack:
            self.roots.add(module)
        stack.append(module)
        self.calls += 1
        if self._on_enter is not None:
            self._on_enter(module)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        if stack and stack[-1] is module:
            stack.pop()
        else:  # a forward that raised past inner modules, or hooks added mid-call
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is module:
                    del stack[i:]
                    break
        if output is not None:
            _tag(output, module)

    def current(self) -> nn.Module | None:
        """The innermost module running on this thread, or None outside any module."""
        stack = self._stack()
        return stack[-1] if stack else None

    def running(self) -> list[nn.Module]:
        """The modules running on this thread, outermost first."""
        return list(self._stack())

    def install(self) -> None:
        if self._handles:
            return
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]

    def uninstall(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.stack.clear()
        self._others.clear()

"""One recording forward: every module call (who called whom, in what order) and who read each tensor.

``record_calls`` runs the model once under ``torch.no_grad`` with forward pre- and post-hooks on
every module and a ``TorchFunctionMode`` that notes which module call was innermost when each
parameter or buffer of the model was read by an op. The random state is forked and every buffer
is put back afterwards, so the recording changes nothing (dropout masks, BatchNorm statistics).
Layer discovery (``blocks.find_layers``) decides from this trace which modules are layers, and
checks that each runs once, in one piece. Works on a meta-device model with meta inputs too.

Usage: ``trace = record_calls(model, (x,), {})``; ``trace.calls_of(model.head)`` → ``[7]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .slots import buffer_slots, kept

__all__ = ["Call", "Trace", "record_calls"]


@dataclass
class Call:
    """One call of a module: its entry and exit event numbers and the enclosing call (-1: none)."""

    module: nn.Module
    start: int
    end: int
    parent: int


@dataclass
class Trace:
    """Every module call of one forward, and for each tensor of the model the calls that read it.

    ``reads[id(t)]`` holds the innermost open call at each read (-1: read outside every module);
    ``first_read[id(t)]`` is ``(event number, innermost call)`` of its first read.
    """

    calls: list[Call] = field(default_factory=list)
    by_module: dict[int, list[int]] = field(default_factory=dict)
    reads: dict[int, set[int]] = field(default_factory=dict)
    first_read: dict[int, tuple[int, int]] = field(default_factory=dict)

    def calls_of(self, module: nn.Module) -> list[int]:
        """Indices of every call of ``module`` (its own calls nested in itself included)."""
        return self.by_module.get(id(module), [])

    def outer_calls(self, module: nn.Module) -> list[int]:
        """Calls of ``module`` not nested in another call of the same module: how often it *runs*."""
        return [c for c in self.calls_of(module) if not self.inside(c, module, strict=True)]

    def chain(self, call: int) -> list[int]:
        """``call`` and every call enclosing it, innermost first."""
        out = []
        while call >= 0:
            out.append(call)
            call = self.calls[call].parent
        return out

    def inside(self, call: int, module: nn.Module, strict: bool = False) -> bool:
        """Whether ``call`` runs inside a call of ``module`` (``strict``: not counting ``call`` itself)."""
        chain = self.chain(call)
        return any(self.calls[c].module is module for c in (chain[1:] if strict else chain))

    def ran(self, module: nn.Module) -> bool:
        return id(module) in self.by_module


class _Reads(TorchFunctionMode):
    """Notes the innermost open module call whenever an op reads one of the watched tensors."""

    def __init__(self, watched: set[int], trace: Trace, stack: list[int], clock: list[int]) -> None:
        super().__init__()
        self.watched, self.trace, self.stack, self.clock = watched, trace, stack, clock

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and id(t) in self.watched:
                top = self.stack[-1] if self.stack else -1
                self.trace.reads.setdefault(id(t), set()).add(top)
                self.trace.first_read.setdefault(id(t), (self.clock[0], top))
        return func(*args, **kwargs)


def _cuda_devices(model: nn.Module) -> list[int]:
    tensors = list(model.parameters()) + list(model.buffers())
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


def record_calls(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Trace:
    """Run ``model(*args, **kwargs)`` once without gradients and return its ``Trace``.

    The model's random state and buffers are left as they were. Raises whatever the forward raises.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be an nn.Module, got {type(model).__name__}; pass the model object itself"
        )
    trace = Trace()
    stack: list[int] = []
    clock = [0]

    def pre(mod: nn.Module, _inp: Any) -> None:
        clock[0] += 1
        trace.by_module.setdefault(id(mod), []).append(len(trace.calls))
        trace.calls.append(Call(mod, clock[0], -1, stack[-1] if stack else -1))
        stack.append(len(trace.calls) - 1)

    def post(_mod: nn.Module, _inp: Any, _out: Any) -> None:
        clock[0] += 1
        trace.calls[stack.pop()].end = clock[0]

    watched = {id(t) for t in list(model.parameters()) + list(model.buffers())}
    handles = []
    for mod in model.modules():
        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    try:
        with torch.random.fork_rng(devices=_cuda_devices(model)), kept(buffer_slots([model])):
            with torch.no_grad(), _Reads(watched, trace, stack, clock):
                model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return trace

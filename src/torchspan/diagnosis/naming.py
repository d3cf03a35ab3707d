"""Give names to the things behind a device error: modules, parameters, buffers, variables.

All of this is done lazily, only once something is wrong: the watcher's hot path never names
anything. Names come from (in order) the objects the user handed to ``watch``/``doctor``,
variables in the user's own stack frames (``model``, ``criterion``, ``x``), and the modules the
watcher saw running.

Usage::

    namer = Namer({"model": model}, frame=sys._getframe())
    namer.module_label(model.net2)     # "model.net2 (Linear)"
    namer.tensor(model.net2.weight)    # ("parameter", "model.net2.weight")
"""

from __future__ import annotations

import contextlib
import importlib
import linecache
import os
import runpy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import nn

__all__ = [
    "Location",
    "Namer",
    "named_tensors",
    "user_frames",
    "location",
    "op_name",
    "is_internal_file",
    "tb_frames",
    "traceback_frames",
]

_INTERNAL_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (torch, runpy, contextlib, importlib)
    if getattr(m, "__file__", None)
) + (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)
_INTERNAL_FILES = {os.path.abspath(runpy.__file__), os.path.abspath(contextlib.__file__)}


def named_tensors(module: nn.Module, prefix: str) -> list[tuple[str, str, torch.Tensor]]:
    """``(kind, qualified name, tensor)`` for every parameter and buffer of ``module`` (shared ones once)."""
    out: list[tuple[str, str, torch.Tensor]] = []
    for name, p in module.named_parameters():
        out.append(("parameter", f"{prefix}.{name}", p))
    for name, b in module.named_buffers():
        out.append(("buffer", f"{prefix}.{name}", b))
    return out


def is_internal_file(filename: str) -> bool:
    """True for files of PyTorch, torchspan and the standard machinery that runs scripts."""
    path = os.path.abspath(filename)
    return path in _INTERNAL_FILES or path.startswith(_INTERNAL_DIRS) or filename.startswith("<frozen")


def user_frames(frame: FrameType | None) -> list[FrameType]:
    """Frames of the user's code from ``frame`` outwards (innermost first)."""
    out: list[FrameType] = []
    while frame is not None:
        if not is_internal_file(frame.f_code.co_filename):
            out.append(frame)
        frame = frame.f_back
    return out


@dataclass(frozen=True)
class Location:
    """A line of the user's code: ``toy.py:12 in forward: return self.net2(x)``."""

    filename: str
    lineno: int
    function: str
    code: str

    def __str__(self) -> str:
        where = f"{self.short} in {self.function}"
        return f"{where}: {self.code}" if self.code else where

    @property
    def short(self) -> str:
        """``toy.py:12``."""
        return f"{os.path.basename(self.filename)}:{self.lineno}"

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.filename, "line": self.lineno, "function": self.function, "code": self.code}


def location(frame: FrameType) -> Location:
    """The line ``frame`` is running, with its function (``Class.method`` for methods)."""
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    func = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
    self_obj = frame.f_locals.get("self")
    if self_obj is not None and "." not in func and func != "<module>":
        func = f"{type(self_obj).__name__}.{func}"
    return Location(frame.f_code.co_filename, frame.f_lineno, func, code)


def op_name(func: Any) -> str:
    """Readable name of an op: ``torch.nn.functional.linear``, ``Tensor.add``, ``aten.mm.default``."""
    if isinstance(func, torch._ops.OpOverload):
        return str(func)
    name = getattr(func, "__name__", None) or str(func)
    qual = getattr(func, "__qualname__", name)
    if name == "__get__" or name == "__set__":
        owner = getattr(func, "__self__", None)
        return f"Tensor.{getattr(owner, '__name__', 'attribute')}.{name}"
    if getattr(torch.nn.functional, name, None) is func:
        return f"torch.nn.functional.{name}"
    if getattr(torch, name, None) is func:
        return f"torch.{name}"
    if qual.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + qual.split(".", 1)[1]
    module = getattr(func, "__module__", None)
    return f"{module}.{qual}" if module else qual


def _is_named_ok(var: str) -> bool:
    return var != "self" and not var.startswith("_")


class Namer:
    """Lazily built maps from objects to the names a user would recognise.

    ``named``: explicit ``{name: module | optimizer | tensor}``; ``roots``: further modules (e.g.
    those the watcher saw running); ``frame``: where the error happened (its user frames are
    searched for variable names).
    """

    def __init__(
        self,
        named: Mapping[str, Any] | None = None,
        roots: Iterable[nn.Module] = (),
        frame: FrameType | None = None,
    ) -> None:
        self._named = dict(named or {})
        self._extra_roots = [r for r in roots if isinstance(r, nn.Module)]
        self._frames = user_frames(frame)
        self._all_frames_from = frame
        self._modules: dict[int, str] | None = None
        self._tensors: dict[int, tuple[str, str]] = {}
        self._optimizers: list[tuple[str, torch.optim.Optimizer]] = []
        self._variables: dict[int, tuple[str, Location]] | None = None

    # ------------------------------------------------------------------ modules, parameters
    def _root_candidates(self) -> list[tuple[str | None, Any]]:
        out: list[tuple[str | None, Any]] = list(self._named.items())
        # Outermost frames first: the script's `model` beats a helper's `net` or `m`.
        for frame in reversed(self._frames):
            for var, val in list(frame.f_locals.items()):
                if _is_named_ok(var) and isinstance(val, (nn.Module, torch.optim.Optimizer)):
                    out.append((var, val))
        out.extend((None, r) for r in self._extra_roots)
        return out

    def _build(self) -> None:
        if self._modules is not None:
            return
        self._modules = {}
        seen_opt: set[int] = set()
        for var, obj in self._root_candidates():
            if isinstance(obj, torch.optim.Optimizer):
                if id(obj) not in seen_opt and var is not None:
                    seen_opt.add(id(obj))
                    self._optimizers.append((var, obj))
                continue
            if isinstance(obj, torch.Tensor):
                self._tensors.setdefault(id(obj), ("tensor", var or "tensor"))
                continue
            if not isinstance(obj, nn.Module) or id(obj) in self._modules:
                continue
            root = var or type(obj).__name__
            for path, mod in obj.named_modules(remove_duplicate=False):
                if id(mod) in self._modules:
                    continue
                qual = f"{root}.{path}" if path else root
                self._modules[id(mod)] = qual
                for pname, p in mod.named_parameters(recurse=False):
                    self._tensors.setdefault(id(p), ("parameter", f"{qual}.{pname}"))
                    if p.grad is not None:
                        self._tensors.setdefault(id(p.grad), ("gradient", f"{qual}.{pname}.grad"))
                for bname, b in mod.named_buffers(recurse=False):
                    self._tensors.setdefault(id(b), ("buffer", f"{qual}.{bname}"))
                for aname, val in vars(mod).items():
                    if isinstance(val, torch.Tensor) and not aname.startswith("_"):
                        self._tensors.setdefault(id(val), ("attribute", f"{qual}.{aname}"))
        for oname, opt in self._optimizers:
            for g, group in enumerate(opt.param_groups):
                for i, p in enumerate(group["params"]):
                    pname = self._tensors.get(id(p), ("", f"param_groups[{g}]['params'][{i}]"))[1]
                    for key, val in opt.state.get(p, {}).items():
                        if isinstance(val, torch.Tensor):
                            self._tensors.setdefault(
                                id(val), ("optimizer state", f"{oname}.state[{pname}][{key!r}]")
                            )

    def module_path(self, module: nn.Module) -> str:
        """``model.net2``; a module nobody named gets its class name."""
        self._build()
        assert self._modules is not None
        return self._modules.get(id(module), type(module).__name__)

    def module_label(self, module: nn.Module) -> str:
        """``model.net2 (Linear)``."""
        return f"{self.module_path(module)} ({type(module).__name__})"

    def tensor(self, t: torch.Tensor) -> tuple[str, str] | None:
        """``(kind, qualified name)`` for parameters, buffers, tensor attributes, optimizer state."""
        self._build()
        return self._tensors.get(id(t))

    # ------------------------------------------------------------------ variables
    def variable(self, t: Any) -> tuple[str, Location] | None:
        """The innermost user variable bound to ``t`` and where, e.g. ``("labels", train.py:20)``."""
        if self._variables is None:
            self._variables = {}
            for frame in self._frames:
                loc = None
                for var, val in list(frame.f_locals.items()):
                    if _is_named_ok(var) and isinstance(val, torch.Tensor) and id(val) not in self._variables:
                        loc = loc or location(frame)
                        self._variables[id(val)] = (var, loc)
        return self._variables.get(id(t))

    def optimizer_running(self) -> tuple[str, torch.optim.Optimizer] | None:
        """``(name, optimizer)`` when the error happened inside ``optimizer.step()``."""
        frame = self._all_frames_from
        while frame is not None:
            obj = frame.f_locals.get("self")
            if isinstance(obj, torch.optim.Optimizer):
                self._build()
                for name, opt in self._optimizers:
                    if opt is obj:
                        return name, obj
                return type(obj).__name__, obj
            frame = frame.f_back
        return None

    @property
    def location(self) -> Location | None:
        """The innermost line of user code where the error happened."""
        return location(self._frames[0]) if self._frames else None


def find_in_frames(frames: Iterable[FrameType], kinds: tuple[type, ...]) -> dict[str, Any]:
    """``{variable name: object}`` for objects of ``kinds`` in ``frames`` (outermost name wins)."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for frame in reversed(list(frames)):
        for var, val in list(frame.f_locals.items()):
            if _is_named_ok(var) and isinstance(val, kinds) and id(val) not in seen:
                seen.add(id(val))
                out[var] = val
    return out


def tb_frames(tb: Any) -> list[FrameType]:
    """Every frame of a traceback, outermost first."""
    frames: list[FrameType] = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def traceback_frames(tb: Any) -> list[FrameType]:
    """User frames of an exception's traceback, innermost first."""
    return [f for f in reversed(tb_frames(tb)) if not is_internal_file(f.f_code.co_filename)]

"""``DeviceMismatchError``: a device error that names the op, the module, every tensor and the fix.

Usage::

    try:
        with torchspan.watch():
            loss = criterion(model(x), y)
    except torchspan.DeviceMismatchError as err:
        print(err)            # op, module path, each tensor (device, shape, dtype, name), fix
        err.module            # "criterion (CrossEntropyLoss)"
        err.__cause__         # PyTorch's own error, when PyTorch raised one
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .naming import Location, Namer, op_name
from .report import Finding, TensorArg

__all__ = [
    "DeviceMismatchError",
    "mismatch_error",
    "describe_tensors",
    "expected_device",
    "build_fix",
    "FACTORY_NAMES",
    "is_factory",
    "py_path",
]

FACTORY_NAMES = frozenset(
    "tensor as_tensor ones zeros full empty rand randn randint arange linspace eye scalar_tensor".split()
)


def base_name(func: Any) -> str:
    """``full`` for both ``torch.full`` and ``aten.full.default``."""
    if isinstance(func, torch._ops.OpOverload):
        return func._schema.name.split("::", 1)[-1]
    return getattr(func, "__name__", "") or ""


def is_factory(func: Any) -> bool:
    """True for ops that make a new tensor from sizes or data (``torch.full``, ``aten.ones``...)."""
    name = base_name(func)
    return name in FACTORY_NAMES or (name.endswith("_like") and name[:-5] in FACTORY_NAMES)


class DeviceMismatchError(RuntimeError):
    """An op got tensors on different devices. A ``RuntimeError``, so existing handlers still work.

    Attributes: ``op`` (e.g. ``"torch.nn.functional.linear"``), ``phase`` (``"forward"`` or
    ``"backward"``), ``module`` (``"model.net2 (Linear)"`` or None), ``tensors``
    (:class:`TensorArg` list, the odd ones marked), ``expected`` (the device the odd tensors
    should be on), ``fix`` (what to change), ``location`` (the user's line, when known).
    ``__cause__`` is PyTorch's original error when PyTorch raised one.
    """

    def __init__(
        self,
        *,
        op: str,
        phase: str,
        module: str | None,
        tensors: Sequence[TensorArg],
        expected: str,
        fix: str,
        location: Location | None = None,
        headline: str | None = None,
        original: str | None = None,
        code: str = "device-mismatch",
    ) -> None:
        self.op = op
        self.phase = phase
        self.module = module
        self.tensors = list(tensors)
        self.expected = expected
        self.fix = fix
        self.location = location
        self.original = original
        self.code = code
        devs = sorted({t.device for t in self.tensors})
        self.headline = (
            headline or f"{op} got tensors on different devices ({', '.join(devs)}) during {phase}"
        )
        super().__init__(self._message())

    def _message(self) -> str:
        lines = [self.headline]
        if self.module:
            lines.append(f"  module: {self.module}")
        if self.location:
            lines.append(f"  code:   {self.location}")
        if self.tensors:
            lines.append("  tensors:")
            lines.extend(f"  {'!' if t.odd else ' '} {t.describe()}" for t in self.tensors)
        lines.append(f"  fix: {self.fix}")
        if self.original:
            lines.append(f"  PyTorch said: {self.original}")
        return "\n".join(lines)

    def finding(self) -> Finding:
        """This error as a report :class:`Finding` (severity ``error``)."""
        details = [f"op: {self.op} ({self.phase})"]
        if self.location:
            details.append(f"code: {self.location}")
        if self.original:
            details.append(f"PyTorch said: {self.original}")
        return Finding(
            code=self.code,
            severity="error",
            title=self.headline,
            fix=self.fix,
            where=self.module,
            details=details,
            tensors=list(self.tensors),
        )

    def __reduce__(self) -> Any:  # keep it picklable (multiprocessing, pytest-xdist)
        return (RuntimeError, (str(self),))


def dtype_name(t: torch.Tensor) -> str:
    """``float32`` for a ``torch.float32`` tensor."""
    return str(t.dtype).replace("torch.", "")


def is_cpu_scalar(t: torch.Tensor) -> bool:
    """A 0-dim CPU tensor: PyTorch lets it mix with tensors on any device."""
    return t.device.type == "cpu" and t.dim() == 0


def describe_tensors(
    pairs: Sequence[tuple[str, torch.Tensor]],
    namer: Namer,
    phase: str,
    producer: Callable[[torch.Tensor], tuple[Any, nn.Module | None] | None] = lambda t: None,
) -> tuple[list[TensorArg], dict[int, Any]]:
    """Describe each ``(label, tensor)``; also return ``{index: producing op}`` for factory-made tensors.

    ``producer(t)`` gives ``(op, module)`` for tensors made while watching.
    """
    out: list[TensorArg] = []
    factories: dict[int, Any] = {}
    for i, (label, t) in enumerate(pairs):
        kind, name, origin = "tensor", None, None
        named = namer.tensor(t)
        var = namer.variable(t)
        src = producer(t)
        if named is not None:
            kind, name = named
            if kind == "attribute" and t.requires_grad and not isinstance(t, nn.Parameter):
                kind = "unregistered parameter"  # nn.Parameter(t).cuda(1): a copy, trained by nothing
        elif src is not None:
            func, mod = src
            if is_factory(func):
                kind, origin = "tensor", f"created by {factory_name(func)}"
                factories[i] = func
            else:
                kind = "activation"
                where = f"in {namer.module_label(mod)}" if mod is not None else "outside any module"
                origin = f"produced by {op_name(func)} {where}"
            if var is not None:
                name = var[0]
        elif var is not None:
            kind, name, origin = "variable", var[0], f"in {var[1].function} ({var[1].short})"
        elif phase == "backward":
            kind, origin = "gradient", "computed by autograd"
        else:
            kind, origin = "input", "made before the watcher started"
        out.append(TensorArg(label, str(t.device), tuple(t.shape), dtype_name(t), kind, name, origin))
    return out, factories


def expected_device(args: Sequence[TensorArg], module: nn.Module | None) -> str:
    """The device the odd tensors should move to: the majority; ties go to parameters, then the module."""
    counted = [a for a in args if not (a.device == "cpu" and a.shape == ())]
    counts = Counter(a.device for a in counted)
    if not counts:
        return args[0].device if args else "cpu"
    best = max(counts.values())
    top = [d for d, c in counts.items() if c == best]
    if len(top) == 1:
        return top[0]
    for a in counted:
        if a.kind == "parameter" and a.device in top:
            return a.device
    # tensors that are easily left behind (state, buffers, plain attributes) lose ties
    fresh = [
        a
        for a in counted
        if a.device in top
        and a.kind not in ("optimizer state", "buffer", "attribute", "unregistered parameter")
    ]
    if len({a.device for a in fresh}) == 1:
        return fresh[0].device
    if module is not None:
        for p in module.parameters():
            if str(p.device) in top:
                return str(p.device)
    return next(a.device for a in counted if a.device in top)


def py_path(name: str) -> str:
    """A qualified name as Python code: ``model.0.weight`` -> ``model[0].weight``."""
    parts = name.split(".")
    out = parts[0]
    for part in parts[1:]:
        out += f"[{part}]" if part.isdigit() else f".{part}"
    return out


def factory_name(func: Any) -> str:
    """``torch.full`` for both ``torch.full`` and ``aten.full.default``."""
    if isinstance(func, torch._ops.OpOverload):
        base = base_name(func)
        return f"torch.{base}" if hasattr(torch, base) else str(func)
    return op_name(func)


def _owner(name: str) -> tuple[str, str]:
    owner, _, leaf = name.rpartition(".")
    return py_path(owner or name), leaf


def unregistered_parameter_fix(name: str, leaf: str) -> str:
    """The fix for ``self.w = nn.Parameter(t).cuda(1)``: a plain tensor copy that no optimizer trains."""
    return (
        f"`{name}` is not a parameter and will not be trained: `nn.Parameter(t).cuda()` / `.to()` returns "
        f"a plain tensor copy, which `parameters()` (so the optimizer) never sees and `.to()` does not move; "
        f"create it with `self.{leaf} = nn.Parameter(t.to(device))`"
    )


def _owned_fix(a: TensorArg, expected: str) -> str | None:
    """How to move a named tensor something owns (a module's buffer, parameter or attribute, an optimizer's
    state) to ``expected``; ``None`` for other kinds."""
    assert a.name is not None
    if a.kind == "buffer":
        owner, leaf = _owner(a.name)
        return (
            f"call `{owner}.to('{expected}')`: its buffer `{leaf}` stays on {a.device} until the module "
            "itself is moved"
        )
    if a.kind == "parameter":
        owner, _ = _owner(a.name)
        return (
            f"move the layer with `{owner}.to('{expected}')`, or move its input to {a.device} before "
            "calling it"
        )
    if a.kind == "unregistered parameter":
        return unregistered_parameter_fix(a.name, _owner(a.name)[1])
    if a.kind == "attribute":
        owner, leaf = _owner(a.name)
        return (
            f"`{a.name}` is a plain tensor attribute, which `.to()` does not move: register it in __init__ "
            f"with `self.register_buffer('{leaf}', tensor)` so `{owner}.to('{expected}')` takes it along"
        )
    if a.kind == "optimizer state":
        opt = py_path(a.name.split(".state[", 1)[0])
        return (
            f"move the optimizer state next to its parameters with `torchspan.to_device({opt}, "
            f"'{expected}')` after the model has moved, or move the model to '{expected}' before "
            f"`{opt}.load_state_dict(...)` (it puts the state on each parameter's device at that moment)"
        )
    return None


def build_fix(
    args: Sequence[TensorArg],
    expected: str,
    module_path: str | None,
    module: nn.Module | None,
    location: Location | None,
    factories: dict[int, Any],
) -> str:
    """One sentence per odd tensor saying how to put it on ``expected``."""
    at = f" (at {location.short})" if location else ""
    ref = next((a.name for a in args if not a.odd and a.name and a.kind in ("activation", "variable")), None)
    ref_expr = f"{ref}.device" if ref else f"'{expected}'"
    module_path = py_path(module_path) if module_path else None
    module_has_params_there = module is not None and any(
        str(p.device) == expected for p in module.parameters()
    )
    fixes: list[str] = []
    for i, a in enumerate(args):
        if not a.odd:
            continue
        owned = _owned_fix(a, expected) if a.name else None
        if owned is not None:
            fixes.append(owned)
        elif i in factories:
            made = f"`{a.name}` was" if a.name else "this tensor was"
            move = f"; or move it before use{at}: `{a.name} = {a.name}.to('{expected}')`" if a.name else ""
            # a factory puts its result on the default device unless told otherwise: elsewhere, a device was
            # given
            why = (
                f"on {a.device} because no device was given"
                if a.device == str(torch.get_default_device())
                else f"with device='{a.device}'"
            )
            fixes.append(
                f"{made} made by {factory_name(factories[i])} {why}: create it with `device={ref_expr}`{move}"
            )
        elif a.kind == "gradient":
            fixes.append(
                f"a gradient arrived on {a.device}: a tensor hook or custom autograd Function returned it "
                f"there; return `grad.to('{expected}')` instead"
            )
        else:
            var = a.name or a.label
            if module_path and module_has_params_there:
                fixes.append(
                    f"move the input with `{var} = {var}.to('{expected}')` before `{module_path}` runs{at}, "
                    f"or place `{module_path}` on {a.device} with `{module_path}.to('{a.device}')`"
                )
            else:
                fixes.append(f"move `{var}` with `{var}.to('{expected}')`{at}")
    if not fixes:
        fixes.append(f"put every tensor of this op on {expected}")
    # keep order, drop repeats (e.g. weight and bias of the same layer)
    seen: set[str] = set()
    uniq = [f for f in fixes if not (f in seen or seen.add(f))]
    return "; ".join(uniq)


def mismatch_error(
    func: Any,
    pairs: Sequence[tuple[str, torch.Tensor]],
    *,
    phase: str,
    namer: Namer,
    module: nn.Module | None,
    exact: bool,
    node: Any,
    running_opt: tuple[str, torch.optim.Optimizer] | None,
    producer: Callable[[torch.Tensor], tuple[Any, nn.Module | None] | None],
    original: BaseException | None,
) -> DeviceMismatchError:
    """Compose the error for op ``func`` whose labelled tensors ``pairs`` sit on different devices.

    ``module`` is the running module (forward) or the backward node's (``exact`` False when only an
    enclosing one is known); ``running_opt`` the ``(name, optimizer)`` whose step is running;
    ``original`` PyTorch's own error, None when PyTorch let a ``meta`` mix through.
    """
    if running_opt is not None and module is None:
        phase = "optimizer step"
    tensors, factories = describe_tensors(pairs, namer, phase, producer)
    expected = expected_device(tensors, module)
    for t in tensors:
        t.odd = t.device != expected and not (t.device == "cpu" and t.shape == ())
    location = namer.location
    module_path = namer.module_path(module) if module is not None else None
    if phase == "backward":
        node_name = node.name() if node is not None else "autograd"
        where = f"backward of {node_name}"
        if module is not None:
            where += f" {'in' if exact else 'inside or feeding'} {namer.module_label(module)}"
    elif running_opt is not None and module is None:
        where = f"{running_opt[0]}.step() ({type(running_opt[1]).__name__})"
    else:
        where = namer.module_label(module) if module is not None else None
    fix = build_fix(tensors, expected, module_path, module, location, factories)
    if original is None:
        fix += (
            " (PyTorch did not refuse this op because one side is on 'meta', whose kernels skip device "
            "checks; on real devices it raises)"
        )
    return DeviceMismatchError(
        op=op_name(func),
        phase=phase,
        module=where,
        tensors=tensors,
        expected=expected,
        fix=fix,
        location=location,
        original=str(original).strip().splitlines()[0]
        if original is not None and str(original).strip()
        else None,
    )

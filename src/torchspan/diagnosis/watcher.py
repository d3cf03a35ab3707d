"""``with torchspan.watch(): ...`` — stop at the first op whose tensors sit on different devices.

How it works: a ``TorchFunctionMode`` sees every torch call of the forward (and of the optimizer
step) with its real arguments; a ``TorchDispatchMode`` is added only while a backward runs, so
hooks, custom autograd Functions and autograd's own formulas are checked too. Module tracking
(global forward hooks, see ``tracking.py``) says which module is running. The hot path compares
devices and nothing else; names, producers and the fix are worked out only on a mismatch.
``torch.compile``'d code runs eagerly while watched (``set_stance("force_eager")``), so its ops
are checked one by one like any other.

On a mismatch the op is first handed to PyTorch: its error (if any) becomes the ``__cause__``.
PyTorch accepting a mix of real devices (CPU scalars, CPU lengths for ``pack_padded_sequence``)
means the mix is legal and the watcher lets it through; on the ``meta`` device PyTorch's kernels
check little, so any mix involving ``meta`` is reported.

Usage::

    with torchspan.watch(model=model, criterion=criterion):
        loss = criterion(model(x), y)
        loss.backward()
"""

from __future__ import annotations

import inspect
import re
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .mismatch import (
    DeviceMismatchError,
    base_name,
    build_fix,
    describe_tensors,
    dtype_name,
    expected_device,
    is_cpu_scalar,
    is_factory,
    py_path,
)
from .naming import Namer, op_name
from .report import Finding, TensorArg
from .tracking import ModuleTracker, node_module

__all__ = ["watch", "Watcher", "active_watcher"]

_Tensor = torch.Tensor

# op kinds, decided once per op and cached
_CHECK, _SKIP, _BACKWARD, _NOTAG, _FACTORY = 0, 1, 2, 3, 4

# Ops whose arguments may legally live on different devices (moves, indexing with CPU indices,
# CPU lengths/batch sizes, shape-only "as" ops).
_SKIP_NAMES = frozenset(
    """to copy_ cpu cuda type type_as __getitem__ __setitem__ index index_put index_put_ _index_put_impl_
    expand_as view_as reshape_as new_tensor set_ is_set_to __deepcopy__ __reduce_ex__ _to_copy _copy_from
    _copy_from_and_resize detach lift_fresh _local_scalar_dense ctc_loss _pack_padded_sequence
    pack_padded_sequence _pad_packed_sequence lstm gru rnn_tanh rnn_relu __set__ __get__ __repr__ __format__
    to_sparse pin_memory record_stream untyped_storage _make_subclass
    """.split()
)
# predicates (they compare, they do not compute) and PyTorch's own conversion helpers
_SKIP_PREFIXES = ("_has_", "is_", "_is_", "_parse_to")
_BACKWARD_FUNCS: set[Any] = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}

_PRUNE_AT = 50_000
_ref = weakref.ref
_KINDS: dict[Any, int] = {}  # op -> kind, shared by all watchers (an op's kind never changes)
_ACTIVE: list[Watcher] = []
_ACTIVE_LOCK = threading.Lock()


def active_watcher() -> Watcher | None:
    """The innermost watcher currently installed, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def _classify(func: Any) -> int:
    if func in _BACKWARD_FUNCS:
        return _BACKWARD
    name = base_name(func)
    if name in _SKIP_NAMES or name.startswith(_SKIP_PREFIXES):
        return _SKIP
    if is_factory(func):
        return _FACTORY
    if name.startswith("_foreach") or name.endswith("_"):
        return _NOTAG  # in-place ops and foreach lists: nothing new to tag
    return _CHECK


def _iter_tensors(args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[tuple[int | str, int, _Tensor]]:
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


def _devices_disagree(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
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


def _real_mismatch(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Slow check, run only when devices differ: CPU 0-dim tensors are legal scalars anywhere."""
    if base_name(func).startswith("_foreach"):
        lists = [a for a in list(args) + list(kwargs.values()) if type(a) in (list, tuple)]
        singles = {
            t.device for t in list(args) + list(kwargs.values()) if isinstance(t, _Tensor) and not is_cpu_scalar(t)
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
    devs = {t.device for _, _, t in _iter_tensors(args, kwargs) if not is_cpu_scalar(t)}
    return len(devs) > 1


_DOC_SIG = re.compile(r"^\s*\w+\((.*?)\)")


def _arg_names(func: Any) -> list[str]:
    if isinstance(func, torch._ops.OpOverload):
        return [a.name for a in func._schema.arguments]
    try:
        params = inspect.signature(func).parameters.values()
        return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
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


def _label_pairs(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[str, _Tensor]]:
    names = _arg_names(func)
    out: list[tuple[str, _Tensor]] = []
    for key, j, t in _iter_tensors(args, kwargs):
        if is_cpu_scalar(t):
            continue
        if isinstance(key, int):
            base = names[key] if key < len(names) else f"arg {key}"
        else:
            base = key
        out.append((f"{base}[{j}]" if j >= 0 else base, t))
    return out


class _FunctionWatcher(TorchFunctionMode):
    """Sees every torch call of the forward and the optimizer step (one per thread that entered)."""

    def __init__(self, owner: Watcher) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        owner = self.owner
        owner.ops += 1
        if kwargs is None:
            kwargs = {}
        kind = owner._kinds.get(func)
        if kind is None:
            kind = owner._kinds[func] = _classify(func)
        if kind == _SKIP:
            return func(*args, **kwargs)
        if kind == _BACKWARD:
            return owner._run_backward(func, args, kwargs)
        if _devices_disagree(args, kwargs) and _real_mismatch(func, args, kwargs):
            return owner._on_mismatch(func, args, kwargs, "forward")
        out = func(*args, **kwargs)
        if kind != _NOTAG:
            stack = owner.tracker.stack
            mod = stack[-1] if stack else None
            src = owner._src
            if type(out) is _Tensor:
                if not args or out is not args[0]:
                    src[id(out)] = (_ref(out), func, mod)
            elif type(out) is tuple:
                for o in out:
                    if type(o) is _Tensor:
                        src[id(o)] = (_ref(o), func, mod)
            if len(src) > owner._prune_at:
                owner._prune()
        return out


class _DispatchWatcher(TorchDispatchMode):
    """Active only while a backward runs: checks autograd's ops, hooks and custom Functions."""

    def __init__(self, owner: Watcher) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        owner = self.owner
        owner.ops += 1
        if kwargs is None:
            kwargs = {}
        kind = owner._kinds.get(func)
        if kind is None:
            kind = owner._kinds[func] = _classify(func)
        if kind == _SKIP:
            return func(*args, **kwargs)
        if _devices_disagree(args, kwargs) and _real_mismatch(func, args, kwargs):
            return owner._on_mismatch(func, args, kwargs, "backward")
        out = func(*args, **kwargs)
        if kind == _FACTORY and type(out) is _Tensor:
            owner._src[id(out)] = (_ref(out), func, None)
        return out


_ENGINE_GRAD = re.compile(r"Function (\w+) returned an invalid gradient at index (\d+) - expected device (\S+) but got (\S+)")
_ENGINE_HOOK = re.compile(r"hook '(.+?)' has changed the type of value \(was (\S+) got (\S+)\)")


def _type_to_device(name: str) -> str:
    low = name.lower()
    for dev in ("meta", "cuda", "mps", "xpu"):
        if dev in low:
            return dev
    return "cpu"


class Watcher:
    """The object ``watch()`` returns; use it as a context manager.

    ``named`` maps display names to the user's objects (modules, optimizers, tensors) so errors
    say ``model.net2.weight`` instead of guessing from stack frames. After the block,
    ``ops`` is the number of ops checked, ``modules_run`` the number of module calls seen and
    ``findings`` holds warnings collected on the way (e.g. an inert ``nn.DataParallel``).
    """

    def __init__(self, named: dict[str, Any] | None = None) -> None:
        for key, obj in (named or {}).items():
            if not isinstance(obj, (nn.Module, torch.optim.Optimizer, torch.Tensor)):
                raise ValueError(
                    f"watch({key}=...) got a {type(obj).__name__}; pass modules, optimizers or tensors to name, "
                    f"e.g. watch(model=model, criterion=criterion, optimizer=optimizer)"
                )
        self.named: dict[str, Any] = dict(named or {})
        self.ops = 0
        self.findings: list[Finding] = []
        self.tracker = ModuleTracker(on_enter=self._on_enter)
        self._kinds = _KINDS
        self._fmode = _FunctionWatcher(self)
        self._dmode = _DispatchWatcher(self)
        self._bw_roots: list[Any] = []
        # id(tensor) -> (weakref, producing op, running module): who made each activation. Kept
        # beside the tensor, not on it, so pickling or deep-copying outputs never drags modules along.
        self._src: dict[int, tuple[Any, Any, nn.Module | None]] = {}
        self._prune_at = _PRUNE_AT
        self._dp_warned: set[int] = set()
        self._outer: Watcher | None = None
        self._thread = threading.get_ident()
        self._stance: Any = None

    def _prune(self) -> None:
        """Forget producers of tensors that no longer exist; grow the bound if most are alive."""
        self._src = {k: v for k, v in self._src.items() if v[0]() is not None}
        self._prune_at = max(_PRUNE_AT, 2 * len(self._src))

    def producer(self, t: _Tensor) -> tuple[Any, nn.Module | None] | None:
        """``(op, module)`` that produced ``t`` while watching, or None."""
        entry = self._src.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1], entry[2]
        return None

    @property
    def modules_run(self) -> int:
        return self.tracker.calls

    def roots(self) -> list[nn.Module]:
        """Top-level modules the watcher saw running (e.g. ``model`` and ``criterion``)."""
        return list(self.tracker.roots)

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Watcher:
        with _ACTIVE_LOCK:
            outer = _ACTIVE[-1] if _ACTIVE else None
            if outer is not None and outer._thread == threading.get_ident():
                # Nested watch (e.g. torchspan.doctor(run=True) inside `torchspan doctor script.py`):
                # the outer watcher keeps checking; we only add our names to it.
                self._outer = outer
                self._src = outer._src
                outer.named.update({k: v for k, v in self.named.items() if k not in outer.named})
                return self
            _ACTIVE.append(self)
        # torch.compile'd code runs eagerly while watched: dynamo would otherwise trace the watcher
        # into its graph, where the check fails and PyTorch's bare error escapes unexplained.
        self._stance = torch.compiler.set_stance("force_eager")
        self.tracker.install()
        self._fmode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._outer is not None:
            self.ops, self.findings = self._outer.ops, self._outer.findings
            return
        self._fmode.__exit__(*exc)
        self.tracker.uninstall()
        if self._stance is not None:
            self._stance.__exit__(None, None, None)
            self._stance = None
        with _ACTIVE_LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)

    # ------------------------------------------------------------------ module entry
    def _on_enter(self, module: nn.Module) -> None:
        if isinstance(module, nn.DataParallel):
            self._check_dataparallel(module)

    def _check_dataparallel(self, dp: nn.DataParallel) -> None:
        if not dp.device_ids:
            if id(dp) not in self._dp_warned:
                self._dp_warned.add(id(dp))
                namer = self._namer(sys._getframe(1))
                self.findings.append(dataparallel_inert_finding(namer.module_path(dp)))
            return
        src = dp.src_device_obj
        stray = [
            (n, t)
            for n, t in list(dp.module.named_parameters()) + list(dp.module.named_buffers())
            if t.device != src
        ]
        if not stray:
            return
        namer = self._namer(sys._getframe(1))
        path = py_path(namer.module_path(dp))
        args: list[TensorArg] = []
        for n, t in stray[:4]:
            named = namer.tensor(t)
            kind, name = named if named else ("parameter", f"{path}.module.{n}")
            args.append(TensorArg(n, str(t.device), tuple(t.shape), dtype_name(t), kind, name, odd=True))
        more = f" (and {len(stray) - 4} more)" if len(stray) > 4 else ""
        first = args[0].name
        raise DeviceMismatchError(
            op="nn.DataParallel.forward",
            phase="forward",
            module=namer.module_label(dp),
            tensors=args,
            expected=str(src),
            headline=(
                f"nn.DataParallel needs every parameter and buffer of the wrapped module on {src} "
                f"(device_ids[0]) before its forward, but {first} is on {args[0].device}{more}"
            ),
            fix=(
                f"move the model before wrapping it: `{path}.module.to('{src}')` (or build it with "
                f"`model.to('{src}')` first, then `nn.DataParallel(model)`); in CPU mode drop the wrapper: "
                f"`{path} = {path}.module`"
            ),
            location=namer.location,
            code="dataparallel-device",
        )

    # ------------------------------------------------------------------ backward
    def _run_backward(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        first = args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
        roots = [first] if isinstance(first, _Tensor) else [t for t in (first or ()) if isinstance(t, _Tensor)]
        self._bw_roots = [t.grad_fn for t in roots if t.grad_fn is not None]
        try:
            with self._dmode:
                return func(*args, **kwargs)
        except DeviceMismatchError:
            raise
        except RuntimeError as exc:
            err = self._translate_engine_error(exc)
            if err is None:
                raise
            raise err from exc

    def _walk_graph(self) -> Iterator[tuple[Any, nn.Module | None]]:
        """Autograd nodes reachable from the backward roots, with the nearest enclosing module output."""
        seen: set[int] = set()
        todo: list[tuple[Any, nn.Module | None]] = [(n, node_module(n)) for n in self._bw_roots]
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

    def _node_module(self, node: Any) -> tuple[nn.Module | None, bool]:
        """``(module, exact)`` for the backward node ``node``."""
        mod = node_module(node)
        if mod is not None:
            return mod, True
        for n, m in self._walk_graph():
            if n is node:
                return m, False
        return None, False

    def _translate_engine_error(self, exc: RuntimeError) -> DeviceMismatchError | None:
        text = str(exc)
        m = _ENGINE_GRAD.search(text)
        if m:
            fname, index, expected, got = m.group(1), int(m.group(2)), m.group(3), m.group(4)
            # the walk gives each node with its module (its own, else the nearest enclosing one)
            node, mod = next(((n, m) for n, m in self._walk_graph() if n.name() == fname), (None, None))
            namer = self._namer(sys._getframe(1))
            target = None
            if node is not None and index < len(node.next_functions):
                nxt = node.next_functions[index][0]
                var = getattr(nxt, "variable", None)
                if isinstance(var, _Tensor):
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
                tensors=[TensorArg(f"grad_input[{index}]", got, (), "?", "gradient", target, f"returned by {fname}", odd=True)],
                expected=expected,
                headline=f"{fname} returned gradient {index}{for_what} on {got}, but that input lives on {expected}",
                fix=(
                    f"in {fix_where}{' (' + where + ')' if where else ''} create every returned tensor on the input's "
                    f"device, e.g. `torch.ones(..., device=grad_output.device)` or `result.to(grad_output.device)`"
                ),
                location=namer.location,
                original=text.splitlines()[0],
                code="backward-gradient-device",
            )
        m = _ENGINE_HOOK.search(text)
        if m:
            hook, was, got = m.group(1), _type_to_device(m.group(2)), _type_to_device(m.group(3))
            namer = self._namer(sys._getframe(1))
            return DeviceMismatchError(
                op=f"tensor hook {hook}",
                phase="backward",
                module=None,
                tensors=[TensorArg("returned gradient", got, (), "?", "gradient", None, f"returned by hook {hook}", odd=True)],
                expected=was,
                headline=f"the tensor hook {hook} returned a gradient on {got} for a tensor on {was}",
                fix=f"make {hook} return a tensor on the gradient's device: `return new_grad.to(grad.device)`",
                location=namer.location,
                original=text.splitlines()[0],
                code="backward-hook-device",
            )
        return None

    # ------------------------------------------------------------------ mismatch
    def _namer(self, frame: Any) -> Namer:
        roots = self.tracker.running()[:1] + self.roots()
        return Namer(self.named, roots=roots, frame=frame)

    def _on_mismatch(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], phase: str) -> Any:
        original: BaseException | None = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = func(*args, **kwargs)
        except Exception as exc:  # PyTorch refused: keep its error as the cause
            original = exc
        else:
            devs = {t.device.type for _, _, t in _iter_tensors(args, kwargs)}
            if "meta" not in devs:
                return out  # PyTorch accepts this mix of real devices: it is legal
        try:
            err = self._build_error(func, args, kwargs, phase, original)
        except Exception as build_exc:  # never hide the user's problem behind a bug of ours
            if original is not None:
                raise original from build_exc
            raise
        raise err from original

    def _build_error(
        self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], phase: str, original: BaseException | None
    ) -> DeviceMismatchError:
        namer = self._namer(sys._getframe())
        node = torch._C._current_autograd_node() if phase == "backward" else None
        running_opt = namer.optimizer_running() if phase == "forward" else None
        if phase == "backward":
            module, exact = self._node_module(node)
        else:
            module, exact = self.tracker.current(), True
        if running_opt is not None and module is None:
            phase = "optimizer step"
        tensors, factories = describe_tensors(_label_pairs(func, args, kwargs), namer, phase, self.producer)
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
                " (PyTorch did not refuse this op because one side is on 'meta', whose kernels skip device checks; "
                "on real devices it raises)"
            )
        return DeviceMismatchError(
            op=op_name(func),
            phase=phase,
            module=where,
            tensors=tensors,
            expected=expected,
            fix=fix,
            location=location,
            original=str(original).strip().splitlines()[0] if original is not None and str(original).strip() else None,
        )


def _source_of(func: Callable[..., Any] | None) -> str | None:
    if func is None:
        return None
    try:
        file = inspect.getsourcefile(func)
        _, line = inspect.getsourcelines(func)
    except (OSError, TypeError):
        return None
    return f"{(file or '?').rsplit('/', 1)[-1]}:{line}"


def dataparallel_inert_finding(path: str) -> Finding:
    """The warning for an ``nn.DataParallel`` on a machine (or model) without CUDA."""
    code_path = py_path(path)
    return Finding(
        code="dataparallel-no-cuda",
        severity="warning",
        title=f"nn.DataParallel at `{path}` does nothing here: no CUDA device is available",
        where=path,
        details=[
            "Without CUDA, DataParallel just calls the wrapped module; on a machine with GPUs the same code copies "
            "the inputs to cuda:0 and fails unless every parameter is already on cuda:0.",
            "Its state_dict keys also gain a 'module.' prefix that a plain model does not have.",
        ],
        fix=(
            f"in CPU mode drop the wrapper: `{code_path} = {code_path}.module` (or wrap only when "
            "`torch.cuda.device_count() > 1`, after `model.to('cuda:0')`)"
        ),
    )


def watch(**named: Any) -> Watcher:
    """Watch every op in the ``with`` block; raise :class:`DeviceMismatchError` at the first one whose
    tensors sit on different devices, forward or backward.

    Keyword arguments name your objects in messages (``watch(model=model, criterion=criterion,
    optimizer=opt)``); without them names come from variables in your code.

    Usage::

        with torchspan.watch(model=model):
            model(x).sum().backward()
    """
    return Watcher(named)

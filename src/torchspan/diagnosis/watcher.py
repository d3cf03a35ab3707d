"""``with torchspan.watch(): ...`` — stop at the first op whose tensors sit on different devices.

How it works: a ``TorchFunctionMode`` sees every torch call of the forward (and of the optimizer
step) with its real arguments; a ``TorchDispatchMode`` is added only while a backward runs, so
hooks, custom autograd Functions and autograd's own formulas are checked too. Module tracking
(global forward hooks, see ``tracking.py``) says which module is running. The hot path compares
devices and nothing else; names, producers and the fix are worked out only on a mismatch.
``torch.compile``'d code runs eagerly while watched (``set_stance("force_eager")``), so its ops
are checked one by one like any other. Around it: ``oparguments`` reads an op's tensors,
``mismatch`` composes the error, ``backward`` translates the autograd engine's own device errors
and ``dataparallel`` checks an ``nn.DataParallel`` as it starts.

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

import sys
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .backward import engine_error, node_module_in
from .dataparallel import dataparallel_device_error, dataparallel_inert_finding, stray_tensors
from .mismatch import DeviceMismatchError, base_name, is_factory, mismatch_error
from .naming import Namer
from .oparguments import devices_disagree, iter_tensors, label_pairs, real_mismatch
from .report import Finding
from .tracking import ModuleTracker

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


class _FunctionWatcher(TorchFunctionMode):
    """Sees every torch call of the forward and the optimizer step (one per thread that entered)."""

    def __init__(self, owner: Watcher) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
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
        if devices_disagree(args, kwargs) and real_mismatch(func, args, kwargs):
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

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        owner = self.owner
        owner.ops += 1
        if kwargs is None:
            kwargs = {}
        kind = owner._kinds.get(func)
        if kind is None:
            kind = owner._kinds[func] = _classify(func)
        if kind == _SKIP:
            return func(*args, **kwargs)
        if devices_disagree(args, kwargs) and real_mismatch(func, args, kwargs):
            return owner._on_mismatch(func, args, kwargs, "backward")
        out = func(*args, **kwargs)
        if kind == _FACTORY and type(out) is _Tensor:
            owner._src[id(out)] = (_ref(out), func, None)
        return out


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
                    f"watch({key}=...) got a {type(obj).__name__}; pass modules, optimizers or tensors to "
                    f"name, e.g. watch(model=model, criterion=criterion, optimizer=optimizer)"
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
        stray = stray_tensors(dp)
        if stray:
            raise dataparallel_device_error(dp, stray, self._namer(sys._getframe(1)))

    # ------------------------------------------------------------------ backward
    def _run_backward(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        first = args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
        roots = (
            [first] if isinstance(first, _Tensor) else [t for t in (first or ()) if isinstance(t, _Tensor)]
        )
        self._bw_roots = [t.grad_fn for t in roots if t.grad_fn is not None]
        try:
            with self._dmode:
                return func(*args, **kwargs)
        except DeviceMismatchError:
            raise
        except RuntimeError as exc:
            frame = sys._getframe()
            err = engine_error(str(exc), self._bw_roots, lambda: self._namer(frame))
            if err is None:
                raise
            raise err from exc

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
            devs = {t.device.type for _, _, t in iter_tensors(args, kwargs)}
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
        self,
        func: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        phase: str,
        original: BaseException | None,
    ) -> DeviceMismatchError:
        """Gather what the watcher knows (names, running module or backward node, producers) into the
        error."""
        namer = self._namer(sys._getframe())
        node = torch._C._current_autograd_node() if phase == "backward" else None
        if phase == "backward":
            module, exact = node_module_in(node, self._bw_roots)
        else:
            module, exact = self.tracker.current(), True
        return mismatch_error(
            func,
            label_pairs(func, args, kwargs),
            phase=phase,
            namer=namer,
            module=module,
            exact=exact,
            node=node,
            running_opt=namer.optimizer_running() if phase == "forward" else None,
            producer=self.producer,
            original=original,
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

"""The sizing pass: one forward/backward under ``FakeTensorMode`` (no memory, no compute) per batch size.

It records, per layer: bytes autograd saves for backward (``saved_tensors_hooks``;
storages counted once, parameter/buffer storages excluded), output bytes, calls, which inputs
require grad, and for every aten op its FLOPs (``FlopCounterMode``) and bytes read plus written,
split into forward and backward segments (backward segments start at grad hooks on each layer's
outputs).

Usage: ``sizes = sizing_pass(model, [(l.name, l.module) for l in model_layers(model)], (x,), batch=32,
size=64, dtype=None)``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ..layers import module_entries

if TYPE_CHECKING:
    from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "Sizes",
    "as_args",
    "as_call",
    "batch_size_of",
    "bytes_of",
    "float_dtype",
    "input_bytes",
    "nbytes_as",
    "parse_dtype",
    "resize_batch",
    "sizing_pass",
    "on_meta",
    "meta_forward",
]


def on_meta(model: nn.Module) -> bool:
    """True when every parameter and buffer of ``model`` is on ``meta`` (a model built under
    ``torch.device("meta")``)."""
    state = list(model.parameters()) + list(model.buffers())
    return bool(state) and all(t.is_meta for t in state)


@contextlib.contextmanager
def meta_forward(model: nn.Module) -> Iterator[None]:
    """Around a forward of ``model`` on ``meta`` inputs: for a model on ``meta``, ``FakeTensorMode`` (its
    tensors become fake ones on ``meta``), so code that skips data-dependent checks while tracing
    (transformers' ``is_tracing``: packed-sequence and mask checks calling ``.item()``) skips them, as in the
    sizing pass; for any other model nothing. FakeTensorMode's own error log is quiet meanwhile (the caller
    reports the error)."""
    if not on_meta(model):
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    was_disabled, fake_log.disabled = fake_log.disabled, True
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield
    finally:
        fake_log.disabled = was_disabled


def as_args(example_inputs: Any) -> tuple[Any, ...]:
    return tuple(example_inputs) if isinstance(example_inputs, tuple) else (example_inputs,)


def as_call(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of a forward call: a dict gives keyword arguments, a tuple positional ones, else one
    argument.

    Usage: ``as_call({"input_ids": ids, "use_cache": False})`` → ``((), {"input_ids": ids, "use_cache":
    False})``.
    """
    if isinstance(example_inputs, Mapping):
        bad = [k for k in example_inputs if not isinstance(k, str)]
        if bad:
            raise TypeError(
                f"example_inputs as a dict must map forward argument names to values; got key(s) {bad!r}"
            )
        return (), dict(example_inputs)
    return as_args(example_inputs), {}


def batch_size_of(args: tuple[Any, ...]) -> int:
    for leaf in tree_flatten(args)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            if leaf.shape[0] < 1:
                raise ValueError(
                    f"example_inputs has a tensor of shape {tuple(leaf.shape)}: the batch (dim 0) is empty"
                )
            return int(leaf.shape[0])
    raise ValueError(
        "example_inputs holds no tensor with a batch dimension; pass a batch (e.g. torch.randn(32, 512)) "
        "or a tuple of arguments whose first tensor has the batch size in dim 0"
    )


def resize_batch(
    args: Any, batch: int, size: int, make: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]
) -> Any:
    """Every tensor whose dim 0 is ``batch`` rebuilt with dim 0 ``size`` by ``make(t, shape)``."""

    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            shape = (size, *t.shape[1:]) if t.dim() >= 1 and t.shape[0] == batch else tuple(t.shape)
            return make(t, shape)
        return t

    return tree_map(one, args)


def bytes_of(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor))


def float_dtype(model: nn.Module, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def input_bytes(args: Any, dtype: torch.dtype | None) -> int:
    """Bytes of the example inputs as profiled: floating tensors counted in ``dtype`` when one is given."""
    from torch.utils._pytree import tree_leaves

    tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    return sum(nbytes_as(t, dtype) for t in tensors)


def nbytes_as(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes of ``t`` as profiled: a floating tensor counted in ``dtype`` when one is given."""
    return t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    value = getattr(torch, dtype.strip().replace("torch.", ""), None) if isinstance(dtype, str) else dtype
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype; use e.g. torch.bfloat16 or 'float32'")
    if not value.is_floating_point:
        raise ValueError(
            f"dtype={dtype!r} is not a floating dtype; dtype casts floating parameters and inputs (e.g. "
            "'bfloat16'). For integer inputs such as token ids, pass them as example_inputs and leave "
            "dtype unset"
        )
    return value


@dataclass
class Sizes:
    """What one fake forward/backward at one batch size saw, per layer."""

    order: list[str]
    saved: dict[str, int]
    shared: dict[str, int]
    output: dict[str, int]
    calls: dict[str, int]
    requires_grad: dict[str, list[list[bool]]]  # per call, per flattened input leaf
    ops: dict[tuple[str | None, str], list[tuple[float, float]]]  # (layer, phase) -> [(flops, bytes)]


def _op_recorder(counter: Any, sink: Callable[[float, float], None]) -> TorchDispatchMode:
    """Dispatch mode that hands ``sink`` (flops, bytes read+written) of every aten op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            before = counter.get_total_flops()
            out = func(*args, **kwargs)
            name = getattr(func, "namespace", "")
            if name == "aten":
                flops = counter.get_total_flops() - before
                moved = 0 if getattr(func, "is_view", False) else bytes_of((args, kwargs)) + bytes_of(out)
                sink(float(flops), float(moved))
            return out

    return _Mode()


def sizing_pass(
    model: nn.Module,
    children: list[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    batch: int,
    size: int,
    dtype: torch.dtype | None,
    kwargs: dict[str, Any] | None = None,
) -> Sizes:
    """One fake forward/backward of ``model`` at batch ``size`` (``args`` hold batch ``batch``), per layer of
    ``children``.

    ``children``: the model's layers (``torchspan.layers.model_layers``), computed once by the caller;
    ``kwargs``: keyword arguments of the forward (resized like ``args``).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    state, fargs, fkwargs = _fake_call(model, fake_mode, args, dict(kwargs or {}), batch, size, dtype)
    tally = _Tally(children, state)
    handles = tally.hook(children)
    try:
        _fake_step(model, fake_mode, tally, state, fargs, fkwargs)
    finally:
        for h in handles:
            h.remove()
    return tally.finish(model, children)


def _fake_call(
    model: nn.Module,
    fake_mode: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    batch: int,
    size: int,
    dtype: torch.dtype | None,
) -> tuple[dict[str, torch.Tensor], tuple[Any, ...], dict[str, Any]]:
    """Fake parameters and buffers (by name) and the forward's arguments resized to batch ``size``, cast to
    ``dtype``."""

    def cast(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    with fake_mode:
        state: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            state[name] = torch.empty(tuple(p.shape), dtype=cast(p), device="cpu").requires_grad_(
                p.requires_grad
            )
        for name, b in model.named_buffers():
            state[name] = torch.empty(tuple(b.shape), dtype=cast(b), device="cpu")
        fargs, fkwargs = resize_batch(
            (args, kwargs), batch, size, lambda t, shape: torch.empty(shape, dtype=cast(t), device="cpu")
        )
    return state, tuple(fargs), fkwargs


class _Tally:
    """Per-layer bookkeeping of one sizing pass: forward hooks, the saved-tensor hook and the op sink write
    here."""

    def __init__(self, children: list[tuple[str, nn.Module]], state: dict[str, torch.Tensor]) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        zeros = {n: 0 for n, _ in children}
        self.sizes = Sizes(
            [], dict(zeros), dict(zeros), dict(zeros), dict(zeros), {n: [] for n, _ in children}, {}
        )
        self.state_keys = {StorageWeakRef(t.untyped_storage()).cdata for t in state.values()}
        self.first_layer = children[0][0]
        self.first_saver: dict[int, str] = {}
        self.shared_seen: set[tuple[str, int]] = set()
        self.stack: list[str] = []
        self.segment: tuple[str | None, str] = (None, "forward")

    def sink(self, flops: float, moved: float) -> None:
        """One aten op's (flops, bytes moved), filed under the running (layer, phase)."""
        self.sizes.ops.setdefault(self.segment, []).append((flops, moved))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """``saved_tensors_hooks`` pack: count a saved storage once, in the layer running (shared if another
        saved it first)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        try:
            storage = t.untyped_storage()
            key = StorageWeakRef(storage).cdata
            nbytes = storage.nbytes()
        except Exception:  # tensors without storage (sparse, nested): count their elements
            key, nbytes = id(t), t.numel() * t.element_size()
        if key in self.state_keys:
            return t
        sizes = self.sizes
        owner = self.stack[-1] if self.stack else (sizes.order[-1] if sizes.order else self.first_layer)
        first = self.first_saver.setdefault(key, owner)
        if (owner, key) in self.shared_seen:
            return t
        self.shared_seen.add((owner, key))
        if first == owner:
            sizes.saved[owner] += nbytes
        else:
            sizes.shared[owner] += nbytes
        return t

    def enter(self, name: str, a: Any, kw: Any) -> None:
        """A layer's forward starts: its call, which inputs need grad, and the forward segment."""
        sizes = self.sizes
        if name not in sizes.order:
            sizes.order.append(name)
        sizes.calls[name] += 1
        sizes.requires_grad[name].append(
            [isinstance(x, torch.Tensor) and x.requires_grad for x in tree_flatten((a, kw))[0]]
        )
        self.stack.append(name)
        self.segment = (name, "forward")

    def leave(self, name: str, out: Any) -> None:
        """A layer's forward ends: its output bytes, and a grad hook on each output that opens its backward
        segment."""
        self.stack.pop()
        self.segment = (self.stack[-1] if self.stack else None, "forward")
        self.sizes.output[name] += bytes_of(out)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda _grad, _n=name: self._start_backward(_n))

    def _start_backward(self, name: str) -> None:
        self.segment = (name, "backward")

    def hook(self, children: list[tuple[str, nn.Module]]) -> list[Any]:
        """Forward pre/post hooks on every layer; the caller removes the returned handles."""
        handles = []
        for child, next_name in module_entries(
            children
        ):  # one module at two entries: each call is the next entry's
            handles.append(
                child.register_forward_pre_hook(
                    lambda _m, a, kw, _n=next_name: self.enter(_n(), a, kw), with_kwargs=True
                )
            )
            handles.append(
                child.register_forward_hook(
                    lambda _m, _a, _kw, out: self.leave(self.stack[-1], out), with_kwargs=True
                )
            )
        return handles

    def finish(self, model: nn.Module, children: list[tuple[str, nn.Module]]) -> Sizes:
        """The sizes, layers in call order (a Sequential's, or one never called, in module order)."""
        sizes = self.sizes
        if isinstance(model, nn.Sequential) or not sizes.order:
            sizes.order = [n for n, _ in children]
        else:
            sizes.order.extend(n for n, _ in children if n not in sizes.order)
        return sizes


def _fake_step(
    model: nn.Module,
    fake_mode: Any,
    tally: _Tally,
    state: dict[str, torch.Tensor],
    fargs: tuple[Any, ...],
    fkwargs: dict[str, Any],
) -> None:
    """The forward (saved tensors packed by ``tally``) and backward, every aten op counted into
    ``tally.sink``."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    recorder = _op_recorder(counter, tally.sink)
    # FakeTensorMode logs a full traceback (at ERROR) for every op that raises, e.g. on a wrong input
    # shape; the caller turns the exception into one clear message, so keep the log quiet meanwhile.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    was_disabled, fake_log.disabled = fake_log.disabled, True
    try:
        with fake_mode, counter, recorder:
            with torch.autograd.graph.saved_tensors_hooks(tally.pack, lambda t: t):
                out = torch.func.functional_call(model, state, fargs, fkwargs, strict=False, tie_weights=True)
            tally.segment = (None, "backward")
            roots = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if roots:
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    finally:
        fake_log.disabled = was_disabled

"""The sizing pass: one forward/backward under ``FakeTensorMode`` (no memory, no compute) per batch size.

It records, per layer: bytes autograd saves for backward (``saved_tensors_hooks``;
storages counted once, parameter/buffer storages excluded), output bytes, calls, which inputs
require grad, and for every aten op its FLOPs (``FlopCounterMode``) and bytes read plus written,
split into forward and backward segments (backward segments start at grad hooks on each layer's
outputs).

Usage: ``sizes = sizing_pass(model, [(l.name, l.module) for l in model_layers(model)], (x,), batch=32, size=64, dtype=None)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

if TYPE_CHECKING:
    from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Sizes", "as_args", "as_call", "batch_size_of", "bytes_of", "float_dtype", "resize_batch", "sizing_pass"]

def as_args(example_inputs: Any) -> tuple[Any, ...]:
    return tuple(example_inputs) if isinstance(example_inputs, tuple) else (example_inputs,)


def as_call(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of a forward call: a dict gives keyword arguments, a tuple positional ones, else one argument.

    Usage: ``as_call({"input_ids": ids, "use_cache": False})`` → ``((), {"input_ids": ids, "use_cache": False})``.
    """
    if isinstance(example_inputs, Mapping):
        bad = [k for k in example_inputs if not isinstance(k, str)]
        if bad:
            raise TypeError(f"example_inputs as a dict must map forward argument names to values; got key(s) {bad!r}")
        return (), dict(example_inputs)
    return as_args(example_inputs), {}


def batch_size_of(args: tuple[Any, ...]) -> int:
    for leaf in tree_flatten(args)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            if leaf.shape[0] < 1:
                raise ValueError(f"example_inputs has a tensor of shape {tuple(leaf.shape)}: the batch (dim 0) is empty")
            return int(leaf.shape[0])
    raise ValueError(
        "example_inputs holds no tensor with a batch dimension; pass a batch (e.g. torch.randn(32, 512)) "
        "or a tuple of arguments whose first tensor has the batch size in dim 0"
    )


def resize_batch(args: Any, batch: int, size: int, make: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]) -> Any:
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
    """One fake forward/backward of ``model`` at batch ``size`` (``args`` hold batch ``batch``), per layer of ``children``.

    ``children``: the model's layers (``torchspan.layers.model_layers``), computed once by the caller;
    ``kwargs``: keyword arguments of the forward (resized like ``args``).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils.flop_counter import FlopCounterMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def cast(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    with fake_mode:
        state: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            state[name] = torch.empty(tuple(p.shape), dtype=cast(p), device="cpu").requires_grad_(p.requires_grad)
        for name, b in model.named_buffers():
            state[name] = torch.empty(tuple(b.shape), dtype=cast(b), device="cpu")
        fargs, fkwargs = resize_batch((args, dict(kwargs or {})), batch, size, lambda t, shape: torch.empty(shape, dtype=cast(t), device="cpu"))
    state_keys = {StorageWeakRef(t.untyped_storage()).cdata for t in state.values()}

    zeros = {n: 0 for n, _ in children}
    sizes = Sizes([], dict(zeros), dict(zeros), dict(zeros), dict(zeros), {n: [] for n, _ in children}, {})
    first_saver: dict[int, str] = {}
    shared_seen: set[tuple[str, int]] = set()
    stack: list[str] = []
    segment: list[tuple[str | None, str]] = [(None, "forward")]

    def sink(flops: float, moved: float) -> None:
        sizes.ops.setdefault(segment[0], []).append((flops, moved))

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            key = StorageWeakRef(storage).cdata
            nbytes = storage.nbytes()
        except Exception:  # tensors without storage (sparse, nested): count their elements
            key, nbytes = id(t), t.numel() * t.element_size()
        if key in state_keys:
            return t
        owner = stack[-1] if stack else (sizes.order[-1] if sizes.order else children[0][0])
        first = first_saver.setdefault(key, owner)
        if (owner, key) in shared_seen:
            return t
        shared_seen.add((owner, key))
        if first == owner:
            sizes.saved[owner] += nbytes
        else:
            sizes.shared[owner] += nbytes
        return t

    handles = []
    for cname, child in children:

        def pre(_m: nn.Module, a: Any, kw: Any, _n: str = cname) -> None:
            if _n not in sizes.order:
                sizes.order.append(_n)
            sizes.calls[_n] += 1
            sizes.requires_grad[_n].append([isinstance(x, torch.Tensor) and x.requires_grad for x in tree_flatten((a, kw))[0]])
            stack.append(_n)
            segment[0] = (_n, "forward")

        def post(_m: nn.Module, _a: Any, _kw: Any, out: Any, _n: str = cname) -> None:
            stack.pop()
            segment[0] = (stack[-1] if stack else None, "forward")
            sizes.output[_n] += bytes_of(out)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:

                    def start_backward(grad: torch.Tensor, _n: str = _n) -> None:
                        segment[0] = (_n, "backward")

                    t.register_hook(start_backward)

        handles.append(child.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(child.register_forward_hook(post, with_kwargs=True))

    counter = FlopCounterMode(display=False)
    recorder = _op_recorder(counter, sink)
    # FakeTensorMode logs a full traceback (at ERROR) for every op that raises, e.g. on a wrong input
    # shape; the caller turns the exception into one clear message, so keep the log quiet meanwhile.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    was_disabled, fake_log.disabled = fake_log.disabled, True
    try:
        with fake_mode, counter, recorder:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = torch.func.functional_call(model, state, tuple(fargs), fkwargs, strict=False, tie_weights=True)
            segment[0] = (None, "backward")
            roots = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if roots:
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    finally:
        fake_log.disabled = was_disabled
        for h in handles:
            h.remove()
    if isinstance(model, nn.Sequential) or not sizes.order:
        sizes.order = [n for n, _ in children]
    else:
        sizes.order.extend(n for n, _ in children if n not in sizes.order)
    return sizes

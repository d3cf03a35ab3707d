"""Meta as a taint: on a pipeline rank, a ``meta`` tensor is a value another stage computes.

A rank runs the model's own forward in full. Other stages' layers run on ``meta`` (no data, only
shapes), so what they produce, and everything the model's glue code derives from it, is ``meta``
here; what this rank can compute for real (the inputs, what derives from them, its own layers'
outputs) stays real and, being computed by the same code from the same values, equals what one
device computes. Plain torch refuses to mix ``meta`` with real tensors, so ``MetaTaint`` (a
``TorchFunctionMode`` active only in the glue between layers) enforces the rule:

- an op mixing ``meta`` and real tensors yields ``meta`` (the real ones join as shapes);
- tensors made from shapes alone (``torch.arange(n, device=x.device)``, ``zeros_like(x)``,
  ``x.new_ones(...)``, ``t.to(x.device)``) are real on this rank's device even when ``x`` is
  ``meta``: their values do not depend on ``x``'s data;
- an in-place op writing ``meta`` data into a real tensor of the forward's own
  (``torch.zeros(n).scatter_add_(0, idx, src)``) turns that tensor ``meta``; into a tensor that
  outlives the forward (``kept``: weights, buffers, inputs), a view or one with views it raises
  (a real tensor would keep a stale value: never silently wrong), as does reading a value of a
  ``meta`` tensor (``.item()``, ``if x.any():``), which torch refuses itself;
- a ``meta`` tensor moved to a device (``h.to(x.device)``, ``h.cuda()``) stays ``meta``, and its
  ``.device`` reads as this rank's device (code that chooses by ``x.device.type``, as an MoE
  router loss does, takes the branch one device takes; ``x.is_meta`` still tells);
- with ``recipes`` (``glue.Recipes``), every op whose result is ``meta`` is recorded, so the stage
  that needs a value the glue combined from several stages can replay it.

Usage (``RankOwnForwardExecutor`` does this)::

    with MetaTaint(torch.device("cpu")):
        out = model(ids)      # other stages' layers wrapped to run on meta
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from .glue import Recipes

__all__ = ["MetaTaint", "check_unchanged", "container_sizes", "meta_like", "to_meta", "is_meta"]

# Functions whose result depends only on the shape/dtype of their tensor argument, not its data.
_FROM_SHAPE = {
    "zeros_like",
    "ones_like",
    "full_like",
    "empty_like",
    "rand_like",
    "randn_like",
    "randint_like",
    "new_zeros",
    "new_ones",
    "new_full",
    "new_empty",
}
_META = torch.device("meta")
_REFUSED: Any = object()
# Moves between devices: a ``meta`` tensor moved to a real device (``h.to(x.device)``) is still another
# stage's value.
_MOVES = {"to", "cpu", "cuda", "xpu", "mps"}
# ``x += y`` on a meta ``x`` made from a real one returns a new meta tensor: replayed out of place.
_OUT_OF_PLACE = {
    "__iadd__": torch.Tensor.__add__,
    "__isub__": torch.Tensor.__sub__,
    "__imul__": torch.Tensor.__mul__,
    "__itruediv__": torch.Tensor.__truediv__,
}


def is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when already ``meta``, else a ``meta`` tensor of its shape, strides and dtype (no
    grad)."""
    return t if t.is_meta else torch.empty_like(t, device=_META)


def to_meta(tree: Any) -> Any:
    """``tree`` with every tensor replaced by a ``meta`` tensor of its shape and dtype (no grad)."""
    return tree_map(lambda t: meta_like(t) if isinstance(t, torch.Tensor) else t, tree)


def container_sizes(tree: Any) -> list[tuple[Any, int]]:
    """The lists and dicts inside ``tree`` (below its top level) with their lengths: ``check_unchanged`` after
    a call."""
    found: list[tuple[Any, int]] = []

    def walk(node: Any, top: bool) -> None:
        if isinstance(node, (list, dict)) and not top:
            found.append((node, len(node)))
        if isinstance(node, (list, tuple)):
            for v in node:
                walk(v, False)
        elif isinstance(node, dict):
            for v in node.values():
                walk(v, False)

    walk(tree, True)
    return found


def check_unchanged(sizes: list[tuple[Any, int]], layer: str) -> None:
    """Raise when a layer grew or shrank a list/dict argument: it got a copy here (its tensors swapped for
    another stage's or for meta ones), so the model's own container would silently miss the change."""
    for node, size in sizes:
        if len(node) != size:
            raise ValueError(
                f"torchspan: layer {layer!r} changed a {type(node).__name__} it was given (length {size} "
                f"-> {len(node)}); across ranks a layer gets its own copy of container arguments, so the "
                "model's container would not see the change. Return the new values from the layer instead, "
                "or run the model in one process"
            )


def _is_meta_device(d: Any) -> bool:
    return (isinstance(d, torch.device) and d.type == "meta") or d == "meta"


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", "") or ""


# leaves that are no pytree node and no tensor: a call's arguments made only of these and tensors need no
# pytree walk
_LEAVES = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        slice,
        type(Ellipsis),
        torch.dtype,
        torch.device,
        torch.Size,
        torch.layout,
        torch.memory_format,
    }
)


def _tensor_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among ``tree_leaves((args, kwargs))``, in order; flat arguments (the usual op) without the
    walk."""
    found = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif type(v) not in _LEAVES:  # a container (or a registered pytree node): the walk
            return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return found


class MetaTaint(TorchFunctionMode):
    """The glue rules above; ``device`` is where this rank's real tensors live."""

    def __init__(
        self,
        device: torch.device,
        recipes: Recipes | None = None,
        kept: frozenset[int] | set[int] = frozenset(),
    ) -> None:
        super().__init__()
        self.device, self.recipes = device, recipes
        self.kept = (
            kept  # ids of tensors that outlive the forward (weights, buffers, inputs): never turned meta
        )

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if name == "__get__":  # .shape, .device, .dtype, ...
            out = func(
                *args, **kwargs
            )  # another stage's value reads as on this rank's device: code choosing by
            return (
                self.device if isinstance(out, torch.device) and out.type == "meta" else out
            )  # device type runs as on one device
        if _is_meta_device(kwargs.get("device")):  # made here from shapes: real on this rank
            kwargs = {**kwargs, "device": self.device}
        leaves = _tensor_leaves(args, kwargs)
        metas = [t.is_meta for t in leaves]
        if name in _FROM_SHAPE and args and is_meta(args[0]):
            kwargs.setdefault("device", self.device)
            return func(*args, **kwargs)
        if (
            name in _MOVES and args and is_meta(args[0])
        ):  # another stage's value moved here stays another stage's
            return self._recorded(func, args, kwargs, _meta_moved(name, args, kwargs))
        if name == "to" and args and isinstance(args[0], torch.Tensor) and not args[0].is_meta:
            # a real tensor moved "to x.device" for a meta x stays real, on this rank's device
            args = tuple(self.device if _is_meta_device(a) else a for a in args)
            if _is_meta_device(kwargs.get("device")):
                kwargs = {**kwargs, "device": self.device}
            args, kwargs = _real_tensor_args(args, kwargs) if any(metas[1:]) else (args, kwargs)
            return func(*args, **kwargs)
        if not any(metas):
            return func(*args, **kwargs)
        target = kwargs.get("out", args[0] if args else None)
        writes = "out" in kwargs or name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))
        if all(metas):
            out = func(*args, **kwargs)
            return out if writes else self._recorded(_OUT_OF_PLACE.get(name, func), args, kwargs, out)
        # Mixed: the result is another stage's value here.
        if writes and isinstance(target, torch.Tensor) and not target.is_meta:
            written = (
                self._write_meta(func, args, kwargs, target) if id(target) not in self.kept else _REFUSED
            )
            if written is not _REFUSED:  # the glue's own tensor became another stage's value
                return written
            raise RuntimeError(
                f"torchspan: the model's forward writes a value computed by another pipeline stage into a "
                f"tensor computed on this one, in place ({name}); across ranks this rank's copy would keep a "
                "stale value. Write it out of place (x = x + y rather than x += y, torch.where rather than "
                "x[mask] = y), or run this model on one process (span with devices=[...])"
            )
        out = func(*to_meta(args), **to_meta(kwargs))
        return out if writes else self._recorded(_OUT_OF_PLACE.get(name, func), args, kwargs, out)

    @staticmethod
    def _write_meta(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], target: torch.Tensor) -> Any:
        """An in-place write of another stage's value into a tensor the glue made here
        (``torch.zeros(n).scatter_add_(0, idx, src)``): the tensor itself becomes ``meta``, another stage's
        value, wherever it is referenced. Refused (``_REFUSED``) when it is a view or has views (they would
        keep the stale value) or autograd saved it."""
        if (
            target._is_view() or torch._C._storage_Use_Count(target.untyped_storage()._cdata) > 2
        ):  # 2: itself + this query
            return _REFUSED
        margs, mkwargs = to_meta(args), to_meta(kwargs)
        stand_in = mkwargs["out"] if "out" in kwargs else margs[0]
        out = func(*margs, **mkwargs)
        try:
            torch.utils.swap_tensors(target, stand_in)
        except RuntimeError:
            return _REFUSED
        return target if out is stand_in else out

    def _recorded(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        """``out``, remembered in ``recipes`` (how this rank's meta values were made) when there are any."""
        if self.recipes is not None:
            self.recipes.record(func, args, kwargs, out)
        return out


def _meta_moved(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """``t.to(...)``/``t.cuda()`` for a ``meta`` ``t``: the same op with every device made ``meta`` (dtype
    kept), a real tensor argument (``t.to(other)``) read for its dtype: another stage's value stays ``meta``
    here."""
    t = args[0]
    if name != "to":
        return t
    device = lambda a: isinstance(a, (torch.device, str)) or (isinstance(a, int) and not isinstance(a, bool))  # noqa: E731
    fix = lambda a: _META if device(a) else a.dtype if isinstance(a, torch.Tensor) and not a.is_meta else a  # noqa: E731
    kwargs = {k: _META if k == "device" and v is not None else v for k, v in kwargs.items()}
    return t.to(*(fix(a) for a in args[1:]), **kwargs)


def _real_tensor_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``t.to(other)`` where ``other`` is meta: take its dtype, not its device."""
    fix = lambda a: a.dtype if is_meta(a) else a  # noqa: E731
    return tuple(fix(a) for a in args), {k: fix(v) for k, v in kwargs.items()}

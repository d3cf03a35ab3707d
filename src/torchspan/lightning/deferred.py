"""A pipeline across ranks under Lightning's own loop: the training forward deferred until its loss is known.

Lightning calls ``training_step`` (``loss = self.criterion(self(x), y)``) and later ``loss.backward()``; a
pipeline across ranks runs its forward and backward together, by its schedule, in
``spanned.train_step(inputs, target, loss_fn)``. So in training the spanned model returns ``Deferred``
outputs: tensors with the outputs' shape and dtype (found by running the model's forward on the meta
device) and no values. What is done with them is read, as the plain loop on replicas reads it
(``runtime.ranks.plainloop``):

- shape and dtype changes (``view``, ``flatten``, slicing, ``float``, ``log_softmax(-1)``, ...) are recorded;
  metadata (``shape``, ``size()``, ``dim()``, ``dtype``) is answered;
- a torch loss applied to one (``torch.nn.functional``'s, which every loss module calls) runs
  ``Runner.loss``: the whole step by the pipeline's schedule, its value the global batch's;
- the model's own loss (``self.model(**batch).loss``, a transformers model given ``labels``) runs the step
  on that loss (``Runner.own_loss``: ``spanned.train_step(batch)``) at its first use, Lightning's own
  included, and is that value from then on;
- anything else (a metric on the outputs, ``.item()``, a term added to the loss) has no values to work on:
  ``PlainLoopError`` at once, naming the operation and the way out.

Usage (``SpanStrategy`` does this)::

    out = deferred_outputs(spanned.module, args, kwargs, runner)   # then criterion(out, y) runs the step
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..runtime.microbatch import batch_size
from ..runtime.ranks.plainloop import _KEEP, _LOSSES, _PER_LAST_DIM, PlainLoopError

__all__ = ["Deferred", "Call", "deferred_outputs", "replay", "PipelineLoopError", "refuse"]


class PipelineLoopError(PlainLoopError):
    """``training_step`` did something with a pipeline's deferred outputs that torchspan cannot run
    exactly."""


_WAY_OUT = (
    "On a pipeline across ranks the outputs of a training forward exist only as micro-batches on the last "
    "stage, inside the pipeline's schedule; SpanStrategy runs it when a torch loss (torch.nn.functional's "
    "or a loss module, reduction 'mean' or 'sum') is applied to the outputs, after shape and dtype changes "
    "only. Return criterion(self(x), y) from training_step (compute metrics on the outputs in "
    "validation_step), or train this model as replicas (SpanStrategy() or SpanStrategy(shard=True) under a "
    "launcher), or write the loop yourself with torchspan.span(...).train_step(inputs, target, loss_fn)"
)


def refuse(what: str) -> PipelineLoopError:
    """The error for ``what`` (``training_step``'s use of a deferred output), with the ways out."""
    return PipelineLoopError(f"{what}. {_WAY_OUT}")


@dataclasses.dataclass(eq=False)
class Call:
    """One training forward of the spanned model: its arguments, rows and where its outputs live."""

    runner: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rows: int
    metas: list[Any]  # the outputs' leaves on the meta device
    device: torch.device
    own_loss: int | None = None  # the leaf of the model's own ``loss`` output (transformers, labels given)
    result: torch.Tensor | None = None  # that loss once the step ran (every use of it after reads this)


class _Marker:
    """Where the deferred output sits in a recorded operation's arguments."""


_HERE = _Marker()


class Deferred(torch.Tensor):
    """An output (or a reshaped view of one) of a pipeline's training forward: shape and dtype, no values."""

    _meta: torch.Tensor
    _call: Call
    _leaf: int
    _chain: tuple[tuple[Any, Any, Any], ...]

    @staticmethod
    def __new__(cls, meta: torch.Tensor, call: Call, leaf: int, chain: tuple[Any, ...] = ()) -> Deferred:
        grad = meta.is_floating_point() or meta.is_complex()
        t = torch.Tensor._make_wrapper_subclass(
            cls, meta.shape, dtype=meta.dtype, device=call.device, requires_grad=grad
        )
        t._meta, t._call, t._leaf, t._chain = meta, call, leaf, chain
        return t

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return (
            f"Deferred(shape={tuple(self.shape)}, dtype={self.dtype}: an output of a pipeline across ranks)"
        )

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Below ``__torch_function__`` (autograd's own use of the tensor): there are no values to compute
        with."""
        raise refuse(
            f"{func} reached an output of the pipeline, which holds no values until its loss runs the step"
        )

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        found = _deferred_in(args, kwargs)
        if found is None:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if (
            found._leaf == found._call.own_loss
            and not found._chain
            and _metadata(func, args, kwargs) is _NONE
        ):
            return _with_own_loss(func, args, kwargs, found._call)
        if func in _LOSSES:
            return found._call.runner.loss(func, args, kwargs)
        if func is torch.Tensor.register_hook and _lightnings(
            args[1] if len(args) > 1 else kwargs.get("hook")
        ):
            return torch.utils.hooks.RemovableHandle(
                OrderedDict()
            )  # Fabric's check that fabric.backward runs: it does
        metadata = _metadata(func, args, kwargs)
        if metadata is not _NONE:
            return metadata
        name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
        if len([t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Deferred)]) > 1:
            raise refuse(
                f"{name} takes more than one of the pipeline's deferred outputs, which torchspan cannot "
                "record"
            )
        on_meta = tree_map(lambda t: t._meta if isinstance(t, Deferred) else t, (args, kwargs))
        try:
            with torch._C.DisableTorchFunctionSubclass():
                result = func(*on_meta[0], **on_meta[1])
        except (
            Exception
        ) as exc:  # values asked for (.item(), a comparison with data), or another device's tensor
            raise refuse(
                f"training_step called {name} on an output of the pipeline, which needs its values ({exc})"
            ) from None
        keeps = func in _KEEP or (func in _PER_LAST_DIM and _last_dim(on_meta[0], on_meta[1]))
        if not keeps or not isinstance(result, torch.Tensor):
            raise refuse(
                f"training_step applied {name} to an output of the pipeline, which torchspan cannot weigh"
            )
        marked = tree_map(lambda t: _HERE if isinstance(t, Deferred) else t, (args, kwargs))
        return Deferred(result, found._call, found._leaf, (*found._chain, (func, *marked)))


_NONE = object()
_METADATA = frozenset(
    {
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.__len__,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.element_size,
        torch.Tensor.nelement,
        torch.Tensor.ndimension,
        torch.Tensor.stride,
        torch.Tensor.is_contiguous,
        torch.Tensor.get_device,
    }
)


def _metadata(func: Any, args: Any, kwargs: Any) -> Any:
    """``func``'s answer when it only reads metadata (a property's getter or ``size()``-like), else
    ``_NONE``."""
    getter = getattr(func, "__self__", None)
    if func in _METADATA or isinstance(getter, property) or getattr(func, "__name__", "") == "__get__":
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    return _NONE


def _lightnings(hook: Any) -> bool:
    """Whether ``hook`` is Lightning's own (Fabric hooks every output to check ``fabric.backward`` is used);
    the outputs' gradients never exist on a pipeline rank, so a user's hook on them is refused."""
    return str(getattr(getattr(hook, "func", hook), "__module__", "")).startswith("lightning.")


def _with_own_loss(func: Any, args: Any, kwargs: Any, call: Call) -> Any:
    """``func`` on the model's own loss (``model(**batch).loss``): its first use (Lightning's division by
    ``accumulate_grad_batches``, ``self.log``, ``backward``) runs the step on the model's own loss
    (``spanned.train_step(batch)``), later ones reuse that value; the pipeline's other outputs stay
    deferred."""
    if call.result is None:
        call.result = call.runner.own_loss(call)
    result = call.result

    def real(t: Any) -> Any:
        return result if isinstance(t, Deferred) and t._call is call and t._leaf == call.own_loss else t

    args, kwargs = tree_map(real, (args, kwargs))
    if _deferred_in(args, kwargs) is not None:
        raise refuse(
            f"{getattr(func, '__name__', func)} combines the model's own loss with another of its outputs"
        )
    return func(*args, **kwargs)


def _deferred_in(args: Any, kwargs: Any) -> Deferred | None:
    return next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Deferred)), None)


def _last_dim(args: Any, kwargs: Any) -> bool:
    t = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return isinstance(dim, int) and t.dim() >= 2 and dim in (-1, t.dim() - 1)


def replay(chain: tuple[Any, ...], out: Any, shape_only: bool = False) -> Any:
    """``out`` through the recorded operations (``shape_only``: those that move elements, not casts or
    softmax)."""
    for func, args, kwargs in chain:
        if shape_only and (func in _PER_LAST_DIM or func in _CASTS):
            continue
        args, kwargs = tree_map(lambda a, prev=out: prev if a is _HERE else a, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
    return out


_T = torch.Tensor
_CASTS = frozenset({_T.float, _T.double, _T.half, _T.bfloat16, _T.to, _T.type_as, _T.cpu, _T.cuda})


def meta_outputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The module's outputs on the meta device (shapes and dtypes, no compute): every parameter and buffer,
    this stage's and the others' (already ``meta`` on a pipeline rank), as a meta tensor of its shape; a
    tensor held under several names (a transformers model's tied embedding and head) is one meta tensor, as
    ``functional_call(tie_weights=True)`` requires."""
    made: dict[int, torch.Tensor] = {}

    def meta(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = torch.empty_like(t, device="meta")
        return made[id(t)]

    tensors = {n: meta(t) for n, t in module.named_parameters(remove_duplicate=False)}
    tensors.update({n: meta(t) for n, t in module.named_buffers(remove_duplicate=False)})
    on_meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
    with torch.no_grad():
        return torch.func.functional_call(
            module, tensors, on_meta[0], on_meta[1], tie_weights=True, strict=False
        )


def deferred_outputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], runner: Any) -> Any:
    """The outputs of a training forward on a pipeline across ranks, deferred (see the module docstring)."""
    try:
        out = meta_outputs(module, args, kwargs)
    except Exception as exc:
        raise refuse(
            f"SpanStrategy could not run {type(module).__name__}'s forward on the meta device to learn its "
            f"outputs' shapes ({type(exc).__name__}: {exc})"
        ) from None
    leaves, spec = tree_flatten(out)
    call = Call(runner, args, kwargs, batch_size(args, kwargs), leaves, runner.device)
    own = out.get("loss") if isinstance(out, Mapping) else None  # a transformers ModelOutput's
    if isinstance(own, torch.Tensor) and own.dim() == 0:
        call.own_loss = next(i for i, t in enumerate(leaves) if t is own)
    wrapped = [Deferred(t, call, i) if isinstance(t, torch.Tensor) else t for i, t in enumerate(leaves)]
    if not any(isinstance(t, Deferred) and t.requires_grad for t in wrapped):
        raise refuse(f"{type(module).__name__}'s forward returns no floating tensor to apply a loss to")
    return tree_unflatten(wrapped, spec)

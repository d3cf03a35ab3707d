"""The plain loop on replicas: ``loss = criterion(spanned(x), y); loss.backward()`` exact, or refused.

A data-parallel (or sharded) replica's backward sums every rank's gradient (``engine.summing``), so a
rank's loss must be its *share* of the global batch's loss. ``train_step`` knows the loss it is given;
in the plain loop torchspan never sees it, so the outputs of a training forward watch what is done
with them (a ``torch.Tensor`` subclass with ``__torch_function__``, as the doctor watches torch calls):

- a torch loss (``torch.nn.functional``'s, which every loss module calls) applied to an output is
  computed as its sum over this rank's rows, and the sum and the loss's normalizer (samples, elements,
  or the class weights of non-ignored targets) are all-reduced together: the loss returned has the
  global batch's value on every rank and the gradient of this rank's share (``sum / global normalizer``).
  One all-reduce of two numbers per loss call; the first call of each kind of loss checks that its mean
  is the sum over that normalizer.
- shape and dtype changes (``view``, ``flatten``, slicing, ``float``, ``log_softmax(-1)``, ...) keep
  watching; any other operation whose result reaches the backward is refused there, before any
  gradient reaches a parameter, naming ``train_step`` (which calibrates or takes a declaration).
- a transformers model given ``labels`` computes its own loss: it is reweighed the same way
  (``exact_model_loss``), its normalizer checked against the logits as ``train_step(batch)`` checks it.

Usage (``Spanned.forward`` does this on a replica)::

    out = watch(out, Record(group, comm_device))   # then the user's criterion(out, y).backward()
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves, tree_map

from ..lossweights import TORCH_LOSSES, class_weight_sum, legacy_reduction
from ..modelloss import CANDIDATES, own_loss, same_value

__all__ = ["Record", "watch", "declared", "exact_model_loss", "Watched", "PlainLoopError"]


class PlainLoopError(RuntimeError):
    """The plain loop's backward would not give one device's gradients: refused before any reaches
    ``.grad``."""


_LOSSES = TORCH_LOSSES  # the torch losses read here, as train_step reads them
_PER_ROW = frozenset({F.multilabel_soft_margin_loss, F.multilabel_margin_loss, F.multi_margin_loss})
_T = torch.Tensor
# operations that move, reshape or recast the outputs without mixing rows: the result is still watched
_KEEP = frozenset(
    {
        _T.view,
        _T.view_as,
        _T.reshape,
        _T.reshape_as,
        _T.flatten,
        torch.flatten,
        _T.unflatten,
        _T.__getitem__,
        _T.contiguous,
        _T.float,
        _T.double,
        _T.half,
        _T.bfloat16,
        _T.to,
        _T.type_as,
        _T.transpose,
        torch.transpose,
        _T.permute,
        torch.permute,
        _T.squeeze,
        torch.squeeze,
        _T.unsqueeze,
        torch.unsqueeze,
        _T.narrow,
        _T.select,
        _T.movedim,
        _T.swapaxes,
        _T.cpu,
        _T.cuda,
        _T.clone,
        torch.clone,
    }
)
_PER_LAST_DIM = frozenset(
    {F.log_softmax, F.softmax, _T.log_softmax, _T.softmax, torch.log_softmax, torch.softmax}
)
_MESSAGE = (
    "{what}. On a data-parallel replica every rank's backward is summed, so a rank's loss must be its share "
    "of the whole batch's; torchspan reads that share from torch's losses (torch.nn.functional's and the "
    "loss modules, reduction 'mean' or 'sum') applied to the outputs, after shape and dtype changes only. "
    "Apply a torch loss to the outputs (e.g. padding as ignore_index=-100 rather than a mask you multiply); "
    "declare it: span(model, loss_reduction='sum') for any loss that sums over rows, or 'mean' for a mean "
    "over each rank's rows; or train with spanned.train_step(inputs, target, loss_fn), which calibrates any "
    "loss or takes loss_reduction= / loss_normalizer="
)


@dataclasses.dataclass(eq=False)
class Record:
    """One training forward's outputs: where their losses are all-reduced and what was done with them."""

    group: Any
    comm: torch.device
    nonfinite: Callable[[torch.Tensor], None] | None = None
    losses: int = 0
    checked: set[Any] = dataclasses.field(default_factory=set)


class Watched(torch.Tensor):
    """An output of a replica's training forward that turns a torch loss applied to it into this rank's
    share."""

    _record: Record

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        record = _record_of(args, kwargs)
        if func in _LOSSES and record is not None:
            return _exact_loss(func, args, kwargs, record)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if record is None or not torch.is_grad_enabled():
            return result
        if func in _KEEP or (func in _PER_LAST_DIM and _last_dim(args, kwargs)):
            return tree_map(lambda t: _wrap(t, record) if isinstance(t, torch.Tensor) else t, result)
        return tree_map(lambda t: _refusing(t, func) if isinstance(t, torch.Tensor) else t, result)


def watch(out: Any, record: Record) -> Any:
    """``out`` with every floating tensor that requires grad watched (see the module docstring)."""

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.requires_grad or isinstance(t, Watched):
            return t
        t = t.view_as(t)
        t.register_hook(functools.partial(_arrived, record))
        return _wrap(t, record)

    return tree_map(one, out)


def declared(out: Any, reduction: str, record: Record) -> Any:
    """``out`` for a loss the user declared: ``"sum"`` over rows needs nothing (the replicas' backwards sum);
    ``"mean"`` over each shard's rows has its outputs' gradients scaled by the shard's rows over all ranks'
    (one all-reduce of the row count in the forward). The loss value stays this rank's own."""
    if reduction == "sum":
        return out
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() > 0]
    rows = float(leaves[0].shape[0]) if leaves else 0.0
    total = torch.tensor([rows], dtype=torch.float64, device=record.comm)
    dist.all_reduce(total, group=record.group)
    factor = rows / float(total) if float(total) else 0.0

    def scaled(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            return t
        return t * factor + (t - t * factor).detach()

    return tree_map(scaled, out)


def _wrap(t: torch.Tensor, record: Record) -> torch.Tensor:
    if not t.requires_grad:
        return t
    w = t.as_subclass(Watched)
    w._record = record
    return w


def _record_of(args: Any, kwargs: Any) -> Record | None:
    """The record of a watched output among ``args``/``kwargs``, nested ones included (``torch.cat([out,
    ...])``)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, Watched):
            return a._record
        if isinstance(a, (list, tuple, dict)):
            found = next((t for t in tree_leaves(a) if isinstance(t, Watched)), None)
            if found is not None:
                return found._record
    return None


def _last_dim(args: Any, kwargs: Any) -> bool:
    t = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return isinstance(dim, int) and t.dim() >= 2 and dim in (-1, t.dim() - 1)


def _refusing(t: torch.Tensor, func: Any) -> torch.Tensor:
    """``t`` whose gradient, if a backward ever reaches it, raises ``PlainLoopError`` naming ``func``."""
    if t.requires_grad:
        name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))

        def refuse(grad: torch.Tensor) -> None:
            what = (
                f"loss.backward() reached the replica's outputs through {name}, which torchspan cannot weigh"
            )
            raise PlainLoopError(_MESSAGE.format(what=what))

        t.register_hook(refuse)
    return t


def _arrived(record: Record, grad: torch.Tensor) -> None:
    if record.losses == 0:
        what = "loss.backward() reached the replica's outputs, but no torch loss was applied to them"
        raise PlainLoopError(_MESSAGE.format(what=what))


# ---------------------------------------------------------------------- a torch loss on the outputs


def _exact_loss(func: Any, args: Any, kwargs: dict[str, Any], record: Record) -> torch.Tensor:
    """``func(input, target, ...)`` with the global batch's value and this rank's share of its gradient."""
    names = ("input", "target")
    plain = {n: _plain(args[i] if len(args) > i else kwargs.get(n)) for i, n in enumerate(names)}
    rest = {k: _plain(v) for k, v in kwargs.items() if k not in names}
    reduction = legacy_reduction(rest, default="mean")
    if not isinstance(args[0] if args else kwargs.get("input"), Watched) or reduction not in (
        "mean",
        "sum",
        "batchmean",
    ):
        what = f"{func.__name__}(..., reduction={reduction!r}) on the replica's outputs"
        result = _plain_call(func, (plain["input"], plain["target"]), {**rest, "reduction": reduction})
        return _refusing(result, _Named(what))
    rest.pop("size_average", None), rest.pop("reduce", None)
    x, y = plain["input"], plain["target"]
    local = func(x, y, **{**rest, "reduction": "sum"})
    count = 1.0 if reduction == "sum" else _normalizer(func, reduction, x, y, rest)
    _check_once(func, reduction, x, y, rest, count, record)
    stats = torch.stack(
        [
            local.detach().double().to(record.comm),
            torch.tensor(count, dtype=torch.float64, device=record.comm),
        ]
    )
    dist.all_reduce(stats, group=record.group)
    record.losses += 1
    total, norm = stats[0].to(local.device, local.dtype), float(stats[1])
    if reduction == "sum":
        value, share = total, local
    else:
        value = total / norm if norm != 0.0 else torch.full_like(local, math.nan)
        share = local / norm if norm != 0.0 else local * math.nan
    loss = share + (value - share).detach()
    if record.nonfinite is not None:
        record.nonfinite(loss.detach())
    return loss


class _Named:
    def __init__(self, name: str) -> None:
        self.__qualname__ = name


def _plain(value: Any) -> Any:
    if not isinstance(value, Watched):
        return value
    with torch._C.DisableTorchFunctionSubclass():
        return value.as_subclass(torch.Tensor)


def _plain_call(func: Any, args: Any, kwargs: Any) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _normalizer(func: Any, reduction: str, x: torch.Tensor, y: Any, rest: dict[str, Any]) -> float:
    """What ``func``'s mean divides this rank's summed loss by."""
    if func in (F.cross_entropy, F.nll_loss) and isinstance(y, torch.Tensor) and not y.is_floating_point():
        return class_weight_sum(y, rest.get("weight"), int(rest.get("ignore_index", -100)))
    if func in (
        F.cross_entropy,
        F.nll_loss,
    ):  # class probabilities: a mean over every position but the classes
        return float(x.numel() // x.shape[1]) if x.dim() >= 2 and x.shape[1] else float(x.numel())
    if reduction == "batchmean" or func in _PER_ROW:
        return float(x.shape[0]) if x.dim() >= 2 or reduction == "batchmean" else 1.0
    shape = torch.broadcast_shapes(x.shape, y.shape) if isinstance(y, torch.Tensor) else x.shape
    return float(math.prod(shape))


def _check_once(
    func: Any, reduction: str, x: torch.Tensor, y: Any, rest: dict[str, Any], count: float, record: Record
) -> None:
    """The first time a kind of loss is seen: its own mean equals the sum over the normalizer torchspan
    uses."""
    key = (func, reduction, tuple(sorted(k for k, v in rest.items() if v is not None)))
    if reduction == "sum" or key in record.checked or count == 0.0:
        return
    record.checked.add(key)
    wide = {
        k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in rest.items()
    }
    y64 = y.double() if isinstance(y, torch.Tensor) and y.is_floating_point() else y
    with torch.no_grad():  # in float64: the normalizer is checked, not the outputs' precision
        own = float(func(x.detach().double(), y64, **{**wide, "reduction": reduction}))
        ours = float(func(x.detach().double(), y64, **{**wide, "reduction": "sum"})) / count
    if not (
        abs(own - ours) <= 1e-4 * max(abs(own), abs(ours)) + 1e-6 or math.isnan(own) and math.isnan(ours)
    ):
        what = (
            f"{func.__name__}(reduction={reduction!r}) with {sorted(key[2])} gives {own:.6g} on this "
            f"rank's rows, not its sum over {count:g} ({ours:.6g})"
        )
        raise PlainLoopError(_MESSAGE.format(what=what))


# ---------------------------------------------------------------------- the model's own loss


def exact_model_loss(out: Any, labels: torch.Tensor, record: Record) -> Any:
    """``out`` with its ``loss`` (the model's mean over this rank's labels) made the global batch's: the
    global value, this rank's share of the gradient. The normalizer is the one of ``modelloss.CANDIDATES``
    that reproduces the model's loss on every rank (one all-reduce); none does: ``PlainLoopError``."""
    loss = own_loss(out)
    logits = out.get("logits") if hasattr(out, "get") else getattr(out, "logits", None)
    if loss is None or not isinstance(logits, torch.Tensor):
        return out
    fits, counts = [], []
    with torch.no_grad():
        for _, recompute, normalizer in CANDIDATES:
            value = recompute(_plain(logits).detach(), labels)
            count = float(normalizer(labels)) if value is not None else 0.0
            same = value is not None and (count == 0.0 or same_value(float(loss), float(value)))
            fits.append(1.0 if same else 0.0)
            counts.append(count)
    local = float(loss.detach()) if counts else 0.0
    sums = [local * c if c else 0.0 for c in counts]
    stats = torch.tensor(fits + counts + sums, dtype=torch.float64, device=record.comm)
    dist.all_reduce(stats, group=record.group)
    k, world = len(CANDIDATES), dist.get_world_size(record.group)
    chosen = next((i for i in range(k) if int(stats[i]) == world), None)
    if chosen is None:
        what = (
            f"the model's own output.loss ({float(loss):.6g} on this rank) is not a token or sample mean "
            "torchspan can split"
        )
        raise PlainLoopError(_MESSAGE.format(what=what))
    mine, norm, total = counts[chosen], float(stats[k + chosen]), float(stats[2 * k + chosen])
    if mine == 0.0:
        share = _plain(logits).sum() * 0.0
    else:
        share = loss * (mine / norm)
    value = total / norm if norm else math.nan
    exact = share + (torch.full_like(share, value) - share).detach()
    record.losses += 1
    if record.nonfinite is not None:
        record.nonfinite(exact.detach())
    return _with_loss(out, exact)


def _with_loss(out: Any, loss: torch.Tensor) -> Any:
    if isinstance(out, tuple):
        return (loss, *out[1:])
    if isinstance(out, dict) and type(out) is dict:
        return {**out, "loss": loss}
    out["loss"] = loss  # a transformers ModelOutput keeps its attribute and key together
    return out

"""Weights that make per-micro-batch losses add up to the full-batch loss, exactly.

A ``reduction="mean"`` loss divides by a normalizer. For most losses it is the number of samples
(or elements), so micro-batch ``i`` weighs ``n_i / N``. For ``CrossEntropyLoss`` / ``NLLLoss`` with
class weights or ignored targets (``ignore_index``, e.g. padding in a language model) it is the
sum of the targets' class weights over non-ignored targets, so a micro-batch weighs
``W_i / W`` instead; weighting by sample share there gives silently wrong gradients.

Usage::

    reduction = resolve_reduction(loss_fn, None)          # reads loss_fn.reduction when it has one
    weights = microbatch_weights(loss_fn, target_chunks, sizes, reduction)
    loss = weighted_loss(loss_fn, out, target, weights[i])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["resolve_reduction", "microbatch_weights", "weighted_loss"]

_MEAN_LIKE = ("mean", "batchmean")


def resolve_reduction(loss_fn: Callable[..., Any], loss_reduction: str | None) -> str:
    """``"mean"`` or ``"sum"``: the user's ``loss_reduction``, checked against ``loss_fn.reduction``.

    ``None`` (the default) takes the loss module's own ``reduction`` and falls back to ``"mean"``
    for plain functions. A contradiction, or a loss that does not reduce, is a ``ValueError``.
    """
    declared = getattr(loss_fn, "reduction", None) if isinstance(loss_fn, nn.Module) else None
    if declared == "none":
        raise ValueError(
            f"loss_fn={type(loss_fn).__name__}(reduction='none') returns one loss per element; train_step needs a "
            "scalar. Use reduction='mean' or 'sum', or wrap it: lambda out, y: loss_fn(out, y).mean()"
        )
    declared_kind = "mean" if declared in _MEAN_LIKE else declared if declared == "sum" else None
    if loss_reduction is None:
        return declared_kind or "mean"
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction={loss_reduction!r} is not one of 'mean', 'sum' (or None to read it from loss_fn)")
    if declared_kind is not None and declared_kind != loss_reduction:
        raise ValueError(
            f"loss_reduction={loss_reduction!r} contradicts loss_fn={type(loss_fn).__name__}(reduction={declared!r}); "
            f"drop loss_reduction (torchspan reads it from the loss) or pass loss_reduction={declared_kind!r}"
        )
    return loss_reduction


def _class_index_loss(loss_fn: Callable[..., Any]) -> tuple[torch.Tensor | None, int] | None:
    """(class weights, ignore_index) for losses whose mean divides by the targets' weight sum."""
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return loss_fn.weight, loss_fn.ignore_index
    if loss_fn is F.cross_entropy or loss_fn is F.nll_loss:
        return None, -100
    return None


def _normalizer(target: Any, weight: torch.Tensor | None, ignore_index: int) -> float | None:
    if not isinstance(target, torch.Tensor) or target.is_floating_point():
        return None  # probability targets: the mean is over samples
    keep = target != ignore_index
    if weight is None:
        return float(keep.sum())
    picked = target[keep]
    return float(weight.detach().to(picked.device)[picked].sum()) if picked.numel() else 0.0


def microbatch_weights(
    loss_fn: Callable[..., Any], targets: Sequence[Any], sizes: Sequence[int], reduction: str
) -> list[float]:
    """The factor for each micro-batch's loss so that their sum is the full-batch loss."""
    if reduction == "sum":
        return [1.0] * len(sizes)
    total = sum(sizes)
    share = [n / total for n in sizes]
    spec = _class_index_loss(loss_fn)
    if spec is None:
        return share
    parts = [_normalizer(t, *spec) for t in targets]
    if any(p is None for p in parts):
        return share
    whole = sum(p for p in parts if p is not None)
    if whole == 0:
        return share  # every target ignored: the full-batch loss is nan on one device, and here too
    return [float(p) / whole for p in parts if p is not None]


def weighted_loss(loss_fn: Callable[..., Any], out: Any, target: Any, weight: float) -> torch.Tensor:
    """``loss_fn(out, target) * weight``; a zero-weight micro-batch (all targets ignored) adds exactly 0.

    (Its own mean would be 0/0 = nan, and nan * 0 is still nan.) Raises ``ValueError`` when
    ``loss_fn`` does not return a scalar.
    """
    if weight == 0.0:
        leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if leaves:
            return sum(t.sum() for t in leaves) * 0.0  # keeps the graph so backward still runs
    loss = loss_fn(out, target)
    if loss.dim() != 0:
        raise ValueError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}; it must return a scalar "
            "(use reduction='mean' or 'sum')"
        )
    return loss * weight

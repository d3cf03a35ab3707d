"""What a data-parallel replica refuses before any work: an opaque loss, BatchNorm, an unknown policy.

``shard_loss`` is the ``LossSpec`` a rank weighs its shard's loss by (``DataParallelReplica.train_step``);
``refuse_batchnorm`` and ``check_policy`` are the replica's constructor checks.

Usage::

    spec = shard_loss(torch.nn.CrossEntropyLoss(ignore_index=0))   # spec.normalizer(target, rows)
    refuse_batchnorm(model); check_policy("bf16", "never", None)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ...schedule import PRECISIONS, RECOMPUTE_MODES
from ..lossweights import LossSpec, describe_loss, loss_spec

__all__ = ["shard_loss", "refuse_batchnorm", "check_policy"]


def shard_loss(
    loss_fn: Callable[..., Any],
    loss_reduction: str | None = None,
    loss_normalizer: Callable[[Any], Any] | None = None,
) -> LossSpec:
    """The ``LossSpec`` a rank weighs its shard's loss by; an opaque loss is refused (``ValueError``).

    Its ``normalizer(target, size)`` is what a mean divides one shard's summed loss by: the
    sample count, or for ``CrossEntropyLoss``/``NLLLoss`` the class weights of the non-ignored
    targets, or ``loss_normalizer(target)``. A loss torchspan cannot read (a lambda, say) must
    declare ``loss_reduction="mean"``/``"sum"`` or ``loss_normalizer=``.
    """
    spec = loss_spec(loss_fn, loss_reduction, loss_normalizer)
    if spec.reduction is None:
        raise ValueError(
            f"loss_fn={describe_loss(loss_fn)} is opaque: torchspan cannot tell whether it sums or "
            "averages, and data-parallel weights depend on it. Pass loss_reduction='mean' or 'sum' to "
            "train_step, or loss_normalizer=callable(target) for a mean over something else (e.g. lambda "
            "y: (y != -100).sum())"
        )
    return spec


def refuse_batchnorm(module: nn.Module) -> None:
    """``ValueError`` naming the first BatchNorm layer whose batch statistics a shard would change."""
    for name, layer in module.named_modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm) and not isinstance(layer, nn.SyncBatchNorm):
            raise ValueError(
                f"layer {name or '(the model)'!r} is {type(layer).__name__}: in data parallel each rank "
                "normalises its own shard with that shard's batch statistics, so the gradients would not "
                "be one device's. Convert it with model = "
                "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model), use GroupNorm/LayerNorm, or pass "
                "per_shard_batchnorm=True to accept per-shard statistics"
            )


def check_policy(precision: str, recompute: str, scaler: Any) -> None:
    """``ValueError`` naming a precision or recompute mode a replica does not know, or fp16 without a
    scaler."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {', '.join(map(repr, PRECISIONS))}")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r} is not one of {', '.join(map(repr, RECOMPUTE_MODES))}")
    if precision == "fp16" and scaler is None:
        raise ValueError(
            "precision='fp16' needs a gradient scaler: pass scaler=torch.amp.GradScaler(device_type) and "
            "step with scaler.step(optimizer); scaler.update() (every rank decides alike: it reads the "
            "all-reduced gradients), or use torchspan.span(model, precision='fp16'), whose plain "
            "optimizer.step() is right"
        )

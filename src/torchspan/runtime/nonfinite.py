"""Non-finite losses: ``train_step`` raises (or warns) when the loss is inf/NaN, before any optimizer step.

``span(..., nonfinite="raise")`` (the default) makes ``train_step`` raise ``NonFiniteLoss`` (a
``FloatingPointError``) when the full-batch loss is inf or NaN, naming the step (this ``Spanned``'s
``train_step`` calls, from 1) and, where one process ran the micro-batches, which of them (a
no-grad re-run of the step's forward, on that rare path only: dropout draws other masks, so a NaN
that only a mask caused may go unnamed). ``nonfinite="warn"`` warns (``RuntimeWarning``) and returns the loss.
The check costs one host sync per step (``loss.isfinite()``). Every rank of a launched job holds the same
full-batch loss, so every rank raises together. With ``precision="fp16"`` a non-finite loss whose gradients
overflowed is the gradient scaler's case: the step is skipped, as ``GradScaler`` skips it, no error.

Usage (``Spanned.train_step`` does this)::

    check_loss(loss, "raise", step=12, locate=lambda: locate(outputs, loss_fn, targets, weights, sizes, "32"))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ..hardware import to_device
from .layercall import autocast_for

__all__ = ["NONFINITE", "NonFiniteLoss", "check_loss", "locate"]

NONFINITE = ("raise", "warn")


class NonFiniteLoss(FloatingPointError):
    """``train_step``'s loss is inf/NaN: ``loss`` (its value) at ``call`` (this ``Spanned``'s ``train_step``
    calls, from 1)."""

    def __init__(self, message: str, loss: float, call: int) -> None:
        super().__init__(message)
        self.loss, self.call = loss, call


def check_loss(
    loss: torch.Tensor, mode: str, step: int, locate: Callable[[], str], skipped: bool = False
) -> None:
    """Raise ``FloatingPointError`` (``mode="raise"``) or warn (``"warn"``) when ``loss`` is inf/NaN;
    ``skipped``: the fp16 scaler drops this step's gradients (not an error)."""
    if skipped or bool(torch.isfinite(loss.detach()).all()):
        return
    try:
        where = locate()
    except Exception:  # noqa: BLE001 - naming the micro-batch is a courtesy; the refusal must still happen
        where = ""
    message = (
        f"train_step call {step}: the loss is {float(loss):g}{where}. Its gradients in .grad are not "
        "finite, so an optimizer step would write inf/NaN into the weights: call optimizer.zero_grad() and "
        "skip this batch, or find the cause (a lower learning rate, gradient clipping with "
        "spanned.clip_grad_norm_, the data). To warn instead of raising: span(..., nonfinite='warn') or "
        "spanned.nonfinite = 'warn'"
    )
    if mode == "warn":
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return
    raise NonFiniteLoss(message, float(loss), step)


def locate(
    outputs: Callable[[], Sequence[Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    targets: Sequence[Any],
    weights: Sequence[float],
    sizes: Sequence[int],
    precision: str,
    shard: int | None = None,
) -> str:
    """``" in micro-batch 2 (rows 6-7) of 4, counted from 0"``: the micro-batches whose own loss is inf/NaN in
    a no-grad re-run of the forward (``outputs()``: one output per micro-batch); ``""`` when none is.
    ``shard``: the data-parallel rank whose shard this batch is (named in the text)."""
    outs = outputs()
    bad = []
    with torch.no_grad():
        for i, (out, target, weight) in enumerate(zip(outs, targets, weights)):
            if weight == 0.0:
                continue
            leaf = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
            device = leaf.device if leaf is not None else torch.device("cpu")
            with autocast_for(device, precision):
                value = loss_fn(out, to_device(target, device))
            if not bool(torch.isfinite(value).all()):
                bad.append(i)
    if not bad:
        return ""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    shown = ", ".join(f"{i} (rows {starts[i]}-{starts[i] + sizes[i] - 1})" for i in bad[:4]) + (
        " ..." if len(bad) > 4 else ""
    )
    whose = f" of rank {shard}'s shard" if shard is not None else ""
    return f" in micro-batch{'es' if len(bad) > 1 else ''} {shown} of {len(sizes)}{whose}, counted from 0"

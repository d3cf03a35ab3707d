"""The last stage's loss in the own-forward rank pipeline (``ownforward``).

The loss function runs under ``MetaTaint``: a loss that reads outputs the last stage does not compute
(meta there: earlier stages' values, an MoE model's aux_loss over every block's router logits) is
refused with what to compute instead, and one that reads another stage's parameter (``model.device``)
sees this rank's device. Torch's own losses (``lossweights.is_torch_loss``) read only their arguments:
given real outputs they run without the mode, which changes nothing for them and costs ~10 us per call
(50 us with cold caches, on the last stage's critical path every micro-batch).

Usage: ``loss = stage_loss(out, target, loss_fn, weight, device, "32")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ...hardware import to_device
from ..layercall import autocast_for
from ..lossweights import is_torch_loss, weighted_loss
from .taint import MetaTaint

__all__ = ["stage_loss"]


def stage_loss(
    out: Any, target: Any, loss_fn: Callable[..., Any], weight: float, device: torch.device, precision: str
) -> torch.Tensor:
    """``weight * loss_fn(out, target)`` on ``device`` under ``precision``'s autocast; ``ValueError`` when it
    reads values only other stages compute."""
    plain = is_torch_loss(loss_fn) and not any(
        isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves(out)
    )
    try:  # the taint rules around the loss function only (a target and the weighing need none)
        with autocast_for(device, precision):
            loss = weighted_loss(
                loss_fn, out, to_device(target, device), weight, calling=None if plain else MetaTaint(device)
            )
    except RuntimeError as exc:
        if "meta" not in str(exc):
            raise
        loss = torch.empty((), device="meta")
    if loss.is_meta:
        raise ValueError(
            "torchspan: the loss reads model outputs that the last pipeline stage does not compute (they "
            "come from earlier stages' layers, or combine several stages' values, as an MoE model's "
            "aux_loss over every block's router logits); compute the loss from the model's final outputs "
            "(e.g. logits)"
        )
    return loss

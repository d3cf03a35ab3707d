"""``torchspan demo --nproc-per-node N --tp T``: the demo model tensor-parallel, and how close it is to one
device.

Each block's MLP is split over ``T`` processes (``TP_PLAN``: its first ``Linear`` column-wise, its second
row-wise, one all-reduce after it; DTensor over the mesh's ``tp`` dimension), the attention and the rest kept
whole (the fused ``qkv`` projection is split by ``split(d)`` in the block, which a column-wise shard would
cut wrongly); with ``N > T`` processes the ``N / T`` tensor-parallel replicas are sharded by FSDP2 over
``dp_shard``. Parity is reported two ways, both against the same model on one device (rank 0's CPU):

- ``gradient_parity``: one step's gradients on a check batch, gathered whole (``full_tensor()``), each against
  the one-device gradient of the whole batch (max abs / rel difference, ``demo.spanning.GradientCheck``);
- ``loss_parity``: plain PyTorch trained on the first global batches of the run, its losses against the run's.

Usage (``demo.ranks`` does this on every rank)::

    spanned = span_ranks(model, world, tp)   # span(model) for data parallel, tp=... for this
    # every rank calls it (gathers); rank 0 keeps the result
    check = gradient_parity(spanned, reference, x, y)
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..parity import grad_difference
from ..runtime import span
from ..runtime.ranks import shard_batch
from .model import lm_loss
from .spanning import GradientCheck

__all__ = ["TP_PLAN", "span_ranks", "gradient_parity", "loss_parity"]

TP_PLAN = {"block*.mlp.0": "colwise", "block*.mlp.2": "rowwise"}  # each block's MLP; attention whole


def span_ranks(model: nn.Module, world: int, tp: int | None) -> Any:
    """This rank's span: a data-parallel replica (``tp`` None), else ``tp`` ranks per layer, FSDP2 over the
    rest."""
    if tp is None:
        spanned = span(model)  # as in a user's script: a launched one-stage span is this rank's replica
        if spanned.mode != "data-parallel":
            raise RuntimeError(
                f"span(model) in a {world}-process job gave mode {spanned.mode!r}, not 'data-parallel'"
            )
        return spanned
    return span(model, tp=tp, tp_plan=TP_PLAN, shard=world > tp)


def gradient_parity(
    spanned: Any,
    reference: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> GradientCheck:
    """One ``train_step`` on this replica's rows of ``(x, y)`` against ``reference`` on all of them; every
    rank gathers the gradients (a collective) and compares; both sides' gradients are cleared afterwards."""
    replica, replicas = spanned.data_parallel
    loss = spanned.train_step(*shard_batch((x, y), replica, replicas), lm_loss, loss_reduction="mean")
    want = lm_loss(reference(x), y)
    want.backward()
    ref = dict(reference.named_parameters())
    diffs = []
    for name, p in spanned.module.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        diffs.append(grad_difference(name, grad, ref[name].grad, atol=atol, rtol=rtol))
    spanned.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    worst = max(diffs, key=lambda d: d.max_abs)
    return GradientCheck(
        device="cpu",
        parameters=len(diffs),
        max_abs=worst.max_abs,
        max_rel=max(d.max_rel for d in diffs),
        loss=float(loss),
        reference_loss=float(want.detach()),
        atol=atol,
        rtol=rtol,
        ok=all(d.within for d in diffs),
        worst=worst.name,
    )


def loss_parity(
    reference: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], losses: list[float], lr: float
) -> dict[str, Any]:
    """Plain PyTorch (AdamW at ``lr``) on one device over ``batches`` (the run's first global batches) from
    ``reference``'s weights: ``{"steps", "losses", "largest_difference"}`` against the run's ``losses``."""
    model = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    plain = []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        plain.append(float(loss))
    largest = max((abs(a - b) for a, b in zip(plain, losses)), default=0.0)
    return {"steps": len(plain), "losses": plain, "largest_difference": largest}

"""Linear layers' weight gradients over several micro-batches as one matrix product.

A linear layer's weight gradient on one micro-batch is ``g.T @ x`` (``g``: the gradient of its output,
``x``: its input, both flattened to rows); over micro-batches it is the sum of those products, which
autograd builds one product, one new tensor and one add into ``.grad`` at a time. Stacking the rows gives
the same sum in one product, ``cat(g).T @ cat(x)``: what one device computes on the whole batch, and much
cheaper when the micro-batches are short next to the weight; long ones are multiplied one at a time into
one buffer (``addmm_``), without the copy that stacking them would cost (``_product``).

``find(node, owner)`` recognises such a node in an autograd graph (``addmm`` with ``alpha = beta = 1``
or ``mm``, the weight reached through ``t()`` alone or multiplied as stored, as GPT-2's ``Conv1D`` does, the
bias a 1-D leaf; either may be cast first, as
autocast does, and its gradient is then cast back once, after the product) and returns a ``Linear``
holding its input; ``gradients(records)`` sums the records of each layer's parameters: the leaves and
their gradients, which the caller adds into ``.grad`` through the leaves' own accumulators
(``splitgrad.weights_together``: one engine call, hooks on the parameters fire).

Usage::

    lin = find(node, None)          # on an AddmmBackward0 / MmBackward0, else None
    leaves, grads = gradients([(lin, g1), (lin2, g2)])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Linear", "find", "leaves", "gradients"]


@dataclass(frozen=True)
class Linear:
    """One linear call in a graph: its weight and bias leaves, its input rows ``x`` (2-D), the accumulator
    nodes its weight and bias gradients would flow into, and whether the weight is stored ``(in, out)``
    and multiplied as it is (``transposed``: GPT-2's ``Conv1D``, ``addmm(b, x, w)``) instead of ``x @
    w.t()``."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    x: torch.Tensor
    accumulators: frozenset[Any]
    transposed: bool = False


def _leaf(node: Any, owner: dict[Any, int] | None) -> torch.Tensor | None:
    """The parameter behind an accumulator node, or behind a cast of it (autocast's copy of a weight in
    another dtype: ``ToCopyBackward0``); ``owner``: the parameters' accumulators (``None``: any leaf)."""
    if node is not None and type(node).__name__ == "ToCopyBackward0" and len(node.next_functions) == 1:
        node = node.next_functions[0][0]
    if node is None or node.next_functions or not hasattr(node, "variable"):
        return None
    if owner is not None and node not in owner:
        return None
    return node.variable


def find(node: Any, owner: dict[Any, int] | None) -> Linear | None:
    """``node`` as a ``Linear`` when it is one (see the module docstring), else ``None``."""
    name = type(node).__name__
    if name == "AddmmBackward0":
        if node._saved_alpha != 1 or node._saved_beta != 1:
            return None
        (bias_fn, _), _, (t_fn, _) = node.next_functions
        x = node._saved_mat1
    elif name == "MmBackward0":
        bias_fn = None
        _, (t_fn, _) = node.next_functions
        x = node._saved_self
    else:
        return None
    if t_fn is None:
        return None
    transposed = type(t_fn).__name__ != "TBackward0"  # the weight multiplied as stored (Conv1D), or via t()
    if not transposed and len(t_fn.next_functions) != 1:
        return None
    acc = t_fn if transposed else t_fn.next_functions[0][0]
    weight = _leaf(acc, owner)
    if weight is None or weight.dim() != 2 or x is None or x.dim() != 2 or not x.is_floating_point():
        return None
    bias = None
    if bias_fn is not None:
        bias = _leaf(bias_fn, owner)
        if bias is None or bias.dim() != 1:
            return None
    accs = frozenset(_accumulator(a) for a in (acc, bias_fn) if a is not None)
    return Linear(weight, bias, x, accs, transposed)


def _accumulator(node: Any) -> Any:
    """The accumulator itself behind a cast node (see ``_leaf``)."""
    return node.next_functions[0][0] if type(node).__name__ == "ToCopyBackward0" else node


def _as(grad: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    return (
        grad
        if grad.dtype == leaf.dtype and grad.device == leaf.device
        else grad.to(device=leaf.device, dtype=leaf.dtype)
    )


def _product(
    xs: list[torch.Tensor], gs: list[torch.Tensor], transposed: bool, dtype: torch.dtype
) -> torch.Tensor:
    """``sum_i g_i.T @ x_i`` (``x_i.T @ g_i`` when ``transposed``): one product of the stacked rows when the
    micro-batches are short next to the weight (a product of few rows is inefficient, and stacking them is
    cheap) or computed in a lower precision than the weight's ``dtype`` (one rounding, as one device), else
    one product per micro-batch added into the first in place (stacking long micro-batches costs a copy of
    their activations and gains nothing). Measured on a CPU: stacking wins below ``min(in, out) / 16``
    rows."""
    short = 16 * max(x.shape[0] for x in xs) < min(xs[0].shape[1], gs[0].shape[1])
    if len(xs) > 1 and (short or xs[0].dtype != dtype):
        x, g = torch.cat(xs), torch.cat(gs)
        return x.t().mm(g) if transposed else g.t().mm(x)
    pairs = [(x.t(), g) if transposed else (g.t(), x) for x, g in zip(xs, gs)]
    out = pairs[0][0].mm(pairs[0][1])
    for a, b in pairs[1:]:
        out.addmm_(a, b)
    return out


_Weights = dict[tuple[int, bool], tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]
_Biases = dict[int, tuple[torch.Tensor, list[torch.Tensor]]]


def _grouped(records: Sequence[tuple[Linear, torch.Tensor]]) -> tuple[_Weights, _Biases]:
    """The records by weight (and how it is multiplied): its inputs and output gradients; by bias (each
    record's own: a weight may have several): its output gradients. Their order is the order of ``leaves`` and
    ``gradients``."""
    by_weight: _Weights = {}
    by_bias: _Biases = {}
    for lin, g in records:
        _, xs, gs = by_weight.setdefault((id(lin.weight), lin.transposed), (lin.weight, [], []))
        xs.append(lin.x)
        gs.append(g)
        if lin.bias is not None:
            by_bias.setdefault(id(lin.bias), (lin.bias, []))[1].append(g)
    return by_weight, by_bias


def leaves(records: Sequence[tuple[Linear, torch.Tensor]]) -> list[torch.Tensor]:
    """The leaves ``gradients(records)`` returns gradients for, in the same order (without computing them)."""
    by_weight, by_bias = _grouped(records)
    return [w for w, _, _ in by_weight.values()] + [b for b, _ in by_bias.values()]


def gradients(
    records: Sequence[tuple[Linear, torch.Tensor]],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every record's weight (and bias) gradient, summed over the records of each leaf: one product per weight
    over all its records' rows (``g``: the gradient flowing into the linear call's output, 2-D). Returns the
    leaves and their gradients (a weight used both ways is listed twice: accumulating adds the two).

    Usage: ``leaves, grads = gradients([(lin, g) for lin, g in recorded])``.
    """
    by_weight, by_bias = _grouped(records)
    held: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for (_, transposed), (weight, xs, gs) in by_weight.items():
        held.append(weight)
        grads.append(
            _as(_product(xs, gs, transposed, weight.dtype), weight)
        )  # in the compute dtype, cast once, as one device does
    for (
        bias,
        gs,
    ) in by_bias.values():  # in the weight's dtype: each micro-batch's sum, then theirs (no copy of the rows)
        held.append(bias)
        whole = (
            len(gs) == 1 or gs[0].dtype != bias.dtype
        )  # lower precision: one sum over all rows, as one device
        grads.append(
            _as(
                (gs[0] if len(gs) == 1 else torch.cat(gs)).sum(0)
                if whole
                else torch.stack([g.sum(0) for g in gs]).sum(0),
                bias,
            )
        )
    return held, grads

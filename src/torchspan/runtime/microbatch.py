"""Split a batch into micro-batches on dim 0 and put outputs back together.

Every tensor inside the arguments (also inside lists, tuples and dicts) is split on dim 0; all of
them must have the batch size there. Wrap a tensor that is the same for every sample (an attention
mask, a class-weight table) in ``NoSplit`` to hand it unchanged to every micro-batch. Other values
(``None``, flags, numbers) are passed to every micro-batch as they are.

Usage::

    chunks = split_batch((x,), {"mask": NoSplit(mask)}, 4)   # -> list of (args, kwargs)
    out = gather([model(*a, **k) for a, k in chunks], device)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["NoSplit", "batch_size", "split_sizes", "split_batch", "split_value", "gather"]


@dataclass(frozen=True)
class NoSplit:
    """A value given whole to every micro-batch instead of being split on dim 0."""

    value: Any


def _is_leaf(x: Any) -> bool:
    return isinstance(x, NoSplit)


def batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Dim 0 of the first tensor in ``args``/``kwargs``; ``ValueError`` if there is none."""
    for leaf in tree_flatten((args, kwargs), is_leaf=_is_leaf)[0]:
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise ValueError(
                    "the first tensor argument is 0-dimensional, so it has no batch dimension to split; "
                    "pass batched tensors (dim 0 = samples) or wrap per-call constants in torchspan.runtime.NoSplit"
                )
            return int(leaf.shape[0])
    raise ValueError("no tensor in the arguments, so there is no batch to split into micro-batches; pass the batch as a tensor")


def split_sizes(total: int, microbatches: int) -> list[int]:
    """Sizes of the micro-batches ``torch.tensor_split`` makes: as even as possible, larger first."""
    if microbatches > total:
        raise ValueError(
            f"microbatches={microbatches} is more than the batch size {total}; every micro-batch needs at "
            f"least one sample. Use microbatches <= {total}"
        )
    base, extra = divmod(total, microbatches)
    return [base + (1 if i < extra else 0) for i in range(microbatches)]


def split_value(value: Any, microbatches: int, total: int, *, name: str = "input") -> list[Any]:
    """``value`` split into ``microbatches`` pieces on dim 0 (see the module doc)."""
    leaves, spec = tree_flatten(value, is_leaf=_is_leaf)
    pieces: list[list[Any]] = [[] for _ in range(microbatches)]
    for j, leaf in enumerate(leaves):
        if isinstance(leaf, NoSplit):
            parts = [leaf.value] * microbatches
        elif isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0 or leaf.shape[0] != total:
                shape = tuple(leaf.shape)
                raise ValueError(
                    f"{name}: tensor #{j} has shape {shape}, but the batch size is {total}; every tensor is split "
                    f"on dim 0 into micro-batches. Give it dim 0 = {total}, or wrap it in "
                    "torchspan.runtime.NoSplit(tensor) to pass it whole to every micro-batch"
                )
            parts = list(torch.tensor_split(leaf, microbatches, dim=0))
        else:
            parts = [leaf] * microbatches
        for i in range(microbatches):
            pieces[i].append(parts[i])
    return [tree_unflatten(p, spec) for p in pieces]


def split_batch(args: tuple[Any, ...], kwargs: dict[str, Any], microbatches: int) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """``(args, kwargs)`` of each micro-batch; uneven batches give larger micro-batches first."""
    total = batch_size(args, kwargs)
    split_sizes(total, microbatches)
    return [(tuple(a), dict(k)) for a, k in split_value((list(args), kwargs), microbatches, total, name="inputs")]


def gather(outputs: list[Any], device: torch.device | None = None) -> Any:
    """Concatenate micro-batch outputs on dim 0 (on ``device`` if given), keeping their structure.

    Non-tensor values must agree across micro-batches (the first is returned).
    """
    flat = [tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    for leaves, sp in flat[1:]:
        if sp != spec:
            raise ValueError("micro-batch outputs have different structures, so they cannot be concatenated")
    merged: list[Any] = []
    for j, first in enumerate(flat[0][0]):
        column = [leaves[j] for leaves, _ in flat]
        if isinstance(first, torch.Tensor):
            if first.dim() == 0:
                raise ValueError(
                    f"output #{j} is a 0-dimensional tensor (e.g. a loss computed inside forward); micro-batch "
                    "outputs are concatenated on dim 0, so return per-sample values, or compute the loss with "
                    "spanned.train_step(inputs, target, loss_fn)"
                )
            if device is not None:
                column = [t.to(device) for t in column]
            merged.append(torch.cat(column, dim=0))
        else:
            merged.append(first)
    return tree_unflatten(merged, spec)

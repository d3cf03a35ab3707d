"""Split a batch into micro-batches on dim 0 and put outputs back together.

Every tensor inside the arguments (also inside lists, tuples, dicts and dataclasses) whose dim 0 is
the batch size is split on dim 0. A 0-dimensional tensor, or one whose dim 0 is 1 (it broadcasts
over the batch, e.g. ``position_ids`` of shape ``(1, T)``), goes whole to every micro-batch; any
other size is refused (wrap a tensor that is the same for every sample, such as a class-weight
table, in ``NoSplit`` to hand it unchanged to every micro-batch). Other values (``None``, flags,
numbers, ``use_cache=False``) are passed to every micro-batch as they are. Outputs are gathered
back into their own type: tensors concatenated, dicts, tuples, named tuples, dataclasses and
``transformers`` ``ModelOutput``s rebuilt as the same class.

Usage::

    chunks = split_batch((x,), {"mask": NoSplit(mask)}, 4)   # -> list of (args, kwargs)
    out = gather([model(*a, **k) for a, k in chunks], device)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["NoSplit", "call_args", "batch_size", "split_sizes", "split_batch", "split_value", "gather"]


@dataclass(frozen=True)
class NoSplit:
    """A value given whole to every micro-batch instead of being split on dim 0."""

    value: Any


def _is_leaf(x: Any) -> bool:
    return isinstance(x, NoSplit)


def call_args(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """How ``train_step`` reads its ``inputs``: a tuple is positional arguments, a mapping keyword
    arguments, anything else the one argument. Usage: ``args, kwargs = call_args({"input_ids": ids})``."""
    if isinstance(inputs, tuple):
        return inputs, {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    return (inputs,), {}


def batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Dim 0 of the first tensor in ``args``/``kwargs``; ``ValueError`` if there is none."""
    first = args[0] if args else None
    if isinstance(first, torch.Tensor) and first.dim() > 0:  # the usual call: no walk over the arguments
        return int(first.shape[0])
    for leaf in tree_flatten((args, kwargs), is_leaf=_is_leaf)[0]:
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise ValueError(
                    "the first tensor argument is 0-dimensional, so it has no batch dimension to split; "
                    "pass batched tensors (dim 0 = samples) or wrap per-call constants in "
                    "torchspan.runtime.NoSplit"
                )
            return int(leaf.shape[0])
    raise ValueError(
        "no tensor in the arguments, so there is no batch to split into micro-batches; pass the batch as a "
        "tensor"
    )


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
    if isinstance(value, torch.Tensor):  # a lone tensor (the usual target): no pytree walk
        return _split_leaf(value, 0, microbatches, total, name)
    leaves, spec = tree_flatten(value, is_leaf=_is_leaf)
    pieces: list[list[Any]] = [[] for _ in range(microbatches)]
    for j, leaf in enumerate(leaves):
        parts = _split_leaf(leaf, j, microbatches, total, name)
        for i in range(microbatches):
            pieces[i].append(parts[i])
    return [tree_unflatten(p, spec) for p in pieces]


def _split_leaf(leaf: Any, j: int, microbatches: int, total: int, name: str) -> list[Any]:
    """The ``microbatches`` pieces of leaf ``#j`` of ``name``: split on dim 0, or the same value for every
    piece."""
    if isinstance(leaf, NoSplit):
        return [leaf.value] * microbatches
    if isinstance(leaf, torch.Tensor) and (leaf.dim() == 0 or (leaf.shape[0] == 1 and total > 1)):
        return [leaf] * microbatches  # no batch dimension, or one that broadcasts: the same for every sample
    if isinstance(leaf, torch.Tensor):
        if leaf.shape[0] != total:
            shape = tuple(leaf.shape)
            raise ValueError(
                f"{name}: tensor #{j} has shape {shape}, but the batch size is {total}; every tensor is "
                f"split on dim 0 into micro-batches. Give it dim 0 = {total}, or wrap it in "
                "torchspan.runtime.NoSplit(tensor) to pass it whole to every micro-batch"
            )
        return list(torch.tensor_split(leaf, microbatches, dim=0))
    return [leaf] * microbatches


def split_batch(
    args: tuple[Any, ...], kwargs: dict[str, Any], microbatches: int
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """``(args, kwargs)`` of each micro-batch; uneven batches give larger micro-batches first."""
    total = batch_size(args, kwargs)
    split_sizes(total, microbatches)
    if not kwargs and all(type(a) is torch.Tensor for a in args):  # tensors only: split each, no pytree walk
        columns = [_split_leaf(a, j, microbatches, total, "inputs") for j, a in enumerate(args)]
        return [(tuple(c[i] for c in columns), {}) for i in range(microbatches)]
    return [
        (tuple(a), dict(k)) for a, k in split_value((list(args), kwargs), microbatches, total, name="inputs")
    ]


def gather(
    outputs: list[Any], device: torch.device | None = None, *, scalars: str = "refuse", loss: Any = None
) -> Any:
    """Concatenate micro-batch outputs on dim 0 (on ``device`` if given), keeping their structure and types.

    Non-tensor values must agree across micro-batches (the first is returned). A 0-dimensional
    tensor (a loss computed inside forward) cannot be concatenated: ``scalars="refuse"`` raises,
    ``"drop"`` leaves ``None`` in its place; ``loss(values)``, when given, combines the ``loss``
    fields of ``ModelOutput``s and dicts (the model's own loss, weighed exactly: ``modelloss``).
    """
    return _merge(list(outputs), device, "output", scalars, loss)


def _merge(
    column: list[Any], device: torch.device | None, where: str, scalars: str = "refuse", loss: Any = None
) -> Any:
    first = column[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            if len(column) == 1:  # one micro-batch: its value is the batch's
                return first if device is None else first.to(device)
            if where.endswith((".loss", "['loss']")) and loss is not None:
                return loss(column)
            if scalars == "drop":
                return None
            raise ValueError(
                f"{where} is a 0-dimensional tensor (e.g. a loss computed inside forward); micro-batch "
                "outputs are concatenated on dim 0, so return per-sample values; to train on the model's "
                "own loss call spanned.train_step(batch) with labels in the batch, or "
                "spanned.train_step(inputs, target, loss_fn)"
            )
        if device is not None:
            column = [t.to(device) for t in column]
        return column[0] if len(column) == 1 else torch.cat(column, dim=0)  # one micro-batch: no copy
    if any(type(o) is not type(first) for o in column[1:]):
        raise ValueError(
            f"micro-batch outputs have different structures at {where}, so they cannot be concatenated"
        )
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        # dataclasses and transformers ModelOutputs: the same class, field by field (None fields stay None)
        fields = {f.name: getattr(first, f.name) for f in dataclasses.fields(first) if f.init}
        merged = {
            k: (
                None
                if v is None
                else _merge([getattr(o, k) for o in column], device, f"{where}.{k}", scalars, loss)
            )
            for k, v in fields.items()
        }
        return dataclasses.replace(first, **merged)
    if isinstance(first, Mapping):
        if any(list(o.keys()) != list(first.keys()) for o in column[1:]):
            raise ValueError(
                f"micro-batch outputs have different keys at {where}, so they cannot be concatenated"
            )
        items = {k: _merge([o[k] for o in column], device, f"{where}[{k!r}]", scalars, loss) for k in first}
        return type(first)(items) if type(first) is not dict else items
    if isinstance(first, (tuple, list)):
        if any(len(o) != len(first) for o in column[1:]):
            raise ValueError(
                f"micro-batch outputs have different structures at {where}, so they cannot be concatenated"
            )
        parts = [
            _merge([o[i] for o in column], device, f"{where}[{i}]", scalars, loss) for i in range(len(first))
        ]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*parts)
        return type(first)(parts)
    return first

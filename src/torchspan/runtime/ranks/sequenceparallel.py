"""Sequence parallel beside tensor parallel: norms and dropout on a sequence shard, the layouts around them
kept right.

A ``tp_plan`` naming ``"sequence_parallel"`` modules (``runtime.ranks.tensorparallel``) runs Megatron-LM's
sequence parallelism (Korthikanti et al. 2022) as torchtitan lays it out: between the tensor-parallel halves
of a block, the residual stream is a ``DTensor`` sharded on the sequence dimension (``Shard(1)``), so each
rank normalizes ``1/tp`` of the tokens and keeps ``1/tp`` of those activations; a ``"rowwise"`` projection
reduce-scatters into that stream (``RowwiseParallel(output_layouts=Shard(1))``) in place of its all-reduce, a
``"colwise"`` one all-gathers its input from it. Torch's ``SequenceParallel`` does the norms (its weights
replicated ``DTensor``s).

Torch's styles read a plain tensor as the layout they declare, which would take a whole activation for a shard
(or a shard for a whole one) without a word. Here a plain tensor always means the whole, replicated
activation, and a ``DTensor`` carries its own layout; hooks (``register_forward_pre_hook``, public) keep every
boundary explicit:

- ``"sequence_parallel"`` modules: a plain input is split on the sequence (a slice, no communication); their
  weights' gradients, each rank's partial sums over its tokens, are all-reduced as they arrive (``.grad``
  whole);
- ``"colwise"`` modules: a ``DTensor`` input is gathered (``Replicate``) first: one all-gather per projection;
- the block holding the norms (the deepest parent of ``"sequence_parallel"`` modules: a decoder layer, or the
model
  itself): its first tensor argument enters the stream as ``Shard(1)``, so its residual adds are ``DTensor``
  sums;
- a module outside the plan that holds parameters (a tied head, an unplanned norm) and the model's outputs:
every
  ``DTensor`` gathered into the whole plain tensor (``full_tensor()``), so the loss and the logits are one
  device's.

The sequence length need not divide by ``tp`` (``DTensor`` shards unevenly as ``torch.chunk`` does).

Usage (``parallelize`` does this)::

    sequence_hooks(model, styles, mesh)     # after parallelize_module(model, mesh, styles)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["SEQUENCE_DIM", "sequence_hooks", "sequence_blocks", "gathered"]

SEQUENCE_DIM = 1  # (batch, sequence, features), as torch's SequenceParallel and transformers' models


def sequence_blocks(sequence_names: list[str]) -> list[str]:
    """The deepest parents of the ``"sequence_parallel"`` modules (``""``: the model): where the stream is
    split."""
    parents = {name.rpartition(".")[0] for name in sequence_names}
    return sorted(
        p for p in parents if not any(q != p and (p == "" or q.startswith(p + ".")) for q in parents)
    )


def gathered(value: Any) -> Any:
    """``value`` with every ``DTensor`` inside (tuples, lists, dicts, transformers' outputs) its whole plain
    tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(gathered(v) for v in value)
    if isinstance(value, tuple):  # a namedtuple
        return type(value)(*(gathered(v) for v in value))
    if isinstance(value, Mapping) and hasattr(value, "__setitem__"):
        for key in list(value.keys()):
            value[key] = gathered(value[key])  # type: ignore[index]
    return value


def sequence_hooks(model: nn.Module, styles: Mapping[str, Any], mesh: Any) -> list[str]:
    """Install the boundary hooks of a sequence-parallel plan (module docstring); returns the blocks that
    split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    sequence = [n for n, s in styles.items() if isinstance(s, SequenceParallel)]
    for name, style in styles.items():
        module = model.get_submodule(name)
        if isinstance(style, ColwiseParallel):
            module.register_forward_pre_hook(_gather_input, prepend=True)
        elif isinstance(style, SequenceParallel):
            module.register_forward_pre_hook(_Split(mesh), prepend=True)
            for param in module.parameters():  # replicated by SequenceParallel; its gradient a partial sum
                param.register_hook(_replicated)
    blocks = sequence_blocks(sequence)
    for name in blocks:
        model.get_submodule(name).register_forward_pre_hook(_Split(mesh), prepend=True, with_kwargs=True)
    planned = tuple(styles)
    for name, module in model.named_modules():
        inside = any(name == p or name.startswith(p + ".") for p in planned)
        if name and not inside and any(True for _ in module.parameters(recurse=False)):
            module.register_forward_pre_hook(_gather_arguments, with_kwargs=True)
    model.register_forward_hook(_gather_output)
    return blocks


class _Split:
    """Pre-hook: the first tensor argument (or ``hidden_states=``) as a ``DTensor`` sharded on the sequence; a
    plain tensor is the whole activation (``Replicate``), sliced; a ``DTensor`` is redistributed from its own
    layout."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh

    def _split(self, x: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not isinstance(x, torch.Tensor):
            return x
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        target = (Shard(SEQUENCE_DIM),)
        return x if tuple(x.placements) == target else x.redistribute(self.mesh, target)

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        if args:
            args = (self._split(args[0]), *args[1:])
        elif kwargs and "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": self._split(kwargs["hidden_states"])}
        return (args, kwargs) if kwargs is not None else args


def _replicated(grad: Any) -> Any:
    """Gradient hook of a sequence-parallel norm's weight: each rank's sum over its tokens (``Partial``)
    all-reduced into the whole gradient (``Replicate``, as the weight), before ``.grad`` holds it
    (Megatron-LM's all-reduce)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        return grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
    return grad


def _gather_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Pre-hook of a column-wise projection: a sequence-sharded ``DTensor`` input gathered (``Replicate``)
    first."""
    from torch.distributed.tensor import DTensor, Replicate

    x = args[0] if args else None
    if isinstance(x, DTensor) and any(not p.is_replicate() for p in x.placements):
        return (x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim), *args[1:])
    return args


def _gather_arguments(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """Pre-hook of a module outside the plan: its ``DTensor`` arguments as whole plain tensors."""
    return gathered(args), {k: gathered(v) for k, v in kwargs.items()}


def _gather_output(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook of the model: its outputs whole plain tensors (the loss and logits one device's)."""
    return gathered(output)

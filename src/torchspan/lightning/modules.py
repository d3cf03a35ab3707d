"""Which module of a LightningModule torchspan spans, how it is swapped in, and moving what is around it.

The LightningModule stays what Lightning calls (``training_step``, hooks, logging); the one module holding
every trainable parameter (``self.model``, found, or named: ``SpanStrategy(module="backbone")``) is replaced
by its ``Spanned``, so ``self(x)`` inside ``training_step`` returns the spanned outputs and the plain loop's
contract applies to ``self.criterion(self(x), y)``. Plain torch, no Lightning import.

Usage::

    path = module_path(lm, "SpanStrategy", None)    # "model"
    swap_in(lm, path, spanned)
    move_around(lm, spanned, device)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["module_path", "swap_in", "move_around", "load_around"]


def _trainable(module: nn.Module, recurse: bool = True) -> list[str]:
    return [n for n, p in module.named_parameters(recurse=recurse) if p.requires_grad]


def module_path(lm: nn.Module, owner: str, name: str | None) -> str:
    """The dotted name of the module to span: ``name``, else the one child holding every trainable parameter.

    Every trainable parameter must be inside it: one outside the span would train on this rank's rows only."""
    kind = type(lm).__name__
    if name is None:
        holders = [n for n, child in lm.named_children() if _trainable(child)]
        if len(holders) != 1 or _trainable(lm, recurse=False):
            where = ", ".join(holders + _trainable(lm, recurse=False)) or "none of its modules"
            raise ValueError(
                f"{owner} spans the one module of the LightningModule that holds every trainable "
                f"parameter; {kind} holds them in {where}: put them in one module (self.model = "
                "nn.Sequential(...)) and call it in forward, or name the module to span: "
                f"{owner}(module='model')"
            )
        return holders[0]
    try:
        inner = lm.get_submodule(name)
    except AttributeError:
        children = ", ".join(n for n, _ in lm.named_children())
        raise ValueError(
            f"{owner}(module={name!r}): {kind} has no module {name!r}; its modules: {children}"
        ) from None
    inside = {id(p) for p in inner.parameters()}
    outside = [n for n, p in lm.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise ValueError(
            f"{owner}(module={name!r}): {kind} trains parameters outside it ({', '.join(outside[:3])}), "
            "which would see this rank's rows only; span the module that holds every trainable parameter"
        )
    return name


def _owner(lm: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, attr = path.rpartition(".")
    return (lm.get_submodule(parent) if parent else lm), attr


def swap_in(lm: nn.Module, path: str, spanned: nn.Module) -> None:
    """``lm.<path> = spanned``: ``lm(x)`` now runs the span."""
    owner, attr = _owner(lm, path)
    setattr(owner, attr, spanned)


def inner(lm: nn.Module, path: str) -> nn.Module:
    owner, attr = _owner(lm, path)
    return getattr(owner, attr)


def move_around(module: nn.Module, spanned: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for everything but ``spanned`` (torchspan owns its placement)."""
    for key, buf in module._buffers.items():
        if buf is not None:
            module._buffers[key] = buf.to(device)
    for child in module.children():
        if child is spanned:
            continue
        if any(m is spanned for m in child.modules()):
            move_around(child, spanned, device)
        else:
            child.to(device)


def load_around(lm: nn.Module, path: str, spanned: Any, state: dict[str, Any], strict: bool) -> None:
    """``lm.load_state_dict(state)`` with the span's keys loaded by ``spanned.load_state_dict`` (full tensors,
    each rank keeping its shard when sharded) and the rest (a loss's class weights) by the LightningModule."""
    prefix = path + "."
    spanned.load_state_dict(
        {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, strict=strict
    )
    rest = {k: v for k, v in state.items() if not k.startswith(prefix)}
    missing, unexpected = lm.load_state_dict(rest, strict=False)
    missing = [k for k in missing if not k.startswith(prefix)]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"loading {type(lm).__name__}'s state: missing keys {missing[:5]}, unexpected keys "
            f"{unexpected[:5]} (the checkpoint was written for another model)"
        )

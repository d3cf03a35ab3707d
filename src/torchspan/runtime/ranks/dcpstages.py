"""Sharded checkpoints of a pipeline across ranks (plain, with replicas, or 3-D with tensor-parallel stages).

A pipeline rank's model holds only its stage: the other stages' entries are ``meta``. Each rank saves its own
stage's entries under the model's own keys (``ranks.dcp``): ``meta`` entries are left out, a ``tp`` split
entry stays a ``DTensor`` (DCP stores its shards), and what several ranks hold alike (a stage's replicas, the
``tp`` ranks' copies of a whole entry, a parameter tied across stages and its optimizer moments) is written
once, by the lowest rank holding it, after every copy is checked equal byte for byte (a copy that differs is
a ``ValueError`` naming the key: nothing is written). The ``.metadata`` lists the keys in the model's own
order, so one plain process reads the folder back as the model's full state dict.

Usage (``dcp.save_folder`` does this when a model in the state holds ``meta`` tensors)::

    saved = {"model": stage_state(module), "optimizer": held_optimizer_state(osd)}
    planner = owner_planner(saved, key_order(parts))   # a collective: every rank calls it
    dcp.save(saved, storage_writer=writer, planner=planner)
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.planner import SavePlan
from torch.utils._pytree import tree_leaves

__all__ = ["holds_meta", "held_optimizer_state", "owner_planner", "stage_state"]

_Index = tuple[str, tuple[int, ...]]


def holds_meta(module: nn.Module) -> bool:
    """Whether ``module`` holds ``meta`` tensors (a pipeline rank: other stages' layers)."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def stage_state(module: nn.Module) -> dict[str, Any]:
    """``module``'s state dict without its ``meta`` entries: this rank's stage, split ones as ``DTensor``."""
    return {k: v for k, v in module.state_dict().items() if not v.is_meta}


def held_optimizer_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (``get_optimizer_state_dict``) without the entries of
    parameters this rank holds as ``meta``."""
    out = dict(state)
    out["state"] = {
        name: moments
        for name, moments in state.get("state", {}).items()
        if not any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves(moments))
    }
    return out


def _index(fqn: str, t: torch.Tensor) -> _Index:
    """The index DCP writes ``t`` under: its name and the offset of this rank's chunk."""
    if hasattr(t, "device_mesh") and hasattr(t, "placements"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1]
        return fqn, tuple(int(o) for o in offset)
    return fqn, (0,) * t.dim()


def _digest(t: torch.Tensor) -> str:
    local = t.to_local() if hasattr(t, "to_local") else t
    data = local.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return f"{local.dtype}:{tuple(local.shape)}:" + hashlib.blake2b(data.numpy().tobytes()).hexdigest()


class _OwnerPlanner(DefaultSavePlanner):
    """DCP's default save planner that writes only the chunks this rank owns and records ``mapping`` (every
    rank's keys in the model's order) as the plan's key order."""

    def __init__(self, drop: set[_Index], mapping: dict[str, Any]) -> None:
        super().__init__()
        self._drop, self._mapping = drop, mapping

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()  # DCP's own plan of every item this rank holds
        items = [
            item
            for item in plan.items
            if item.index.offset is None or (item.index.fqn, tuple(item.index.offset)) not in self._drop
        ]
        self.plan = dataclasses.replace(plan, items=items, planner_data=dict(self._mapping))
        return self.plan


def owner_planner(saved: dict[str, Any], rank_of_key: Any, required: list[str]) -> DefaultSavePlanner:
    """The planner for a pipeline's save (a collective: every rank calls it with its own ``saved``).

    ``rank_of_key(path)`` sorts a flattened key's path (``("model", "0.weight")``) into the model's order.
    Every chunk held by several ranks is compared by digest and kept on the lowest of them; a copy that
    differs, or a ``required`` key (the models' entries, flattened) that every rank holds as ``meta``, is a
    ``ValueError`` on every rank.
    """
    flat, mapping = flatten_state_dict(saved)
    mine = {
        _index(fqn, t): _digest(t) for fqn, t in flat.items() if isinstance(t, torch.Tensor) and not t.is_meta
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, mapping))
    owner: dict[_Index, tuple[int, str]] = {}
    merged: dict[str, Any] = {}
    for r, (chunks, paths) in enumerate(everyone):
        for index, digest in chunks.items():
            first = owner.setdefault(index, (r, digest))
            if first[1] != digest:
                raise ValueError(
                    f"save_checkpoint: {index[0]!r} differs between rank {first[0]} and rank {r}, which "
                    "hold the same copy of it (a stage's replicas, the tp ranks of a whole entry, or a "
                    "parameter tied across stages); nothing was written: the copies drifted apart, so "
                    "neither is the model's state"
                )
        for fqn, path in paths.items():
            merged.setdefault(fqn, path)
    lost = [fqn for fqn in required if fqn not in merged]
    if lost:
        raise ValueError(
            f"save_checkpoint: {', '.join(map(repr, lost[:3]))}{' ...' if len(lost) > 3 else ''} "
            "held as meta on every rank (no stage holds it), so the checkpoint would lack it; nothing was "
            "written: load or materialise those weights before saving"
        )
    me = dist.get_rank()
    drop = {index for index in mine if owner[index][0] != me}
    appearance = {fqn: i for i, fqn in enumerate(merged)}
    ordered = sorted(merged, key=lambda fqn: (rank_of_key(merged[fqn]), appearance[fqn]))
    return _OwnerPlanner(drop, {fqn: merged[fqn] for fqn in ordered})


def key_order(order: list[str], models: Mapping[str, nn.Module], owners: Mapping[str, str]) -> Any:
    """A sort key for flattened paths: the state's keys as given, each model's entries in its own order (the
    ``meta`` ones included), each optimizer's moments in its model's parameter order, the rest after."""
    last = 1 << 30
    tops = {k: i for i, k in enumerate(order)}
    names = {k: {n: i for i, n in enumerate(m.state_dict())} for k, m in models.items()}

    def rank_of(path: tuple[Any, ...]) -> tuple[int, int]:
        top = str(path[0])
        within = last
        if top in names and len(path) > 1:
            within = names[top].get(".".join(map(str, path[1:])), last)
        elif top in owners and len(path) > 2 and path[1] == "state":
            within = names[owners[top]].get(str(path[2]), last)
        return tops.get(top, last), within

    return rank_of


def require_held(key: str, module: nn.Module) -> None:
    """Refuse (on every rank: a collective) loading into a model some of whose entries every rank holds as
    ``meta``: no rank would load them."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, set(stage_state(module)))
    lost = [name for name in module.state_dict() if not any(name in held for held in every)]
    if lost:
        raise ValueError(
            f"load_checkpoint: the model under {key!r} holds {', '.join(map(repr, lost[:3]))}"
            f"{' ...' if len(lost) > 3 else ''} as meta on every rank (no stage holds it), so no rank would "
            "load it; materialise the model first (model.to_empty(device='cpu'))"
        )

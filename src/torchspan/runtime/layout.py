"""Layers to stages: what ``span`` cuts a model into, how it will run it, and on which devices.

``layout(model, plan, devices, balance, ...)`` finds the model's layers (blocks inside containers,
or top-level children), how its forward can be cut (``"sequential"``, ``"fx"``, or its own forward:
``"own-forward"``), whether this process is one stage of a pipeline across ranks, and the layer
groups and devices of the stages. It returns a ``Layout`` (data); ``runtime.choose`` picks the
executor that runs it.

Usage: ``lay = layout(model, None, devices=["cpu", "cpu"], balance=[2, 2])``; ``lay.groups``, ``lay.mode``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..layers import LayerSet, discovery, reuse
from ..layers import fxsplit as split
from ..planner.plans import Plan
from .placement import check_entries, parse_devices, stages_from_balance, stages_from_plan
from .ranks.env import RankInfo
from .ranks.mesh import Mesh, launched_stages
from .ranks.pipelined import launched_mesh

__all__ = ["Layout", "layout"]


@dataclass
class Layout:
    """A model's stages: ``groups[s]`` (layer names) on ``devices[s]``, run the ``mode`` way.

    ``why``: the reason for the mode; ``graph``: the fx graph (mode ``"fx"``); ``layer_set``: the
    blocks (own forward of a model with blocks; else ``None``); ``ranked``: ``(mesh, rank info)`` when
    this process is one stage of a pipeline across ranks.
    """

    mode: str
    why: str
    graph: Any
    layer_set: LayerSet | None
    groups: list[list[str]]
    devices: list[torch.device]
    ranked: tuple[Mesh, RankInfo] | None = None


def _cut(
    model: nn.Module, split_points: Any, no_split: Any
) -> tuple[str, str, Any, LayerSet | None, list[str], list[str] | None]:
    """``(mode, why, graph, layer_set, names, order)``: how the forward is cut and the layers' names
    (``order``: execution order where known before a first call)."""
    if discovery.descends(model, split_points, no_split):
        layer_set = discovery.model_layers(model, split_points=split_points, no_split=no_split)
        names = layer_set.names()
        why = (
            f"its layers are blocks inside containers ({', '.join(names[:3])}, ...), which torch.fx splits "
            "do not cut"
        )
        return "own-forward", why, None, layer_set, names, None
    mode, why, graph = split.choose_mode(model)
    names = [n for n, _ in discovery.top_level_layers(model)]
    if graph is not None:
        return mode, why, graph, None, names, split.graph_layer_order(graph, names)
    return mode, why, graph, None, names, (names if mode == "sequential" else None)


def layout(
    model: nn.Module,
    plan: Plan | None,
    devices: Any,
    balance: Sequence[int] | None,
    split_points: Any = None,
    no_split: Any = None,
) -> Layout:
    """The stages of ``model`` placed by ``plan``, or by ``devices`` and ``balance`` (see the module
    docstring)."""
    mode, why, graph, layer_set, names, order = _cut(model, split_points, no_split)
    ranked = launched_mesh(plan, devices, balance)  # launched with pp > 1: one stage per rank (runtime.ranks)
    here = ranked[1].device if ranked is not None else None
    if ranked is not None and plan is None:
        devices = [ranked[1].device] * max(ranked[0].stages, launched_stages(None, devices, balance))
    if plan is not None:
        if layer_set is not None:
            _check_plan_names(model, plan, names)
            groups, devs = stages_from_plan(plan, plan.layers, None, here)
        else:
            groups, devs = stages_from_plan(plan, names, order, here)
    else:
        devs = _devices(model, devices, balance)
        if (
            layer_set is not None and balance is not None
        ):  # blocks: counted over the order the first call records
            groups = _counts(balance, devs)
        else:
            groups = stages_from_balance(order or names, devs, balance)
    if ranked is not None:
        devs = [ranked[1].device] * len(groups)
    _check_reuse(model, mode, graph, names, groups, devs, ranked is not None)
    return Layout(mode, why, graph, layer_set, groups, devs, ranked)


def _counts(balance: Sequence[int], devices: list[torch.device]) -> list[list[str]]:
    """Placeholder groups of ``balance[s]`` layers: a model's blocks are known for sure only once its first
    call is recorded (a module called twice, one never called), where ``OwnForwardLayers.record`` applies the
    counts and checks that they add up to the recorded layers."""
    balance = list(balance)
    if len(balance) != len(devices):
        raise ValueError(
            f"balance={balance} has {len(balance)} entries but devices has {len(devices)}; give one layer "
            "count per device"
        )
    for i, b in enumerate(balance):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"balance[{i}]={b!r} must be an int >= 1 (layers in stage {i})")
    return [[f"<stage {s} layer {k}>" for k in range(b)] for s, b in enumerate(balance)]


def _check_reuse(
    model: nn.Module,
    mode: str,
    graph: Any,
    names: list[str],
    groups: list[list[str]],
    devices: list[torch.device],
    ranked: bool,
) -> None:
    """A module called more than once in a forward, refused before anything is placed where its calls cannot
    be exact.

    fx: the layers between a reused child's first and last call share one stage (``reuse.check_stages``;
    the split checks each re-trace again). ``nn.Sequential``: one module at several entries is a tie,
    exact across stages and ranks, but not across devices of one process (``check_entries``). The model's
    own forward is recorded at the first call, which checks the same (``OwnForwardLayers.record``).
    """
    stage_of = {name: s for s, g in enumerate(groups) for name in g}
    if mode == "fx" and graph is not None:
        calls = split.graph_calls(graph, names)
        kinds = {n: type(model.get_submodule(n)).__name__ for n in reuse.reused(calls)}
        reuse.check_stages(calls, groups, model=type(model).__name__, kinds=kinds)
    elif mode == "sequential" and not ranked:
        check_entries(discovery.top_level_modules(model), stage_of, devices)


def _check_plan_names(model: nn.Module, plan: Plan, names: list[str]) -> None:
    """Every layer a plan names is a module of ``model`` (the recording forward checks order later)."""
    modules = dict(model.named_modules())
    for i, st in enumerate(plan.stages):
        unknown = [n for n in st.layers if n not in modules]
        if unknown:
            raise ValueError(
                f"plan stage {i} names layer(s) {unknown}, which the model does not have; its layers are "
                f"{', '.join(names)}. Re-plan for this model (torchspan.plan(model, x, ...))"
            )


def _devices(model: nn.Module, devices: Any, balance: Sequence[int] | None) -> list[torch.device]:
    """``devices`` as given, else one stage on the device of the model's first parameter (or the CPU)."""
    if devices is not None:
        return parse_devices(devices)
    if balance is not None and len(balance) != 1:
        raise ValueError(f"balance={balance} needs devices=[...] with {len(balance)} entries")
    first = next(iter(model.parameters()), None)
    return [first.device if first is not None else torch.device("cpu")]

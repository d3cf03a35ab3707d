"""Decide which stage each layer belongs to and move the layers' parameters there.

Usage (``span`` does this)::

    stages = stages_from_balance(["a", "b", "c"], [cpu, cpu], [2, 1])   # [["a", "b"], ["c"]]
    place(model, {"a": 0, "b": 0, "c": 1}, [cpu, cpu], root_attrs={},
          layers={"a": model.a, "b": model.b, "c": model.c})
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..hardware import resolve_device, to_device
from ..layers import LayerSet, top_level_modules
from ..layers.reuse import balance_advice, check_stages
from ..planner.plans import Plan
from .microbatch import split_sizes
from .ties import TiedCopies

__all__ = [
    "parse_devices",
    "even_balance",
    "stages_from_balance",
    "stages_from_plan",
    "check_shared",
    "check_entries",
    "check_calls",
    "place",
]


def parse_devices(devices: Any) -> list[torch.device]:
    """``devices`` as given to ``span`` (list, or a comma string like ``"cuda:0,cpu"``) → devices."""
    if isinstance(devices, (str, torch.device, int)):
        items: list[Any] = [d.strip() for d in devices.split(",")] if isinstance(devices, str) else [devices]
    elif isinstance(devices, Sequence):
        items = list(devices)
    else:
        raise ValueError(
            f"devices={devices!r} must be a list like ['cuda:0', 'cpu'] or a string like 'cuda:0,cpu'"
        )
    if not items:
        raise ValueError("devices=[] is empty; give at least one device, e.g. devices=['cpu']")
    return [resolve_device(d, name=f"devices[{i}]") for i, d in enumerate(items)]


def even_balance(layers: int, stages: int) -> list[int]:
    """Layers per stage, as even as possible (earlier stages get the extra ones); needs ``stages <=
    layers``."""
    return split_sizes(layers, stages)


def stages_from_balance(
    order: Sequence[str], devices: Sequence[torch.device], balance: Sequence[int] | None
) -> list[list[str]]:
    """Consecutive runs of ``order`` with ``balance[i]`` layers in stage ``i``."""
    n = len(order)
    if len(devices) > n:
        raise ValueError(
            f"devices has {len(devices)} entries but the model has only {n} layer(s) ({', '.join(order)}); "
            f"use at most {n} devices, or cut the model finer: span(..., split_points=[...]) or more child "
            "modules"
        )
    if balance is None:
        balance = even_balance(n, len(devices))
    balance = list(balance)
    if len(balance) != len(devices):
        raise ValueError(
            f"balance={balance} has {len(balance)} entries but devices has {len(devices)}; give one layer "
            "count per device"
        )
    for i, b in enumerate(balance):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"balance[{i}]={b!r} must be an int >= 1 (layers in stage {i})")
    if sum(balance) != n:
        raise ValueError(
            f"balance={balance} places {sum(balance)} layers but the model has {n} ({', '.join(order)}); "
            f"the counts must add up to {n}"
        )
    out, k = [], 0
    for b in balance:
        out.append(list(order[k : k + b]))
        k += b
    return out


def stages_from_plan(
    plan: Plan, layer_names: Sequence[str], order: Sequence[str] | None, here: torch.device | None = None
) -> tuple[list[list[str]], list[torch.device]]:
    """The plan's layer groups and devices, checked against the model's layers (and order, if known).

    ``here``: a launched job's rank device, which every stage of this rank uses instead of the plan's
    device names (those of the planned cluster's ranks, not necessarily visible on this one)."""
    known = set(layer_names)
    for i, st in enumerate(plan.stages):
        for name in st.layers:
            if name not in known:
                raise ValueError(
                    f"plan stage {i} names layer {name!r}, which the model does not have; its layers are "
                    f"{', '.join(layer_names)}. Re-plan for this model (torchspan.plan(model, x, ...))"
                )
    planned = plan.layers
    missing = [n for n in layer_names if n not in planned]
    if missing:
        raise ValueError(
            f"plan does not place layer(s) {', '.join(map(repr, missing))}; every layer needs a stage. "
            "Re-plan for this model"
        )
    if order is not None:
        for i, (want, got) in enumerate(zip(order, planned)):
            if want != got:
                raise ValueError(
                    f"plan puts layer {got!r} at position {i}, but the model runs {want!r} there "
                    f"(execution order: {', '.join(order)}); stages must follow execution order. Re-plan "
                    "for this model"
                )
    if here is not None:
        return [list(st.layers) for st in plan.stages], [here] * len(plan.stages)
    devs = []
    for i, st in enumerate(plan.stages):
        try:
            devs.append(resolve_device(st.device, name=f"plan stage {i} device"))
        except ValueError as exc:
            raise ValueError(f"{exc} (the plan was made for devices {', '.join(plan.devices)})") from None
    return [list(st.layers) for st in plan.stages], devs


def _entries_together(stage_of: Mapping[str, int], first: str, last: str) -> str:
    """The balance advice keeping layers ``first`` to ``last`` (execution order: ``stage_of``'s) in one
    stage."""
    order = list(stage_of)
    counts = [0] * (max(stage_of.values()) + 1)
    for s in stage_of.values():
        counts[s] += 1
    return balance_advice(len(order), [(order.index(first), order.index(last))], [c for c in counts if c])


def check_calls(model: nn.Module, layers: LayerSet, groups: Sequence[Sequence[str]]) -> None:
    """Every call of a layer called more than once (``layers.calls``, from a recording forward) runs in the
    stage holding it: else ``ValueError`` naming the module, its calls and a balance that works
    (``reuse.check_stages``)."""
    kinds = {
        layer.name: type(layer.module).__name__ + "".join(f", also {a!r}" for a in layer.aliases)
        for layer in layers
        if layer.calls > 1
    }
    check_stages(layers.calls, groups, model=type(model).__name__, kinds=kinds)


def check_entries(
    layers: Mapping[str, nn.Module], stage_of: Mapping[str, int], devices: Sequence[torch.device]
) -> None:
    """Raise if one module object is several layers (``nn.Sequential(a, b, a)``: entries ``"0"`` and ``"2"``)
    in stages on different devices of one process. Across stages of one device it needs nothing (its
    parameters are there); across ranks it is a tie (``RankStage``); but in one process one module cannot be
    read on two devices at once (the other stage's thread may be inside it)."""
    entries: dict[int, list[str]] = {}
    for name, mod in layers.items():
        if name in stage_of:
            entries.setdefault(id(mod), []).append(name)
    for names in entries.values():
        devs = {str(devices[stage_of[n]]) for n in names}
        if len(devs) < 2:
            continue
        where = ", ".join(f"{n!r} (stage {stage_of[n]}, {devices[stage_of[n]]})" for n in names)
        raise ValueError(
            f"torchspan: entries {where} are one module ({type(layers[names[0]]).__name__}), called at "
            "each, in stages on different devices of one process, where its parameters can live on one "
            "device only. Keep its calls in one stage: pass "
            f"{_entries_together(stage_of, names[0], names[-1])}; or put those stages on one device; or "
            "give each entry its own module holding the same nn.Parameter objects (a tie, kept exact "
            "across devices)"
        )


def check_shared(
    model: nn.Module,
    stage_of: dict[str, int],
    layers: Mapping[str, nn.Module] | None = None,
    devices: Sequence[torch.device] | None = None,
) -> None:
    """Raise if one buffer belongs to layers on different devices (a tied *parameter* is kept by
    ``TiedCopies``).

    Without ``devices`` any two stages count as different. ``layers``: name -> module (default: top-level
    children).
    """
    owner: dict[int, tuple[str, int]] = {}
    layers = layers if layers is not None else top_level_modules(model)
    for name, child in layers.items():
        if name not in stage_of:
            continue
        for bname, t in child.named_buffers():
            prev = owner.get(id(t))
            s = stage_of[name]
            if prev is not None and prev[1] != s and (devices is None or devices[prev[1]] != devices[s]):
                if layers[prev[0]] is child:
                    raise ValueError(
                        f"torchspan: layers {prev[0]!r} (stage {prev[1]}) and {name!r} (stage {s}) are one "
                        f"module ({type(child).__name__}) called at both, and it holds buffer {bname!r}: a "
                        "buffer's in-place updates (running statistics) cannot be kept in step across "
                        "stages. Keep its calls in one stage: pass "
                        f"{_entries_together(stage_of, prev[0], name)}"
                    )
                raise ValueError(
                    f"buffer {name}.{bname} is shared with layer {prev[0]!r}: layers {prev[0]!r} (stage "
                    f"{prev[1]}) and {name!r} (stage {s}) use the same buffer on different devices, and a "
                    "buffer's in-place updates cannot be kept in step across devices. Put both layers in "
                    "the same stage (or on one device)"
                )
            owner.setdefault(id(t), (name, s))


def _owner(model: nn.Module, qualified: str) -> tuple[nn.Module, str]:
    path, _, attr = qualified.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def place(
    model: nn.Module,
    stage_of: dict[str, int],
    devices: Sequence[torch.device],
    root_attrs: dict[str, int],
    layers: Mapping[str, nn.Module] | None = None,
    roots: Sequence[str] | None = None,
) -> TiedCopies:
    """Move each layer to its stage's device and each root tensor to ``root_attrs``' stage (else 0).

    ``layers``: name -> module in execution order (default: top-level children); ``roots``: the
    qualified names of tensors held outside every layer (default: the model's own). A parameter
    that several layers hold stays one ``nn.Parameter`` on the first such layer's device; layers on
    other devices read a copy during their forward (the returned, installed ``TiedCopies``).
    """
    layers = dict(layers if layers is not None else top_level_modules(model))
    home: dict[int, torch.device] = {}
    for name in [n for n in layers if n in stage_of]:
        dev = devices[stage_of[name]]
        for sub in layers[name].modules():
            for attr, p in sub._parameters.items():
                # tensor by tensor, keeping each Parameter object: a module-level .to() would break a tie
                # (cpu -> meta makes new Parameters) or let the last holder win
                if p is not None and home.setdefault(id(p), dev) == dev and p.device != dev:
                    _move_parameter(p, dev)
            for attr, b in sub._buffers.items():
                if b is not None and home.setdefault(id(b), dev) == dev and b.device != dev:
                    sub._buffers[attr] = to_device(b, dev)
    if roots is None:
        roots = [
            n for n, t in list(model._parameters.items()) + list(model._buffers.items()) if t is not None
        ]
    for qname in roots:
        mod, attr = _owner(model, qname)
        dev = devices[root_attrs.get(qname, 0)]
        p = mod._parameters.get(attr)
        if p is not None:
            if p.device != dev:
                _move_parameter(p, dev)
        elif mod._buffers.get(attr) is not None and mod._buffers[attr].device != dev:  # type: ignore[union-attr]
            mod._buffers[attr] = to_device(mod._buffers[attr], dev)
    return TiedCopies(layers, stage_of, devices).install()


def _move_parameter(p: nn.Parameter, dev: torch.device) -> None:
    """Move ``p`` to ``dev`` in place, keeping the same ``Parameter`` object (optimizers hold it)."""
    moved = to_device(p.detach(), dev)
    try:
        with torch.no_grad():
            p.data = moved
    except RuntimeError:  # e.g. cpu -> meta ("incompatible tensor type"): swap the payload instead
        torch.utils.swap_tensors(p, nn.Parameter(moved, requires_grad=p.requires_grad))

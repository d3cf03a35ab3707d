"""Turn a model into ordered layers: the unit that profiling, planning and placement work with.

``model_layers`` is the one answer: for a model with repeated blocks (``descends``: an
``nn.ModuleList``/``nn.Sequential`` of blocks below its top level, or ``split_points``/``no_split``
given) the ``blocks.find_layers`` blocks, named by qualified name (``transformer.h.0``); for any
other model (``nn.Sequential`` included) its top-level children, named by attribute. Layers are
ordered by first execution in a recording forward. The profiler, the planner and ``span`` all
receive their layers from here.

Usage: ``model_layers(model, (x,), {}).names()`` → ``["embed", "blocks.0", "blocks.1", "head"]``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .blocks import (
    Layer,
    LayerSet,
    RootTensor,
    _check_options,
    _is_block_container,
    _join,
    _Picker,
    find_layers,
)
from .calltrace import Call, Trace

__all__ = [
    "top_level_layers",
    "top_level_modules",
    "module_entries",
    "execution_order",
    "record_forward",
    "descends",
    "model_layers",
]


def top_level_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's top-level children, in registration order; a model without children is one layer, named
    ``""``.

    An ``nn.Sequential`` gives every entry, each one a layer: one module object at two indices
    (``nn.Sequential(a, b, a)``) is called at both, so both are layers (``"0"`` and ``"2"``) that
    share its parameters (a tie). Other models give each child once (``named_children``).
    """
    children = list(model.named_children())
    if isinstance(model, nn.Sequential) and len(children) < sum(
        m is not None for m in model._modules.values()
    ):
        children = [(n, m) for n, m in model._modules.items() if m is not None]  # an entry repeats a module
    return children or [("", model)]


def module_entries(children: Sequence[tuple[str, nn.Module]]) -> list[tuple[nn.Module, Callable[[], str]]]:
    """Each module of ``children`` (layers: name and module) once, with a function naming the layer of its
    next call. A module at several entries (``nn.Sequential(a, b, a)``) is called once per entry, in
    order, so its k-th call is its k-th entry (cycling on to the next forward). For hooks that must file
    each call under its layer: one hook per module, ``name = next_name()`` at each call.
    """
    names: dict[int, list[str]] = {}
    modules: dict[int, nn.Module] = {}
    for name, mod in children:
        names.setdefault(id(mod), []).append(name)
        modules[id(mod)] = mod
    return [(modules[key], itertools.cycle(entries).__next__) for key, entries in names.items()]


def top_level_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's layers by name (registration order), as placement, hooks and metering look them up.

    Usage: ``top_level_modules(model)["head"]``. Raises like ``top_level_layers`` if there are none.
    """
    return dict(top_level_layers(model))


def execution_order(model: nn.Module, *args: Any, **kwargs: Any) -> list[str]:
    """Names of top-level children in the order a forward with ``args``/``kwargs`` first runs them.

    ``nn.Sequential`` needs no example input. Children that never run in the recording forward
    are appended at the end in registration order (they still own parameters to place).
    """
    children = top_level_layers(model)
    if isinstance(model, nn.Sequential) or (not args and not kwargs):
        return [name for name, _ in children]
    return record_forward(model, args, kwargs)[0]


class _RootUses(TorchFunctionMode):
    """Notes, for each tensor the model owns directly, which child had last started when an op first read
    it."""

    def __init__(self, owned: dict[int, str], last: list[str | None]) -> None:
        super().__init__()
        self.owned = owned
        self.last = last
        self.uses: dict[str, str | None] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            name = self.owned.get(id(t)) if isinstance(t, torch.Tensor) else None
            if name is not None and name not in self.uses:
                self.uses[name] = self.last[0]
        return func(*args, **kwargs)


def record_forward(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[str], dict[str, str | None]]:
    """One no-grad forward: the children in execution order, and for each parameter or buffer the
    model owns directly, the child that ran last before it was first read (``None``: before any).

    Usage: ``order, uses = record_forward(model, (x,), {})`` → ``["a", "b"], {"scale": "a"}``.
    """
    order, uses, _ = _record_children(model, args, kwargs)
    return order, uses


def _record_children(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[str], dict[str, str | None], list[str]]:
    """``record_forward``'s order and uses, and the child of every call in order (a child called twice
    appears twice; one called inside another child's call too)."""
    owned = {
        id(t): n for n, t in list(model._parameters.items()) + list(model._buffers.items()) if t is not None
    }
    order: list[str] = []
    calls: list[str] = []
    last: list[str | None] = [None]
    handles = []
    for name, child in model.named_children():

        def pre(_mod: nn.Module, _inp: Any, _name: str = name) -> None:
            calls.append(_name)
            last[0] = _name
            if _name not in order:
                order.append(_name)

        handles.append(child.register_forward_pre_hook(pre))
    watch = _RootUses(owned, last)
    try:
        with torch.no_grad(), watch:
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    order.extend(name for name, _ in model.named_children() if name not in order)
    return order, watch.uses, calls


# ---------------------------------------------------------------------------------------- layer sets


def _flat_layers(model: nn.Module, order: list[str], calls: list[str] | None = None) -> LayerSet:
    """Top-level children as a ``LayerSet`` in ``order``; ``calls``: the child of every call, in order
    (``None``: each layer called once, in ``order``)."""
    mods = dict(top_level_layers(model))
    calls = list(order) if calls is None else calls
    out = []
    for name in order:
        mod = mods.get(name)
        if mod is None:
            continue
        params, buffers = list(mod.parameters()), list(mod.buffers())
        out.append(
            Layer(
                name=name,
                module=mod,
                index=len(out),
                param_count=sum(p.numel() for p in params),
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                buffer_bytes=sum(b.numel() * b.element_size() for b in buffers),
                calls=calls.count(name),
            )
        )
    return LayerSet(tuple(out), calls=tuple(calls))


def descends(
    model: nn.Module, split_points: Iterable[str] | None = None, no_split: Iterable[Any] | None = None
) -> bool:
    """Whether ``model``'s layers are blocks below its top level (``find_layers``), not its top-level
    children.

    ``nn.Sequential`` models and models without a block container (``nn.ModuleList``/``nn.Sequential``
    holding parameters) below the top keep their top-level children, unless ``split_points`` or
    ``no_split`` are given. Usage: ``descends(gpt2)`` → ``True``.
    """
    if split_points or no_split:
        return True
    if isinstance(model, nn.Sequential):
        return False
    return any(_is_block_container(m) for m in model.modules() if m is not model)


def _registration_trace(model: nn.Module) -> Trace:
    """A trace as if every module ran once, in registration order, nested as registered."""
    trace = Trace()
    clock = [0]

    def walk(mod: nn.Module, parent: int, seen: set[int]) -> None:
        if id(mod) in seen:
            return
        seen.add(id(mod))
        clock[0] += 1
        index = len(trace.calls)
        trace.calls.append(Call(mod, clock[0], -1, parent))
        trace.by_module.setdefault(id(mod), []).append(index)
        for child in mod._modules.values():
            if child is not None:
                walk(child, index, seen)
        clock[0] += 1
        trace.calls[index].end = clock[0]

    walk(model, -1, set())
    return trace


def model_layers(
    model: nn.Module,
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    *,
    split_points: Iterable[str] | None = None,
    no_split: Iterable[Any] | None = None,
) -> LayerSet:
    """The layers ``span``, ``profile`` and ``plan`` place: the one answer every part of torchspan uses.

    Models that ``descends`` are cut into ``find_layers`` blocks (qualified names, execution order
    recorded by one no-grad forward on ``args``/``kwargs``); other models into their top-level
    children (execution order recorded the same way, the model's own tensors as ``roots``).
    ``args=None``: no forward is run; the layers come in registration order (what a forward will
    confirm or reorder), every module counted as running once.

    Usage: ``model_layers(gpt2, (ids,), {"attention_mask": mask}).names()`` → ``["transformer.wte", ...]``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be an nn.Module, got {type(model).__name__}; pass the model object itself"
        )
    kwargs = dict(kwargs or {})
    if descends(model, split_points, no_split):
        if args is None:
            points, kinds = _check_options(model, split_points, no_split)
            picker = _Picker(model, _registration_trace(model), points, kinds)
            while (found := picker.conflict()) is not None:
                picker.resolve(*found)
            names = {names[0]: lid for lid, names in picker.layers.items()}
            mods = [(n, picker.modules[lid]) for n, lid in names.items()]
            layers = [
                Layer(
                    n,
                    m,
                    i,
                    sum(p.numel() for p in m.parameters()),
                    sum(p.numel() * p.element_size() for p in m.parameters()),
                    sum(b.numel() * b.element_size() for b in m.buffers()),
                    aliases=tuple(picker.layers[id(m)][1:]),
                )
                for i, (n, m) in enumerate(mods)
            ]
            roots = [
                RootTensor(_join(owner, n), kind, owner, None)
                for owner, mod in picker.descended.items()
                for kind, items in (("parameter", mod._parameters), ("buffer", mod._buffers))
                for n, t in items.items()
                if t is not None
            ]
            return LayerSet(tuple(layers), tuple(roots))
        return find_layers(model, *args, split_points=split_points, no_split=no_split, **kwargs)
    if args is None or isinstance(model, nn.Sequential):
        flat = _flat_layers(model, [n for n, _ in top_level_layers(model)])
        roots_named = [(n, "parameter") for n, t in model._parameters.items() if t is not None]
        roots_named += [(n, "buffer") for n, t in model._buffers.items() if t is not None]
        calls = (
            flat.calls if isinstance(model, nn.Sequential) else ()
        )  # a Sequential calls each entry once, in order
        return LayerSet(flat.layers, tuple(RootTensor(n, k, "", None) for n, k in roots_named), calls=calls)
    order, uses, calls = _record_children(model, args, kwargs)
    flat = _flat_layers(model, order, calls)
    roots = [
        RootTensor(n, "parameter", "", uses.get(n)) for n, t in model._parameters.items() if t is not None
    ]
    roots += [RootTensor(n, "buffer", "", uses.get(n)) for n, t in model._buffers.items() if t is not None]
    return LayerSet(flat.layers, tuple(roots), calls=flat.calls)

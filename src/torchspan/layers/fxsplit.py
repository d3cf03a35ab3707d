"""Split a model into pipeline stages at layer boundaries with ``torch.fx``.

How ``span`` turns a model into stages (``choose_mode``), in this order of preference:

- ``"sequential"``: an ``nn.Sequential``; each stage is a run of consecutive children.
- ``"fx"``: ``torch.fx`` traces the forward with top-level children as leaves; ``split_graph``
  cuts the graph at child boundaries and carries every live value across each cut.
- ``"own-forward"``: anything else; the model's own forward runs, children stay whole and each
  runs on its stage's device (see ``torchspan.runtime``).

Usage: ``mode, why, graph = choose_mode(model)``; ``mods, attrs = split_graph(model, graph, {"a": 0, "b": 1},
2)``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_leaves

from .discovery import top_level_layers
from .reuse import check_stages, reused

__all__ = [
    "MODES",
    "LayerTracer",
    "choose_mode",
    "trace",
    "concrete_key",
    "default_concrete_args",
    "graph_layer_order",
    "graph_calls",
    "split_graph",
]


MODES = ("sequential", "fx", "own-forward")


class LayerTracer(fx.Tracer):
    """An fx tracer that keeps every top-level child as one opaque ``call_module`` node."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return "." not in module_qualified_name and module_qualified_name != ""


def concrete_key(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], tensor_like: tuple[type, ...] = ()
) -> tuple[list[Any], dict[str, Any], tuple[Any, ...]]:
    """Bind a call to ``model.forward``'s signature.

    Returns ``(values, concrete, key)``: every parameter's value in signature order (defaults
    filled in), the non-tensor values that fx must specialise on (``None``, flags, ints…), and a
    hashable key for caching the trace made for those values. Instances of ``tensor_like`` count
    as tensors (wrappers the caller unwraps before running).
    Usage: ``values, concrete, key = concrete_key(model, (x,), {"mask": None})``.
    """
    sig = inspect.signature(model.forward)
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(
                f"{type(model).__name__}.forward takes *{p.name}; fx cannot trace variadic arguments"
            )
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{type(model).__name__}.forward{sig}: {exc}") from None
    bound.apply_defaults()
    values = [bound.arguments[name] for name in sig.parameters]
    concrete: dict[str, Any] = {}
    key: list[Any] = []
    for name, value in zip(sig.parameters, values):
        if isinstance(value, tensor_like) or _has_tensor(value):
            key.append((name, "tensor"))
        else:
            concrete[name] = value
            key.append((name, type(value).__name__, repr(value)))
    return values, concrete, tuple(key)


def _has_tensor(value: Any) -> bool:
    return any(isinstance(v, torch.Tensor) for v in tree_leaves(value))


def default_concrete_args(model: nn.Module) -> dict[str, Any]:
    """The non-tensor defaults of ``model.forward`` (what a trace without example inputs fixes)."""
    sig = inspect.signature(model.forward)
    return {
        name: p.default
        for name, p in sig.parameters.items()
        if p.default is not inspect.Parameter.empty and not isinstance(p.default, torch.Tensor)
    }


def trace(model: nn.Module, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
    """Trace ``model`` with its top-level children as leaves. Raises whatever fx raises."""
    with warnings.catch_warnings():
        # fx warns that it cannot guard specialised non-None constants; the runtime re-traces per
        # distinct constant values (``concrete_key``), so the guard is not needed.
        warnings.filterwarnings("ignore", message="Was not able to add assertion")
        return LayerTracer().trace(model, concrete_args=concrete_args or None)


def choose_mode(model: nn.Module) -> tuple[str, str, fx.Graph | None]:
    """``("sequential"|"fx"|"own-forward", why, graph)``: how ``span`` will turn ``model`` into stages.

    ``graph`` is the trace made with ``default_concrete_args(model)`` in fx mode (``None`` otherwise),
    so that the caller need not trace again: each trace adds ``_tensor_constantN`` attributes to the model.
    Usage: ``mode, why, graph = choose_mode(model)``.
    """
    top_level_layers(model)
    if isinstance(model, nn.Sequential):
        return "sequential", "nn.Sequential: its children are the layers", None
    try:
        graph = trace(model, default_concrete_args(model))
    except Exception as exc:  # fx raises many kinds (TraceError, TypeError, NotImplementedError…)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (
            "own-forward",
            f"torch.fx cannot trace {type(model).__name__} ({type(exc).__name__}: {first})",
            None,
        )
    return "fx", "torch.fx traced the forward; it is split at top-level child boundaries", graph


def graph_layer_order(graph: fx.Graph, layers: list[str]) -> list[str]:
    """Layer names in the order ``graph`` first calls (or reads) them; unused layers appended."""
    known = set(layers)
    order: list[str] = []
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr"):
            head = str(node.target).split(".")[0]
            if head in known and head not in order:
                order.append(head)
    order.extend(name for name in layers if name not in order)
    return order


def graph_calls(graph: fx.Graph, layers: list[str]) -> list[str]:
    """The layer of every layer call in ``graph``, in order (a layer called twice appears twice)."""
    known = set(layers)
    heads = (str(node.target).split(".")[0] for node in graph.nodes if node.op == "call_module")
    return [head for head in heads if head in known]


def split_graph(
    model: nn.Module,
    graph: fx.Graph,
    stage_of: dict[str, int],
    stages: int,
    before_build: Callable[[dict[str, int]], None] | None = None,
) -> tuple[list[fx.GraphModule], dict[str, int]]:
    """Cut a traced ``graph`` into one ``GraphModule`` per stage at layer boundaries.

    ``stage_of`` maps each layer name to its stage. Every value produced before a cut and used
    after it is carried across: stage ``s > 0`` takes those values as positional inputs, a stage
    that is not the last returns them as a tuple, and the last stage returns the model's output.
    Stage 0 takes the model's arguments in signature order.

    Returns ``(stage_modules, root_attrs)``; ``root_attrs`` maps attributes owned by the model
    itself (not by a layer) to the stage that first reads them, so placement can put them there.
    ``before_build(root_attrs)`` runs before the stage modules are built (they hold the model's
    tensors as they are then): the place to move those tensors to their stages.
    Raises ``ValueError`` naming the layer when the graph calls layers out of stage order, or calls one
    layer more than once with a stage cut between its calls (``reuse.check_stages``).
    Usage: ``mods, attrs = split_graph(model, trace(model), {"a": 0, "b": 1}, 2)``.
    """
    nodes = list(graph.nodes)
    groups: list[list[str]] = [[] for _ in range(stages)]
    for name, s in stage_of.items():
        groups[s].append(name)
    calls = graph_calls(graph, list(stage_of))
    check_stages(
        calls,
        groups,
        model=type(model).__name__,
        kinds={n: type(model.get_submodule(n)).__name__ for n in reused(calls)},
    )
    where = _node_stages(model, nodes, stage_of, stages)
    root_attrs = _attr_stages(model, nodes, where, stage_of, stages)
    if before_build is not None:
        before_build(root_attrs)
    last_use = {node: max((where[u] for u in node.users), default=where[node]) for node in nodes}
    modules = [_stage_module(model, nodes, where, last_use, s, stages) for s in range(stages)]
    return modules, root_attrs


def _node_stages(
    model: nn.Module, nodes: list[fx.Node], stage_of: dict[str, int], stages: int
) -> dict[fx.Node, int]:
    """The stage of every node but ``get_attr``: a layer call's stage, else the stage running at that
    point."""
    where: dict[fx.Node, int] = {}
    current = 0
    last_layer: str | None = None
    for node in nodes:
        if node.op == "placeholder":
            where[node] = 0
        elif node.op == "call_module":
            head = str(node.target).split(".")[0]
            s = stage_of[head]
            if s < current:
                raise ValueError(
                    f"layer {head!r} (stage {s}) runs after layer {last_layer!r} (stage {current}) in "
                    f"{type(model).__name__}.forward; stages must follow execution order. Put {head!r} in "
                    f"stage {current} or later, or list layers in execution order "
                    f"(torchspan.layers.execution_order(model, x))"
                )
            current, last_layer = s, head
            where[node] = s
        elif node.op == "output":
            where[node] = stages - 1
        elif node.op != "get_attr":
            where[node] = current
    return where


def _attr_stages(
    model: nn.Module, nodes: list[fx.Node], where: dict[fx.Node, int], stage_of: dict[str, int], stages: int
) -> dict[str, int]:
    """Place ``get_attr`` nodes in ``where``: a layer's in its stage, the model's own in the first stage that
    reads it.

    Returns the model's own attributes (not a layer's) with that stage.
    """
    root_attrs: dict[str, int] = {}
    for node in nodes:
        if node.op != "get_attr":
            continue
        head = str(node.target).split(".")[0]
        first_use = min((where[u] for u in node.users if u in where), default=stages - 1)
        if head in stage_of:
            owner = stage_of[head]
            if owner > first_use:
                raise ValueError(
                    f"{type(model).__name__}.forward reads {node.target!r} of layer {head!r} (stage {owner}) "
                    f"in stage {first_use}; an earlier stage cannot use a later stage's parameters. "
                    f"Put {head!r} in stage {first_use} or earlier"
                )
            where[node] = owner
        else:
            where[node] = first_use
            root_attrs[str(node.target)] = first_use
    return root_attrs


def _stage_module(
    model: nn.Module,
    nodes: list[fx.Node],
    where: dict[fx.Node, int],
    last_use: dict[fx.Node, int],
    s: int,
    stages: int,
) -> fx.GraphModule:
    """Stage ``s`` as a ``GraphModule``: carried values in (the model's arguments for stage 0), carried values
    or the output out."""

    def live_after(k: int) -> list[fx.Node]:
        return [n for n in nodes if n.op != "output" and where[n] <= k < last_use[n]]

    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if s == 0:
        for n in nodes:
            if n.op == "placeholder":
                env[n] = g.node_copy(n, lambda a: env[a])
    else:
        for n in live_after(s - 1):
            env[n] = g.placeholder(f"carry_{n.name}")
    for n in nodes:
        if where[n] == s and n.op not in ("placeholder", "output"):
            env[n] = g.node_copy(n, lambda a: env[a])
    if s < stages - 1:
        g.output(tuple(env[n] for n in live_after(s)))
    else:
        out = next(n for n in nodes if n.op == "output")
        g.output(fx.map_arg(out.args[0], lambda a: env[a]))
    g.lint()
    return fx.GraphModule(model, g, class_name=f"Stage{s}")

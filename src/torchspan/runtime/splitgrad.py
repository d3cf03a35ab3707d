"""A backward in two passes: the inputs' gradients now, the parameters' gradients later (zero-bubble).

``input_backward(outputs, grads, inputs, params)`` runs autograd from ``outputs`` (with ``grads``)
to ``inputs`` only, keeping the graph, and returns the inputs' gradients with a ``Pending`` whose
``weights()`` later adds the parameters' gradients into their ``.grad`` exactly as
``torch.autograd.backward(outputs, grads)`` would have (same sums; ``.grad`` set to a fresh tensor
laid out as the parameter when it was ``None``, added to in place otherwise). ``params=None``: every
leaf tensor the graph reaches other than the inputs (what ``backward`` fills).

How: a walk of the graph from the outputs marks every node that leads to an input. The
*frontier* is the nodes that lead to an input and have an edge into a part of the graph that leads
only to parameters; a node pre-hook records the gradient flowing into each frontier node while the
input pass runs it (autograd computes only the input-side outputs of a node there, e.g. an
``addmm``'s input gradient, not its weight gradient). The weight pass runs ``torch.autograd.grad``
from the frontier nodes (``GradientEdge``s, with the recorded gradients) to the parameters, one call
per group of frontier nodes that share parameters. A group whose frontier nodes lead to one another
(a parameter used twice along one path) overrides each such node's incoming gradient with the
recorded one (a pre-hook), so nothing is counted twice. Outputs whose graph leads to no input start
the weight pass directly with their given gradients.

Falls back to one whole backward (in ``input_backward``; ``weights()`` then does nothing) when the
split cannot be made or would not help: no input needs a gradient (a first stage: its whole
backward runs as the input pass), a parameter carries hooks (``register_hook``,
``register_post_accumulate_grad_hook``: they fire as the whole backward fires them), or this torch
lacks ``GradientEdge``. The fallback is exact, never a wrong split.

Usage::

    grads, pending = input_backward([out], [g], [x], list(stage.parameters()))
    send(grads)          # the previous stage can go on
    pending.weights()    # later: the parameters' .grad as after backward
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["input_backward", "Pending"]

try:  # torch >= 2.4
    from torch.autograd.graph import GradientEdge, get_gradient_edge
except ImportError:  # pragma: no cover - older torch: whole backwards only
    GradientEdge = None  # type: ignore[assignment,misc]
    get_gradient_edge = None  # type: ignore[assignment]


class Pending:
    """The weight pass of one ``input_backward``: ``weights()`` once, later (then its graph is released)."""

    def __init__(self, groups: list[tuple[list[Any], list[Any], list[torch.Tensor], list[bool]]] | None = None) -> None:
        # per group: start edges, their gradients, the group's parameters, which starts are frontier nodes
        self._groups = groups or []

    def __bool__(self) -> bool:
        return bool(self._groups)

    def weights(self) -> None:
        """Add the parameters' gradients into ``.grad`` as ``torch.autograd.backward`` would.

        Usage: ``pending.weights()``.
        """
        groups, self._groups = self._groups, []
        for edges, grads, params, front in groups:
            handles = _overrides(edges, front) if sum(front) > 1 else []
            try:
                found = torch.autograd.grad(edges, params, grads, retain_graph=True, allow_unused=True)
            finally:
                for h in handles:
                    h.remove()
            with torch.no_grad():
                for p, g in zip(params, found):
                    if g is None:
                        continue
                    if p.grad is None:  # a fresh tensor in the parameter's layout (g may alias a sent gradient)
                        p.grad = torch.empty_like(p).copy_(g)
                    else:
                        p.grad += g



def _overrides(edges: list[Any], front: list[bool]) -> list[Any]:
    """Pre-hooks making each frontier node start from its recorded gradient, whatever other starts send it
    (a frontier node downstream of another one: a parameter used twice along one path)."""
    nodes = {e.node: e.node.metadata["torchspan_recorded"] for e, f in zip(edges, front) if f}

    def hook_for(recorded: tuple[Any, ...]) -> Any:
        def hook(grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
            return recorded

        return hook

    return [node.register_prehook(hook_for(rec)) for node, rec in nodes.items()]


def _whole(outputs: Sequence[torch.Tensor], grads: Sequence[Any], inputs: Sequence[torch.Tensor]) -> list[Any]:
    """One whole backward; the inputs' gradients it produced (read from their ``.grad``, set aside first)."""
    kept = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    if outputs:
        torch.autograd.backward(list(outputs), list(grads))
    found = [t.grad for t in inputs]
    for t, g in zip(inputs, kept):
        t.grad = g
    return found


def _marks(roots: list[Any], targets: set[Any]) -> tuple[dict[Any, bool], list[Any]]:
    """For every node reachable from ``roots``: whether it leads to one of ``targets``; and the nodes in
    post-order (children first). Nothing below a target is walked (the input pass stops there)."""
    leads: dict[Any, bool] = {}
    order: list[Any] = []
    stack: list[tuple[Any, bool]] = [(r, False) for r in roots]
    while stack:
        node, done = stack.pop()
        if done:
            leads[node] = node in targets or any(n is not None and leads[n] for n, _ in node.next_functions)
            order.append(node)
            continue
        if node in leads:
            continue
        leads[node] = False  # in progress (the graph is a DAG)
        stack.append((node, True))
        if node not in targets:
            stack.extend((n, False) for n, _ in node.next_functions if n is not None and n not in leads)
    return leads, order


def _param_sets(order: list[Any], to_input: dict[Any, bool], owner: dict[Any, int]) -> dict[Any, frozenset[int]]:
    """For each node leading to no input: the parameters (indices) it leads to."""
    found: dict[Any, frozenset[int]] = {}
    empty: frozenset[int] = frozenset()
    for node in order:  # children before parents
        if to_input[node]:
            continue
        here = {owner[node]} if node in owner else set()
        for n, _ in node.next_functions:
            if n is not None and not to_input[n]:
                here |= found[n]
        found[node] = frozenset(here) if here else empty
    return found


def _hooked(params: Sequence[torch.Tensor]) -> bool:
    return any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None) for p in params)


def _leaves(order: list[Any], in_nodes: set[Any]) -> list[torch.Tensor]:
    """The leaf tensors (``AccumulateGrad`` nodes) among ``order`` other than the inputs'."""
    return [n.variable for n in order if n not in in_nodes and hasattr(n, "variable")]


def input_backward(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[Any],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] | None = None,
) -> tuple[list[Any], Pending]:
    """The gradients of ``inputs`` (``None`` where none flows) from ``outputs`` with ``grads`` (``None``
    for a scalar loss), and the ``Pending`` weight pass of ``params`` (see the module docstring).

    Usage: ``grads, pending = input_backward(outs, out_grads, leaves, None); ...; pending.weights()``.
    """
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
    outputs, grads = [o for o, _ in pairs], [g for _, g in pairs]
    wanted = [t for t in inputs if t.requires_grad]
    if not outputs:
        return [None] * len(inputs), Pending()
    if not wanted or get_gradient_edge is None:
        return _whole(outputs, grads, list(inputs)), Pending()
    roots = [get_gradient_edge(o) for o in outputs]
    in_nodes = {get_gradient_edge(t).node for t in wanted}
    to_input, order = _marks([e.node for e in roots], in_nodes)
    if params is None:
        params = _leaves(order, in_nodes)
    params = [p for p in params if p.requires_grad]
    if not params or _hooked(params):
        return _whole(outputs, grads, list(inputs)), Pending()
    owner = {get_gradient_edge(p).node: i for i, p in enumerate(params)}
    below = _param_sets(order, to_input, owner)
    frontier: dict[Any, frozenset[int]] = {}
    for node in order:
        if to_input[node] and node not in in_nodes:
            reach = frozenset().union(*(below[n] for n, _ in node.next_functions if n is not None and not to_input[n]))
            if reach:
                frontier[node] = reach
    handles = [node.register_prehook(_record(node)) for node in frontier]
    try:
        found = torch.autograd.grad(outputs, wanted, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    starts = _starts(outputs, roots, grads, to_input, below, frontier)
    by_id = {id(t): g for t, g in zip(wanted, found)}
    return [by_id.get(id(t)) if t.requires_grad else None for t in inputs], Pending(_groups(starts, params))


def _record(node: Any) -> Any:
    def hook(grad_outputs: tuple[Any, ...]) -> None:
        node.metadata["torchspan_recorded"] = grad_outputs

    return hook


def _starts(
    outputs: list[torch.Tensor], roots: list[Any], grads: list[Any], to_input: dict[Any, bool],
    below: dict[Any, frozenset[int]], frontier: dict[Any, frozenset[int]],
) -> list[tuple[Any, torch.Tensor, frozenset[int], bool]]:  # fmt: skip
    """Where the weight pass starts: (edge, gradient, parameters reached, is a frontier node)."""
    starts: list[tuple[Any, torch.Tensor, frozenset[int], bool]] = []
    for node, reach in frontier.items():
        for k, g in enumerate(node.metadata.get("torchspan_recorded", ())):
            if g is not None:
                starts.append((GradientEdge(node, k), g, reach, True))
    direct: dict[tuple[Any, int], torch.Tensor] = {}
    for o, edge, g in zip(outputs, roots, grads):  # outputs whose graph reaches no input: their own gradients
        if to_input[edge.node] or not below[edge.node]:
            continue
        g = torch.ones_like(o) if g is None else g
        key = (edge.node, edge.output_nr)
        direct[key] = direct[key] + g if key in direct else g
    for (node, k), g in direct.items():
        starts.append((GradientEdge(node, k), g, below[node], False))
    return starts


def _groups(
    starts: list[tuple[Any, torch.Tensor, frozenset[int], bool]], params: list[torch.Tensor]
) -> list[tuple[list[Any], list[Any], list[torch.Tensor], list[bool]]]:
    """Starts joined when they reach a common parameter (union-find over parameter indices)."""
    parent = list(range(len(params)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for _, _, reach, _ in starts:
        first, *rest = reach
        for j in rest:
            parent[find(j)] = find(first)
    joined: dict[int, tuple[list[Any], list[Any], set[int], list[bool]]] = {}
    for edge, g, reach, front in starts:
        e, gs, ps, fr = joined.setdefault(find(next(iter(reach))), ([], [], set(), []))
        e.append(edge)
        gs.append(g)
        ps |= reach
        fr.append(front)
    return [(e, gs, [params[i] for i in sorted(ps)], fr) for e, gs, ps, fr in joined.values()]

"""A backward in two passes: the inputs' gradients now, the parameters' gradients later (zero-bubble).

``input_backward(outputs, grads, inputs, params)`` runs autograd from ``outputs`` (with ``grads``)
to ``inputs`` only, keeping the graph, and returns the inputs' gradients with a ``Pending`` whose
``weights()`` later adds the parameters' gradients into their ``.grad`` exactly as
``torch.autograd.backward(outputs, grads)`` would have: the weight pass ends in the parameters' own
``AccumulateGrad`` nodes (``backward(..., inputs=params)``), so ``.grad`` is set or added to in place
as ever, and hooks on the parameters fire (at the weight pass). ``params=None``: every leaf tensor
the graph reaches other than the inputs (what ``backward`` fills).

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
backward runs as the input pass), no parameter is reached, or this torch lacks ``GradientEdge``.
The fallback is exact, never a wrong split. Not for code that acts when a module's *input*
gradients are done and expects its weights' gradients by then (FSDP's post-backward reduction):
the caller runs whole backwards there.

Usage::

    grads, pending = input_backward([out], [g], [x], list(stage.parameters()))
    send(grads)          # the previous stage can go on
    pending.weights()    # later: the parameters' .grad as after backward
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import schedule as sched
from . import linearw
from .record import Recorder

__all__ = ["input_backward", "Pending", "weights_together", "run_actions"]

try:  # torch >= 2.4
    from torch.autograd.graph import GradientEdge, get_gradient_edge
except ImportError:  # pragma: no cover - older torch: whole backwards only
    GradientEdge = None  # type: ignore[assignment,misc]
    get_gradient_edge = None  # type: ignore[assignment]
try:  # the engine call behind torch.autograd.grad/backward, without their per-call checks
    from torch.autograd.graph import _engine_run_backward as _run
except ImportError:  # pragma: no cover

    def _run(
        outputs: Any,
        grads: Any,
        keep: bool,
        create: bool,
        inputs: Any,
        *,
        allow_unreachable: bool,
        accumulate_grad: bool,
    ) -> Any:
        if accumulate_grad:
            return torch.autograd.backward(outputs, grads, retain_graph=keep, inputs=inputs)
        return torch.autograd.grad(outputs, inputs, grads, retain_graph=keep, allow_unused=True)


_KEY = "torchspan_recorded"  # node.metadata: the gradient flowing into a frontier node in the input pass


class Pending:
    """The weight pass of one ``input_backward``: ``weights()`` once, later (then its graph is released)."""

    def __init__(
        self,
        groups: list[tuple[list[Any], list[Any], tuple[torch.Tensor, ...], int]] | None = None,
        linears: list[tuple[linearw.Linear, torch.Tensor]] | None = None,
    ) -> None:
        # per group: start edges, their gradients, the group's parameters, how many starts are frontier nodes
        self._groups = groups or []
        self._linears = (
            linears or []
        )  # merge=True: linear calls whose weight gradients are products still to take

    def __bool__(self) -> bool:
        return bool(self._groups or self._linears)

    def weights(self) -> None:
        """Add the parameters' gradients into ``.grad`` as ``torch.autograd.backward`` would.

        Usage: ``pending.weights()``.
        """
        weights_together([self])

    def _rest(self) -> None:
        """The weight pass of everything but the merged linear calls."""
        groups, self._groups = self._groups, []
        for edges, grads, params, fronts in groups:
            handles = _overrides(edges[:fronts]) if fronts > 1 else []
            try:
                _run(
                    tuple(edges),
                    tuple(grads),
                    True,
                    False,
                    params,
                    allow_unreachable=True,
                    accumulate_grad=True,
                )
            finally:
                for h in handles:
                    h.remove()


def weights_together(pendings: Sequence[Pending]) -> None:
    """The weight passes of several ``input_backward``s (micro-batches) at once: each linear layer's weight
    gradient over all of them as one matrix product (``linearw``), the rest of each pass as ``weights()``.

    Usage: ``weights_together([pending_mb0, pending_mb1])``.
    """
    records = [r for p in pendings for r in p._linears]
    for p in pendings:
        p._linears = []
    if (
        records
    ):  # into .grad through the leaves' own accumulators, as backward adds (hooks fire once per leaf)
        leaves = linearw.leaves(records)
        with torch.enable_grad():
            root = _Products.apply(records, *leaves)
        _run(
            (root,), (torch.ones_like(root),), False, False, (), allow_unreachable=True, accumulate_grad=True
        )
    for p in pendings:
        p._rest()


class _Products(torch.autograd.Function):
    """A graph node whose backward takes the merged products (``linearw.gradients``) and hands them to the
    leaves' accumulators. Made inside the engine, a gradient has no other reference, so an accumulator whose
    ``.grad`` is ``None`` keeps the tensor itself; given from Python, each would be copied first (a
    parameter's size per leaf: 4 MB per 1024 x 1024 weight)."""

    @staticmethod
    def forward(
        ctx: Any, records: list[tuple[linearw.Linear, torch.Tensor]], *leaves: torch.Tensor
    ) -> torch.Tensor:
        ctx.records = records
        return leaves[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[Any, ...]:
        records, ctx.records = ctx.records, None
        return (None, *linearw.gradients(records)[1])


def _overrides(edges: list[Any]) -> list[Any]:
    """Pre-hooks making each frontier node start from its recorded gradient, whatever other starts send it
    (a frontier node downstream of another one: a parameter used twice along one path)."""

    def hook_for(recorded: tuple[Any, ...]) -> Any:
        def hook(grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
            return recorded

        return hook

    nodes = {e.node for e in edges}
    return [node.register_prehook(hook_for(node.metadata[_KEY])) for node in nodes]


def _whole(
    outputs: Sequence[torch.Tensor], grads: Sequence[Any], inputs: Sequence[torch.Tensor]
) -> list[Any]:
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


_NONE: frozenset[int] = frozenset()


def _walk(
    roots: list[Any],
    targets: set[Any],
    owner: dict[Any, int] | None,
    linears: dict[Any, linearw.Linear] | None = None,
) -> tuple[dict[Any, Any], list[torch.Tensor]]:
    """One walk of the graph from ``roots`` (children before parents). Per node: ``True`` when it leads to
    one of ``targets``, else the parameter indices it leads to; ``owner`` maps the parameters'
    accumulators to indices (``None``: every leaf other than the targets is a parameter, found here).
    ``linears`` (merging): filled with the linear calls found (``linearw.find``), which count as targets
    (``True``) while the walk goes on below them."""
    found: dict[Any, Any] = {}
    leaves: list[torch.Tensor] = []
    stack: list[Any] = list(roots)
    while stack:
        node = stack[-1]
        if node in found:
            stack.pop()
            continue
        nexts = node.next_functions
        todo = [n for n, _ in nexts if n is not None and n not in found] if node not in targets else ()
        if todo:
            stack.extend(todo)
            continue
        stack.pop()
        if node in targets:
            found[node] = True
        elif not nexts:  # a leaf's accumulator (or a node leading nowhere)
            index = owner.get(node) if owner is not None else None
            if owner is None and hasattr(node, "variable") and node.variable.requires_grad:
                index = len(leaves)
                leaves.append(node.variable)
            found[node] = _NONE if index is None else frozenset((index,))
        else:
            below = [found[n] for n, _ in nexts if n is not None]
            found[node] = True if True in below else _NONE.union(*below)
            lin = linearw.find(node, owner) if linears is not None else None
            if lin is not None and all(found.get(a, _NONE) not in (True, _NONE) for a in lin.accumulators):
                linears[node] = lin  # type: ignore[index]
                found[node] = True
    return found, leaves


def input_backward(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[Any],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] | None = None,
    merge: bool = False,
) -> tuple[list[Any], Pending]:
    """The gradients of ``inputs`` (``None`` where none flows) from ``outputs`` with ``grads`` (``None``
    for a scalar loss), and the ``Pending`` weight pass of ``params`` (see the module docstring).

    ``merge``: linear calls (``linearw``) keep only their input and output gradient for the weight pass,
    so that ``weights_together`` takes one product over several micro-batches; the split is made then
    even when no input needs a gradient (a first stage). The graph is freed at once when nothing else
    is left for the weight pass.

    Usage: ``grads, pending = input_backward(outs, out_grads, leaves, None); ...; pending.weights()``.
    """
    pairs = [(o, torch.ones_like(o) if g is None else g) for o, g in zip(outputs, grads) if o.requires_grad]
    wanted = [t for t in inputs if t.requires_grad]
    if not pairs:
        return [None] * len(inputs), Pending()
    if get_gradient_edge is None or not (wanted or merge):
        return _whole([o for o, _ in pairs], [g for _, g in pairs], list(inputs)), Pending()
    roots = [get_gradient_edge(o) for o, _ in pairs]
    in_nodes = {get_gradient_edge(t).node for t in wanted}
    owner = (
        None
        if params is None
        else {get_gradient_edge(p).node: i for i, p in enumerate(params) if p.requires_grad}
    )
    linears: dict[Any, linearw.Linear] = {}
    marks, leaves = _walk([e.node for e in roots], in_nodes, owner, linears if merge else None)
    merged = _NONE.union(*(marks[a] for lin in linears.values() for a in lin.accumulators))
    frontier: dict[Any, frozenset[int]] = {}
    for node, mark in marks.items():
        if mark is True and node not in in_nodes:
            reach = _NONE.union(
                *(m for m in (marks[n] for n, _ in node.next_functions if n is not None) if m is not True)
            )
            if node in linears:  # its own weight and bias are merged; what its input leads to is not
                reach = reach - _NONE.union(*(marks[a] for a in linears[node].accumulators))
            if reach:
                frontier[node] = reach
    direct = [marks[e.node] for e in roots if marks[e.node] is not True]
    if merged and any(
        r & merged for r in [*frontier.values(), *direct]
    ):  # a merged weight also used otherwise
        return input_backward(outputs, grads, inputs, params, merge=False)
    if not linears and (not wanted or (not frontier and not any(direct))):
        return _whole([o for o, _ in pairs], [g for _, g in pairs], list(inputs)), Pending()
    keep = bool(frontier) or any(direct)  # else nothing restarts from the graph: free it now
    nodes = list(linears)
    handles = [node.register_prehook(_record(node)) for node in frontier if node not in linears]
    try:
        targets = (*wanted, *(GradientEdge(node, 0) for node in nodes))
        found = _run(
            tuple(o for o, _ in pairs),
            tuple(g for _, g in pairs),
            keep,
            False,
            targets,
            allow_unreachable=True,
            accumulate_grad=False,
        )
    finally:
        for h in handles:
            h.remove()
    records = []
    for node, g in zip(nodes, found[len(wanted) :]):
        if g is not None:
            records.append((linears[node], g))
            if node in frontier:
                node.metadata[_KEY] = (g,)
    params = leaves if params is None else list(params)
    starts = _starts(pairs, roots, marks, frontier) if keep else []
    by_id = {id(t): g for t, g in zip(wanted, found)}
    return [by_id.get(id(t)) if t.requires_grad else None for t in inputs], Pending(
        _groups(starts, params), records
    )


def _record(node: Any) -> Any:
    def hook(grad_outputs: tuple[Any, ...]) -> None:
        node.metadata[_KEY] = grad_outputs

    return hook


def _starts(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    roots: list[Any],
    marks: dict[Any, Any],
    frontier: dict[Any, frozenset[int]],
) -> list[tuple[Any, torch.Tensor, frozenset[int], bool]]:
    """Where the weight pass starts: (edge, gradient, parameters reached, is a frontier node)."""
    starts: list[tuple[Any, torch.Tensor, frozenset[int], bool]] = []
    for node, reach in frontier.items():
        for k, g in enumerate(node.metadata.get(_KEY, ())):
            if g is not None:
                starts.append((GradientEdge(node, k), g, reach, True))
    direct: dict[tuple[Any, int], torch.Tensor] = {}
    for (_, g), edge in zip(pairs, roots):  # outputs whose graph reaches no input: their own gradients
        mark = marks[edge.node]
        if mark is True or not mark:
            continue
        key = (edge.node, edge.output_nr)
        direct[key] = direct[key] + g if key in direct else g
    for (node, k), g in direct.items():
        starts.append((GradientEdge(node, k), g, marks[node], False))
    return starts


def _groups(
    starts: list[tuple[Any, torch.Tensor, frozenset[int], bool]], params: list[torch.Tensor]
) -> list[tuple[list[Any], list[Any], tuple[torch.Tensor, ...], int]]:
    """Starts joined when they reach a common parameter (union-find over parameter indices); in each
    group the frontier starts come first."""
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
    joined: dict[int, tuple[list[Any], list[Any], set[int], list[int]]] = {}
    for edge, g, reach, front in starts:  # frontier starts come first (_starts lists them first)
        e, gs, ps, fr = joined.setdefault(find(next(iter(reach))), ([], [], set(), [0]))
        e.append(edge)
        gs.append(g)
        ps |= reach
        fr[0] += front
    return [(e, gs, tuple(params[i] for i in sorted(ps)), fr[0]) for e, gs, ps, fr in joined.values()]


def run_actions(
    actions: Sequence[sched.Action],
    recorder: Recorder,
    device: torch.device,
    forward: Callable[[int], None],
    backward: Callable[[int, bool], Pending | None],
    merge: bool = False,
    before_last: Callable[[], None] | None = None,
    whole_input: bool = False,
) -> None:
    """One stage's schedule actions in order, each in its timeline block: ``forward(mb)``; ``backward(mb,
    split)`` (``split`` for zero-bubble's ``backward_input``, returning the ``Pending`` weight pass or
    ``None`` when it ran whole); ``backward_weight`` runs that pass later. ``merge``
    (``schedule.merges_weights``): a run of consecutive ``backward_weight`` actions is one
    ``weights_together`` pass, at the run's last action. ``before_last()``: called right before the last
    action that adds to the weights' gradients (a backward or a weight pass; not with ``merge``, whose
    pass adds a gradient per micro-batch), where a bucketed reduction is armed (``ranks.bucketed``);
    ``whole_input``: this stage's ``backward_input`` runs whole (nothing before it to send a gradient to),
    so it is the one adding to them.

    Usage: ``run_actions(sched.build("zero-bubble", 4, 2)[stage], recorder, device, fwd, bwd)``.
    """
    later: dict[int, Pending | None] = {}
    run: list[Pending] = []
    ends = sched.weight_run_ends(list(actions)) if merge else set()
    adding = (sched.BACKWARD, sched.BACKWARD_INPUT if whole_input else sched.BACKWARD_WEIGHT)
    adds = [i for i, a in enumerate(actions) if a.kind in adding]
    arm_at = adds[-1] if adds and before_last is not None and not merge else -1
    for i, a in enumerate(actions):
        if i == arm_at:
            assert before_last is not None
            before_last()
        if a.kind == sched.BACKWARD_WEIGHT:
            pending = later.pop(a.microbatch)
            if merge:
                run.extend([pending] if pending else [])
                if a.microbatch not in ends:
                    continue
                todo, run = run, []
                if todo:
                    with recorder.block(a.stage, device, a.microbatch, "backward_weight"):
                        weights_together(todo)
            elif pending:
                with recorder.block(a.stage, device, a.microbatch, "backward_weight"):
                    pending.weights()
            continue
        with recorder.block(
            a.stage, device, a.microbatch, "forward" if a.kind == sched.FORWARD else "backward"
        ):
            if a.kind == sched.FORWARD:
                forward(a.microbatch)
            else:
                later[a.microbatch] = backward(a.microbatch, a.kind == sched.BACKWARD_INPUT)

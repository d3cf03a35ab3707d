"""Which values cross between pipeline ranks, found from what each rank can compute itself.

Every rank of a pipeline runs the model's own forward (``runtime.ranks.ownforward``); a tensor is
real on a rank when that rank computed it and ``meta`` when another stage did (``taint``). At
each call of a layer, the rank owning the layer needs every argument real: each ``meta`` one is
sent by the latest earlier stage holding it real (or reused, when the owner received the very
same tensor for an earlier call of this forward). The ranks find this the first time a forward reaches a call
by a new path: each describes the call (``Seen``), they exchange descriptions, and ``route_call`` turns them
into the same ``CallRoute`` on every rank. Later forwards replay the routes and check that every rank
still sees what it saw (``CallRoute.check``): a forward that takes another path raises. A rank that
cannot run another stage's layer on ``meta`` says why in its ``Seen``; the route then has every
other rank take the outputs' shapes from the owner (``CallRoute.described``, ``metacalls``). A
value no stage holds (the model's code combined two stages' values) is rebuilt on the owner from
the glue ops that made it: the ranks compare how each made it (``glue``) and the owner receives
the operands earlier stages hold (``resolve_rebuilds``).

Usage (``RankOwnForwardExecutor`` does this)::

    seen = [Seen("model.layers.2", (GRAD, REAL), (None, None)),
            Seen("model.layers.2", (META, REAL), (None, None))]
    route = route_call(5, "model.layers.2", 1, seen)   # Transfer(leaf=0, src=0, dst=1, grad=True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...layers.reuse import balance_advice
from .glue import Node, layers_in, node_at

__all__ = [
    "META",
    "REAL",
    "GRAD",
    "Seen",
    "Transfer",
    "Reuse",
    "CallRoute",
    "route_call",
    "resolve_rebuilds",
    "DivergedError",
    "cut_advice",
    "check_last_stage",
]

META, REAL, GRAD = (
    0,
    1,
    2,
)  # a tensor argument as one rank sees it: another stage's; computed here; computed here with grad


class DivergedError(RuntimeError):
    """The ranks' forwards took different paths (or one rank's forward differs from the recorded one)."""


@dataclass(frozen=True)
class Seen:
    """One rank's view of one layer call: the layer, each tensor argument's code and, for a ``meta``
    argument the owner already received in this forward, the ``(call, leaf)`` where it did."""

    layer: str
    codes: tuple[int, ...]
    aliases: tuple[tuple[int, int] | None, ...]
    dtypes: tuple[
        Any, ...
    ] = ()  # per tensor argument (a meta one may lack autocast's dtype: the holder's counts)
    failed: str | None = (
        # another stage's layer: why it could not run on meta here (None: it ran; "torchspan: ...": refused)
        None
    )


@dataclass(frozen=True)
class Transfer:
    """Tensor argument ``leaf`` goes from stage ``src`` to the owner ``dst``; ``grad``: its gradient comes
    back."""

    leaf: int
    src: int
    dst: int
    grad: bool
    dtype: Any = None  # as the sender holds it (None: as the receiver's placeholder)
    path: tuple[int, ...] = ()  # below the argument, through the glue ops that made it (``glue``): an operand


@dataclass(frozen=True)
class Reuse:
    """Tensor argument ``leaf`` is what the owner received at ``call``'s argument ``at`` (no message)."""

    leaf: int
    call: int
    at: int


@dataclass
class CallRoute:
    """Call number ``call`` of a forward: ``layer`` on ``stage``; what each stage saw; what crosses."""

    call: int
    layer: str
    stage: int
    codes: list[tuple[int, ...]]  # per stage
    transfers: list[Transfer] = field(default_factory=list)
    reuses: list[Reuse] = field(default_factory=list)
    failures: list[tuple[int, str]] = field(
        default_factory=list
    )  # (stage, why) where the layer failed on meta
    rebuilds: list[int] = field(default_factory=list)  # arguments the owner replays from glue ops (``glue``)
    unresolved: list[int] = field(default_factory=list)  # held by no stage: ``resolve_rebuilds`` decides

    @property
    def described(self) -> bool:
        """Whether the other ranks take this call's outputs from the owner's description (it failed on
        meta)."""
        return bool(self.failures)

    def check(self, stage: int, layer: str, codes: tuple[int, ...]) -> None:
        """Raise ``DivergedError`` unless stage ``stage`` sees this call as it did when recorded."""
        if layer != self.layer or codes != self.codes[stage]:
            raise DivergedError(
                f"torchspan: this rank's forward left the recorded path at layer call {self.call}: it "
                f"calls {layer!r} with tensor arguments {_describe(codes)}, where the recorded forward "
                f"called {self.layer!r} with {_describe(self.codes[stage])}. Across ranks the model's "
                "forward must take the same path for inputs of the same structure (no branches on values "
                "computed by other stages, and a call's arguments must come from the same stages whenever "
                "it is reached the same way)"
            )


def _describe(codes: Sequence[int]) -> str:
    return "[" + ", ".join(("meta", "real", "real+grad")[c] for c in codes) + "]"


def route_call(
    call: int, layer: str, stage: int, seen: Sequence[Seen], pending: bool = False, looped: bool = False
) -> CallRoute:
    """The route of call ``call`` (``layer``, owned by ``stage``) from every stage's ``Seen`` (index = stage).

    Raises ``DivergedError`` when the stages disagree on the call, and ``ValueError`` when the
    owner needs a value no earlier stage computed (a later stage's value read by an earlier
    stage's layer: the stages are not in execution order). A value no stage holds (the model's
    code combined values of several stages) raises too, unless ``pending``: then it is listed in
    ``route.unresolved`` for ``resolve_rebuilds``. ``looped``: each stage is a rank holding several stages,
    and every other rank precedes this one (``ownlooped``): the value comes from the nearest one before it on
    the ring.
    """
    for s, view in enumerate(seen):
        if view.layer != layer or len(view.codes) != len(seen[stage].codes):
            raise DivergedError(
                f"torchspan: the ranks' forwards diverged at layer call {call}: stage {stage} calls "
                f"{layer!r} with {len(seen[stage].codes)} tensor argument(s), stage {s} calls "
                f"{view.layer!r} with {len(view.codes)}. Every rank must run the same forward: give every "
                "rank of a pipeline the same batch"
            )
    refused = [v.failed for v in seen if v.failed and v.failed.startswith("torchspan:")]
    if refused:  # a rank refused the call on meta: every rank raises it
        raise ValueError(refused[0])
    route = CallRoute(
        call,
        layer,
        stage,
        [v.codes for v in seen],
        failures=[(s, v.failed) for s, v in enumerate(seen) if v.failed],
    )
    owner = seen[stage]
    for i, code in enumerate(owner.codes):
        if code != META:
            continue
        alias = owner.aliases[i]
        if alias is not None:
            route.reuses.append(Reuse(i, alias[0], alias[1]))
            continue
        holders = [u for u in _before(stage, len(seen), looped) if seen[u].codes[i] != META]
        if not holders:
            later = [u for u in range(stage + 1, len(seen)) if seen[u].codes[i] != META]
            if later:
                raise ValueError(
                    f"torchspan: layer {layer!r} (stage {stage}) reads tensor argument {i}, which only "
                    f"later stage(s) {later} compute; a pipeline's stages must follow the model's "
                    "execution order. Re-plan, or place the layers with balance=[...] over the order "
                    "torchspan.layers.model_layers(model, example_inputs) records"
                )
            if not pending:
                raise ValueError(_combined(layer, stage, i, ""))
            route.unresolved.append(i)
            continue
        src = holders[-1]
        dtype = seen[src].dtypes[i] if seen[src].dtypes else None
        route.transfers.append(Transfer(i, src, stage, seen[src].codes[i] == GRAD, dtype))
    return route


def _combined(layer: str, stage: int, leaf: int, why: str, advice: str = "") -> str:
    fix = advice or "Move the cut so that both come from one stage (balance=[...])"
    return (
        f"torchspan: layer {layer!r} (stage {stage}) reads tensor argument {leaf}, which no single stage "
        f"computes: the model's own code combined values of different stages before this call (a skip "
        f"connection across the cut, e.g. head(h + skip) with skip from an earlier stage){why}. {fix}, or "
        "do the combination inside a layer"
    )


def resolve_rebuilds(
    route: CallRoute,
    trees: Sequence[dict[int, Node]],
    advise: Callable[[list[str]], str] | None = None,
    order: Sequence[str] = (),
    looped: bool = False,
) -> None:
    """For each of ``route.unresolved``, from every stage's ``glue`` tree of it (index = stage): the
    operands the owner receives (``Transfer`` with a ``path``) to replay the glue ops that made it
    (``route.rebuilds``). Raises ``ValueError`` when some operand is held by no earlier stage and cannot
    be replayed either, naming the layers whose outputs the value combines (in execution ``order`` when
    given; ``advise(layers)``: what to do; ``looped``: as ``route_call``). The same ``trees`` give the same
    answer on every rank."""
    stage = route.stage
    for leaf in route.unresolved:
        found: list[Transfer] = []
        nodes = [t.get(leaf) for t in trees]
        why = _resolve(stage, leaf, (), nodes, found, looped)
        if why:
            layers = sorted(layers_in(nodes), key=lambda n: order.index(n) if n in order else len(order))
            made = f"; it is made from the outputs of {', '.join(map(repr, layers))}" if layers else ""
            advice = advise(layers) if advise is not None else ""
            raise ValueError(
                _combined(
                    route.layer,
                    stage,
                    leaf,
                    f"{made}, and cannot be recomputed on stage {stage}: {why}",
                    advice,
                )
            )
        route.transfers.extend(found)
        route.rebuilds.append(leaf)
    route.unresolved = []


def _before(stage: int, stages: int, looped: bool) -> list[int]:
    """The stages a value may come from, the nearest last: earlier ones, or with ``looped`` every other on the
    ring."""
    return [(stage + 1 + j) % stages for j in range(stages - 1)] if looped else list(range(stage))


def _resolve(
    stage: int,
    leaf: int,
    path: tuple[int, ...],
    nodes: list[Node | None],
    found: list[Transfer],
    looped: bool = False,
) -> str:
    """Fill ``found`` with the transfers that let ``stage`` hold position ``path``; returns why not ('' when
    it can)."""
    own = nodes[stage]
    if own is None:
        return "the model's code made it differently on different ranks"
    if own[0] != META:
        return ""
    holders = [u for u in _before(stage, len(nodes), looped) if nodes[u] is not None and nodes[u][0] != META]  # type: ignore[index]
    if holders and path:
        src = holders[-1]
        held = nodes[src]
        found.append(Transfer(leaf, src, stage, held[0] == GRAD, held[1], path))  # type: ignore[index]
        return ""
    what = f"a value it is made of (operand {'.'.join(map(str, path))})" if path else "it"
    if own[2] is None:
        later = [u for u in range(stage + 1, len(nodes)) if nodes[u] is not None and nodes[u][0] != META]  # type: ignore[index]
        return (
            f"{what} is computed only by later stage(s) {later}"
            if later
            else f"{what} is made by an op torchspan does not record"
        )
    if not own[4]:
        return (
            f"{what} was changed in place after it was made (e.g. h += x or h.mul_(s)); write it out of "
            "place (h = h + x)"
        )
    for j in range(len(own[2])):
        why = _resolve(stage, leaf, (*path, j), [node_at(n, (j,)) for n in nodes], found, looped)
        if why:
            return why
    return ""


def cut_advice(groups: Sequence[Sequence[str]], layers: Sequence[str]) -> str:
    """Where ``groups`` (layer names per stage) cut between ``layers``, whose outputs the model's code
    combines, and the closest balance keeping them in one stage ('' when they are in one stage already)."""
    stage_of = {name: s for s, g in enumerate(groups) for name in g}
    order = [n for g in groups for n in g]
    named = [n for n in layers if n in stage_of]
    if len({stage_of[n] for n in named}) < 2:
        return ""
    first, last = min(stage_of[n] for n in named), max(stage_of[n] for n in named)
    cuts = ", ".join(f"between {groups[s][-1]!r} and {groups[s + 1][0]!r}" for s in range(first, last))
    together = [(min(order.index(n) for n in named), max(order.index(n) for n in named))]
    return (
        f"The cut {cuts} separates them: use {balance_advice(len(order), together, [len(g) for g in groups])}"
    )


def check_last_stage(ran: Sequence[str], groups: Sequence[Sequence[str]]) -> None:
    """The loss is taken on the last stage: raise ``ValueError`` unless it holds a layer the forward runs
    (``ran``: the layers the recording forward called, in order), with a balance that gives it one."""
    last = groups[-1]
    if not ran or any(name in ran for name in last):
        return
    order = [n for g in groups for n in g]
    fix = balance_advice(len(order), [(order.index(ran[-1]), len(order) - 1)], [len(g) for g in groups])
    raise ValueError(
        "torchspan: the last pipeline stage holds only layers the model's forward does not call "
        f"({', '.join(map(repr, last))}), so the model's outputs come from earlier stages while the loss "
        f"is taken on the last one; use {fix}"
    )

"""Which values cross between pipeline ranks, found from what each rank can compute itself.

Every rank of a pipeline runs the model's own forward (``runtime.ranks.ownforward``); a tensor is
real on a rank when that rank computed it and ``meta`` when another stage did (``taint``). At
each call of a layer, the rank owning the layer needs every argument real: each ``meta`` one is
sent by the latest earlier stage holding it real (or reused, when the owner received the very
same tensor for an earlier call of this forward). The ranks find this the first time a forward reaches a call by a new path:
each describes the call (``Seen``), they exchange descriptions, and ``route_call`` turns them into
the same ``CallRoute`` on every rank. Later forwards replay the routes and check that every rank
still sees what it saw (``CallRoute.check``): a forward that takes another path raises. A rank that
cannot run another stage's layer on ``meta`` says why in its ``Seen``; the route then has every
other rank take the outputs' shapes from the owner (``CallRoute.described``, ``metacalls``).

Usage (``RankOwnForwardExecutor`` does this)::

    seen = [Seen("model.layers.2", (GRAD, REAL), (None, None)), Seen("model.layers.2", (META, REAL), (None, None))]
    route = route_call(5, "model.layers.2", 1, seen)   # Transfer(leaf=0, src=0, dst=1, grad=True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["META", "REAL", "GRAD", "Seen", "Transfer", "Reuse", "CallRoute", "route_call", "DivergedError"]

META, REAL, GRAD = 0, 1, 2  # a tensor argument as one rank sees it: another stage's; computed here; computed here with grad


class DivergedError(RuntimeError):
    """The ranks' forwards took different paths (or one rank's forward differs from the recorded one)."""


@dataclass(frozen=True)
class Seen:
    """One rank's view of one layer call: the layer, each tensor argument's code and, for a ``meta``
    argument the owner already received in this forward, the ``(call, leaf)`` where it did."""

    layer: str
    codes: tuple[int, ...]
    aliases: tuple[tuple[int, int] | None, ...]
    dtypes: tuple[Any, ...] = ()  # per tensor argument (a meta one may lack autocast's dtype: the holder's counts)
    failed: str | None = None  # another stage's layer: why it could not run on meta here (None: it ran; "torchspan: ...": refused)


@dataclass(frozen=True)
class Transfer:
    """Tensor argument ``leaf`` goes from stage ``src`` to the owner ``dst``; ``grad``: its gradient comes back."""

    leaf: int
    src: int
    dst: int
    grad: bool
    dtype: Any = None  # as the sender holds it (None: as the receiver's placeholder)


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
    failures: list[tuple[int, str]] = field(default_factory=list)  # (stage, why) where the layer failed on meta

    @property
    def described(self) -> bool:
        """Whether the other ranks take this call's outputs from the owner's description (it failed on meta)."""
        return bool(self.failures)

    def check(self, stage: int, layer: str, codes: tuple[int, ...]) -> None:
        """Raise ``DivergedError`` unless stage ``stage`` sees this call as it did when recorded."""
        if layer != self.layer or codes != self.codes[stage]:
            raise DivergedError(
                f"torchspan: this rank's forward left the recorded path at layer call {self.call}: it calls {layer!r} "
                f"with tensor arguments {_describe(codes)}, where the recorded forward called {self.layer!r} with "
                f"{_describe(self.codes[stage])}. Across ranks the model's forward must take the same path for inputs "
                "of the same structure (no branches on values computed by other stages, and a call's arguments must "
                "come from the same stages whenever it is reached the same way)"
            )


def _describe(codes: Sequence[int]) -> str:
    return "[" + ", ".join(("meta", "real", "real+grad")[c] for c in codes) + "]"


def route_call(call: int, layer: str, stage: int, seen: Sequence[Seen]) -> CallRoute:
    """The route of call ``call`` (``layer``, owned by ``stage``) from every stage's ``Seen`` (index = stage).

    Raises ``DivergedError`` when the stages disagree on the call, and ``ValueError`` when the
    owner needs a value no earlier stage computed (a later stage's value read by an earlier
    stage's layer: the stages are not in execution order).
    """
    for s, view in enumerate(seen):
        if view.layer != layer or len(view.codes) != len(seen[stage].codes):
            raise DivergedError(
                f"torchspan: the ranks' forwards diverged at layer call {call}: stage {stage} calls {layer!r} with "
                f"{len(seen[stage].codes)} tensor argument(s), stage {s} calls {view.layer!r} with {len(view.codes)}. "
                "Every rank must run the same forward: give every rank of a pipeline the same batch"
            )
    refused = [v.failed for v in seen if v.failed and v.failed.startswith("torchspan:")]
    if refused:  # a rank refused the call on meta: every rank raises it
        raise ValueError(refused[0])
    route = CallRoute(call, layer, stage, [v.codes for v in seen], failures=[(s, v.failed) for s, v in enumerate(seen) if v.failed])
    owner = seen[stage]
    for i, code in enumerate(owner.codes):
        if code != META:
            continue
        alias = owner.aliases[i]
        if alias is not None:
            route.reuses.append(Reuse(i, alias[0], alias[1]))
            continue
        holders = [u for u in range(stage) if seen[u].codes[i] != META]
        if not holders:
            later = [u for u in range(stage + 1, len(seen)) if seen[u].codes[i] != META]
            if later:
                raise ValueError(
                    f"torchspan: layer {layer!r} (stage {stage}) reads tensor argument {i}, which only later stage(s) "
                    f"{later} compute; a pipeline's stages must follow the model's execution order. Re-plan, or place "
                    "the layers with balance=[...] over the order torchspan.layers.model_layers(model, example_inputs) records"
                )
            raise ValueError(
                f"torchspan: layer {layer!r} (stage {stage}) reads tensor argument {i}, which no single stage computes: "
                "the model's own code combined values of different stages before this call (a skip connection across "
                "the cut, e.g. head(h + skip) with skip from an earlier stage). Move the cut so that both come from "
                "one stage (balance=[...]), or do the combination inside a layer"
            )
        src = holders[-1]
        dtype = seen[src].dtypes[i] if seen[src].dtypes else None
        route.transfers.append(Transfer(i, src, stage, seen[src].codes[i] == GRAD, dtype))
    return route

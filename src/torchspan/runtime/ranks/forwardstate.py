"""One micro-batch's forward on a pipeline rank of the own-forward executor, and one layer call in it.

``Forward`` is where a forward is on the path of routes, what crossed and what backward needs;
``LayerCall`` one call of a layer (its flattened arguments, its place on the path); ``Path`` the
routes of the forwards seen so far. ``sent_tensor`` finds what this rank sends for a transfer and
``real_arguments`` makes an owner's call arguments real: received (``Transfer``), reused from an
earlier call (``Reuse``) or rebuilt from the glue ops that combined other stages' values
(``glue``: operands received, ops replayed).

Usage (``RankOwnForwardExecutor`` does this)::

    st = Forward(mb, grad=True, node=paths[True])
    c = LayerCall(st, "model.layers.3", 1, fn, args, kwargs)
    leaves_replaced = real_arguments(st, c, route, receive, device)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .glue import Recipes
from .routes import GRAD, META, REAL, CallRoute, DivergedError

__all__ = ["Forward", "LayerCall", "Path", "Shortcut", "real_arguments", "sent_tensor"]


class Path:
    """The routes of the forwards seen so far, as a tree: a call's signature (layer, pytree leaves,
    which are tensors) leads to its route and to the next call. Every rank runs the same Python on
    the same real values (another stage's values cannot steer it: they are meta), so every rank
    meets a new branch at the same call of the same micro-batch and records it together."""

    __slots__ = ("next", "shortcuts")

    def __init__(self) -> None:
        self.next: dict[tuple[Any, ...], tuple[CallRoute, Path]] = {}
        self.shortcuts: dict[
            tuple[str, int], Shortcut | None
        ] = {}  # (layer, arguments) -> its replay as last seen


class Shortcut:
    """Another stage's layer called at this place of the path with positional tensors, replayed on meta the
    last time: each argument as it was (meta or not, needing grad or not, shape, stride, dtype), the layer's
    training flag, where the path went next and the one new meta output (shape, stride, dtype). A call that
    matches all of it would pass the same route check and build the same output from the same template, so
    ``take`` does just that: the path moves on and the output is made, nothing else looked up.

    Usage: ``out = node.shortcuts[(name, len(args))].take(st, args, layer.training)`` (``None``: take the long
    way).
    """

    __slots__ = ("args", "training", "node", "out", "layer")

    def __init__(
        self,
        args: tuple[torch.Tensor, ...],
        grad: bool,
        training: bool,
        node: Path,
        out: torch.Tensor,
        layer: str,
    ) -> None:
        self.args = tuple((a.is_meta, grad and a.requires_grad, a.shape, a.stride(), a.dtype) for a in args)
        self.training, self.node, self.layer = training, node, layer
        self.out = (out.shape, out.stride(), out.dtype)

    def take(self, st: Forward, args: tuple[Any, ...], training: bool) -> torch.Tensor | None:
        if training is not self.training or len(args) != len(self.args):
            return None
        grad = st.grad
        for a, (meta, needs, shape, stride, dtype) in zip(args, self.args):
            if (
                not isinstance(a, torch.Tensor)
                or a.is_meta is not meta
                or (grad and a.requires_grad) is not needs
                or a.dtype is not dtype
                or a.shape != shape
                or a.stride() != stride
            ):
                return None
        st.call += 1
        st.node = self.node
        shape, stride, dtype = self.out
        out = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        st.made_by[id(out)] = (out, self.layer)
        return out


class Forward:
    """One micro-batch's forward on this rank: where it is, what crossed, what backward needs."""

    def __init__(
        self, mb: int, grad: bool, node: Path, metering: bool = False, recompute: bool = False
    ) -> None:
        self.mb, self.grad, self.node = mb, grad, node
        self.metering, self.recompute = metering, recompute
        self.call = 0
        self.at: dict[int, tuple[int, int]] = {}  # id(meta placeholder) -> (call, leaf) where it was received
        self.value: dict[tuple[int, int], torch.Tensor] = {}  # (call, leaf) -> the received tensor
        self.placeholders: list[torch.Tensor] = []  # kept alive: their ids stay unique for this forward
        self.sent: list[tuple[torch.Tensor, int]] = []  # (sent tensor whose gradient comes back, its stage)
        self.messages: dict[
            tuple[bool, int], int
        ] = {}  # (sent, other stage) -> values sent to / received from it so far
        self.inbound: list[
            tuple[torch.Tensor, int]
        ] = []  # (received leaf needing a gradient, its source stage)
        self.sent_after: list[
            int
        ] = []  # for each of ``sent``: how many of ``inbound`` were received before it
        self.loss: torch.Tensor | None = None
        self.recipes = Recipes()  # the glue's meta values, while the forward runs
        self.turn: Any = None  # interleaved 1F1B: pauses the forward between chunks (``owninterleaved``)
        # id(meta layer output) -> (it, the layer). Meta ones only: every layer's outputs are meta on some
        # rank, where a refusal finds its name; kept alive (no weakref: swap_tensors refuses a tensor that has
        # one).
        self.made_by: dict[int, tuple[torch.Tensor, str]] = {}

    def made(self, layer: str, out: Any) -> Any:
        """``out``, its meta tensors remembered as ``layer``'s outputs (named when a value combining stages is
        refused)."""
        for v in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
            if isinstance(v, torch.Tensor) and v.is_meta:
                self.made_by[id(v)] = (v, layer)
        return out

    def next_message(self, sent: bool, stage: int) -> int:
        """The number of this micro-batch's next value sent to (``sent``) or received from ``stage``, counting
        from 0."""
        seq = self.messages.get((sent, stage), 0)
        self.messages[(sent, stage)] = seq + 1
        return seq

    def layer_of(self, t: torch.Tensor) -> str | None:
        found = self.made_by.get(id(t))
        return found[1] if found is not None and found[0] is t else None

    def held(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s value on this rank: itself when real, what was received for it, else ``None``."""
        if not t.is_meta:
            return t
        at = self.at.get(id(t))
        return self.value[at] if at is not None else None

    def code(self, t: torch.Tensor) -> tuple[int, Any]:
        """``t`` as this rank sees it (``routes``' code) and its dtype, for a ``glue`` tree."""
        v = self.held(t)
        return (META if v is None else GRAD if self.grad and v.requires_grad else REAL), t.dtype


class LayerCall:
    """One call of a layer inside the forward: its flattened arguments and its place on the path
    (taking the call's number from ``st``)."""

    __slots__ = (
        "name",
        "stage",
        "fn",
        "args",
        "kwargs",
        "leaves",
        "spec",
        "where",
        "tensors",
        "k",
        "signature",
        "place",
    )

    def __init__(
        self, st: Forward, name: str, stage: int, fn: Callable[..., Any], args: Any, kwargs: Any
    ) -> None:
        self.name, self.stage, self.fn, self.args, self.kwargs = name, stage, fn, args, kwargs
        self.leaves, self.spec = _flat_call(args, kwargs)
        if self.spec is _CALL_SPECS.get(len(self.leaves)):  # positional tensors only (a block's usual call)
            self.where = list(range(len(self.leaves)))
            self.tensors: list[torch.Tensor] = list(self.leaves)
        else:
            self.where = [i for i, v in enumerate(self.leaves) if isinstance(v, torch.Tensor)]
            self.tensors = [self.leaves[i] for i in self.where]
        self.k = st.call
        st.call += 1
        self.signature = (name, len(self.leaves), tuple(self.where))
        self.place = (id(st.node), self.signature)  # where on the path tree: the same on every rank

    def codes(self, grad: bool) -> tuple[int, ...]:
        return tuple(META if t.is_meta else GRAD if grad and t.requires_grad else REAL for t in self.tensors)


_CALL_SPECS: dict[int, Any] = {}  # pytree spec of ``(args, {})`` for n tensor arguments (immutable, shared)


def _flat_call(args: Any, kwargs: Any) -> tuple[list[Any], Any]:
    """``tree_flatten((args, kwargs))``; positional tensors only (a layer's usual call) without the walk."""
    if (
        not kwargs
        and type(args) is tuple
        and type(kwargs) is dict
        and all(isinstance(v, torch.Tensor) for v in args)
    ):
        spec = _CALL_SPECS.get(len(args))
        if spec is None:
            spec = _CALL_SPECS[len(args)] = tree_flatten((args, kwargs))[1]
        return list(args), spec
    return tree_flatten((args, kwargs))


def call_leaves(args: Any, kwargs: Any) -> tuple[list[Any], Any]:
    """A call's flattened arguments and, to compare calls by, their structure: the number of leaves when the
    call is positional tensors only (its spec is then shared), else the pytree spec's text."""
    leaves, spec = _flat_call(args, kwargs)
    return leaves, len(leaves) if spec is _CALL_SPECS.get(len(leaves)) else str(spec)


def sent_tensor(st: Forward, c: LayerCall, leaf: int, path: tuple[int, ...]) -> torch.Tensor:
    """What this rank sends for argument ``leaf`` of ``c`` (at ``path`` below it, through the glue's
    recipes)."""
    t = c.tensors[leaf] if not path else st.recipes.at(c.tensors[leaf], path)
    if t is None or t.is_meta:
        raise DivergedError(
            f"torchspan: layer {c.name!r}'s argument {leaf} is no longer made as when its route was recorded "
            f"(operand {'.'.join(map(str, path))} of the glue that made it); the model's forward must make "
            "it the same way every time"
        )
    return t


def _take(st: Forward, held: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The glue's own placeholder ``held`` becomes the value ``got`` when it can (a residual ``h = block(h) +
    h`` reads it again); returns the value and whether only this call's argument could be replaced."""
    try:
        torch.utils.swap_tensors(held, got)
        return held, False
    except RuntimeError:  # a placeholder with views
        return got, True


def real_arguments(
    st: Forward,
    c: LayerCall,
    route: CallRoute,
    receive: Callable[[torch.Size, torch.dtype, int], torch.Tensor],
    device: torch.device,
) -> bool:
    """Make this (owner) rank's tensor arguments of ``c`` real in ``c.leaves``: received (``receive(shape,
    dtype, stage)``), reused or rebuilt (on ``device``). Returns whether the layer must get rebuilt
    containers."""
    replaced = False
    received: dict[int, dict[tuple[int, ...], torch.Tensor]] = {}
    for tr in route.transfers:
        held = c.tensors[tr.leaf] if not tr.path else st.recipes.at(c.tensors[tr.leaf], tr.path)
        if held is None:
            raise DivergedError(
                f"torchspan: layer {c.name!r}'s argument {tr.leaf} is no longer made as when its route was "
                "recorded"
            )
        dtype = tr.dtype if tr.dtype is not None else held.dtype  # autocast on the sender: its dtype
        got = receive(held.shape, dtype, tr.src)
        got, only_here = _take(st, held, got)
        if st.grad and tr.grad:
            got.requires_grad_(True)
            st.inbound.append((got, tr.src))
        st.placeholders.append(held)
        if tr.path:  # an operand: the glue ops that made the argument are replayed below
            received.setdefault(tr.leaf, {})[tr.path] = got
            continue
        replaced |= only_here
        _arrived(st, c, tr.leaf, held, got)
    for leaf in route.rebuilds:
        held = c.tensors[leaf]
        got = st.recipes.rebuild(held, received.get(leaf, {}), st.held, device)
        if got is None:
            raise DivergedError(
                f"torchspan: layer {c.name!r}'s argument {leaf} is no longer made as when its route was "
                "recorded"
            )
        got, only_here = _take(st, held, got)
        replaced |= only_here
        st.placeholders.append(held)
        _arrived(st, c, leaf, held, got)
    for r in route.reuses:
        if st.at.get(id(c.tensors[r.leaf])) != (r.call, r.at):
            raise DivergedError(
                f"torchspan: layer {c.name!r} no longer reads what call {r.call} received (argument {r.at})"
            )
        c.leaves[c.where[r.leaf]] = st.value[(r.call, r.at)]
        replaced = True
    return replaced


def _arrived(st: Forward, c: LayerCall, leaf: int, held: torch.Tensor, got: torch.Tensor) -> None:
    st.at[id(held)] = (c.k, leaf)
    st.value[(c.k, leaf)] = got
    c.leaves[c.where[leaf]] = got

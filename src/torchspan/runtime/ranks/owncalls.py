"""How one layer call runs on a rank of the own-forward pipeline: for real, on ``meta``, or replayed.

``OwnLayerCalls`` is the part of ``RankOwnForwardExecutor`` (``ranks.ownforward``) that each wrapped
layer call goes through inside the model's own forward: this rank's layer runs for real once the
arguments other stages computed are received; another stage's layer runs on ``meta`` (replayed
from its ``MetaCalls`` template, or a ``Shortcut`` when its arguments match the last replay), or
takes the shapes its owner describes when it cannot run on ``meta``; a new branch's route is found
with every rank of the pipeline (``routes``), and the values this rank holds for another stage are
sent at the call.

Usage (a mixin: the executor holds the transport, messages, meta calls and layers it reads)::

    class RankOwnForwardExecutor(OwnLayerCalls, StageExecutor): ...
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch.utils._pytree import tree_unflatten

from ...layers import buffer_slots
from ..layercall import run_layer
from .forwardstate import Forward, LayerCall, Path, Shortcut, real_arguments, sent_tensor
from .metacalls import MISSING, guarded, shape_key
from .owninterleaved import NEW_PATH
from .routes import META, CallRoute, DivergedError, Seen, cut_advice, resolve_rebuilds, route_call
from .taint import check_unchanged, container_sizes, meta_like
from .together import every_rank

__all__ = ["OwnLayerCalls", "NOT_RUN"]

NOT_RUN: Any = object()  # a meta call not run (yet)
_NOTHING = nullcontext()
_ABSENT: Any = object()  # a layer without a forward of its own (the class's runs)


class OwnLayerCalls:
    """One layer call inside the model's own forward on this rank (see the module docstring)."""

    stage: int
    device: torch.device
    layers: dict[str, Any]
    groups: Any
    settings: Any
    meter: Any
    _transport: Any
    _messages: Any
    _together: Any
    _described: Any
    _meta_calls: Any
    _swaps: Any
    _looped: Any
    _order: Any

    def _call(
        self, st: Forward, name: str, stage: int, fn: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any:
        local = stage == self.stage
        if not local and not kwargs:  # another stage's layer replayed here before, with these very arguments
            shortcut = st.node.shortcuts.get((name, len(args)))
            if shortcut is not None:
                out = shortcut.take(st, args, self.layers[name].training)
                if out is not None:
                    return out
        node = st.node
        c = LayerCall(st, name, stage, fn, args, kwargs)
        known = node.next.get(c.signature)
        ran, failed = NOT_RUN, None
        if known is None:  # a new branch: every rank of the pipeline is here too, and records its route
            if not local:  # tried first: a layer that fails on meta here takes its shapes from its owner
                ran, failed = self._try_meta(c)
            route = self._record(st, c, failed)
        else:  # a path taken before (every step but the first): its route, checked
            known[0].check(self.stage, name, c.codes(st.grad))
            route, st.node = known
        if route.transfers:
            self._send_values(st, c, route)
        if local:
            return self._run_here(st, c, route, known is None)
        if route.described:  # it failed on meta somewhere: shapes as its owner describes them
            meta = [meta_like(v) if isinstance(v, torch.Tensor) else v for v in c.leaves]
            key = shape_key(c.place, self.layers[name], meta)
            inputs = [t for t in meta if isinstance(t, torch.Tensor)]
            if known is not None:  # what its meta run leaves before failing (hooks recording router logits)
                self._meta_run(c, failing=True)
            return st.made(name, self._described.outputs(name, stage, key, inputs, route.failures))
        if ran is not NOT_RUN:
            return st.made(name, ran)
        out = st.made(name, self._meta_run(c))  # on meta, replayed once known
        if known is not None and not kwargs:
            self._shortcut(st, c, node, route, out)
        return out

    def _shortcut(self, st: Forward, c: LayerCall, node: Path, route: CallRoute, out: Any) -> None:
        """This replay as ``node``'s ``Shortcut`` for the layer (the latest shapes), or ``None`` for good when
        the call cannot be one: an argument not a tensor, a value sent from this rank, outputs other than one
        new meta tensor, a submodule hook to fire (``MetaCalls.single``)."""
        key = (c.name, len(c.args))
        if node.shortcuts.get(key, _ABSENT) is None:  # found not to be one before
            return
        layer = self.layers[c.name]
        single = (
            len(c.tensors) == len(c.args)
            and isinstance(out, torch.Tensor)
            and not any(tr.src == self.stage for tr in route.transfers)
            and self._meta_calls.single(c.place, layer, [meta_like(v) for v in c.tensors])
        )
        node.shortcuts[key] = (
            Shortcut(tuple(c.tensors), st.grad, layer.training, st.node, out, c.name) if single else None
        )

    def _send_values(self, st: Forward, c: LayerCall, route: CallRoute) -> None:
        """The arguments of ``c`` that this rank holds and another stage's layer needs."""
        for tr in route.transfers:
            if tr.src == self.stage:
                sent = sent_tensor(st, c, tr.leaf, tr.path)
                if tr.dtype is not None and sent.dtype != tr.dtype:
                    raise DivergedError(
                        f"torchspan: layer {c.name!r}'s argument {tr.leaf} is {sent.dtype} now, {tr.dtype} "
                        "when recorded"
                    )
                self._messages.send(st, sent, tr.dst)
                if st.grad and tr.grad:
                    st.sent.append((sent, tr.dst))
                    st.sent_after.append(len(st.inbound))

    def _record(self, st: Forward, c: LayerCall, failed: str | None) -> CallRoute:
        """A new branch's route, found with every rank of the pipeline (the same views: the same route or
        error)."""
        if st.turn is not None:  # every rank records a new call together: not in the interleaved order
            raise every_rank(DivergedError(NEW_PATH.format(mb=st.mb, where=f"layer {c.name!r}")))
        codes = c.codes(st.grad)
        local = c.stage == self.stage
        aliases = tuple(st.at.get(id(t)) if local and t.is_meta else None for t in c.tensors)
        dtypes = tuple(t.dtype for t in c.tensors)
        views = self._together.gather(Seen(c.name, codes, aliases, dtypes, failed))
        try:
            route = route_call(c.k, c.name, c.stage, views, pending=True, looped=self._looped)
            if route.unresolved:  # values the glue combined from several stages: how each rank made them
                views = self._together.gather(
                    {i: st.recipes.tree(c.tensors[i], st.code, st.layer_of) for i in route.unresolved}
                )
                resolve_rebuilds(
                    route, views, lambda layers: cut_advice(self.groups, layers), self._order, self._looped
                )
        except (ValueError, DivergedError) as exc:
            raise every_rank(exc) from None
        node = Path()
        st.node.next[c.signature] = (route, node)
        st.node = node
        return route

    def _try_meta(self, c: LayerCall) -> tuple[Any, str | None]:
        """Another stage's layer on meta, the first time its call is reached: its outputs, or why it
        failed."""
        try:
            return self._meta_run(c), None
        except Exception as exc:  # noqa: BLE001 - any failure: the owner describes the outputs instead
            text = str(exc)
            if text.startswith("torchspan:"):  # a refusal (e.g. a container changed): every rank raises it
                return NOT_RUN, text
            return NOT_RUN, f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]

    def _meta_run(self, c: LayerCall, failing: bool = False) -> Any:
        meta = [meta_like(v) if isinstance(v, torch.Tensor) else v for v in c.leaves]
        if not failing:  # a call shape seen before: its outputs without running it
            out = self._meta_calls.replay(c.place, self.layers[c.name], meta)
            if out is not MISSING:
                return out
        with torch.no_grad(), self._swaps.swapped(c.name):
            run = self._meta_calls.run_failed if failing else self._meta_calls.run
            return run(c.place, self.layers[c.name], guarded(c.fn, c.name), meta, c.spec)

    def _run_here(self, st: Forward, c: LayerCall, route: CallRoute, recording: bool) -> Any:
        """This stage's layer: arguments other stages computed are received (or reused), then it runs for
        real."""
        leaves, where = c.leaves, c.where
        replaced = bool(route.transfers or route.rebuilds or route.reuses) and real_arguments(
            st,
            c,
            route,
            lambda shape, dtype, src: self._messages.receive(st, c.name, shape, dtype, src),
            self.device,
        )
        real_args, real_kwargs = tree_unflatten(leaves, c.spec) if replaced else (c.args, c.kwargs)
        sizes = container_sizes((real_args, real_kwargs)) if replaced else []
        shared = []
        if recording:  # an in-place write to an input other ranks hold would leave theirs stale
            shared = [
                (i, leaves[where[i]], leaves[where[i]]._version)
                for i in range(len(c.tensors))
                if self._shared(route, i)
            ]
        with self.meter.saving(self.stage) if st.metering else _NOTHING:
            try:
                out = run_layer(
                    c.fn,
                    real_args,
                    real_kwargs,
                    device=self.device,
                    precision=self.settings.precision,
                    recompute=st.recompute,
                    slots=buffer_slots([self.layers[c.name]]) if st.recompute else (),
                )
            except BaseException as exc:
                if route.described:  # the other ranks may wait for this call's description: they stop too
                    self._describe(c, route, exc)
                    every_rank(exc)
                raise
        if route.described:
            self._describe(c, route, out)
        check_unchanged(sizes, c.name)
        for i, t, version in shared:
            if t._version != version:
                raise ValueError(
                    f"torchspan: layer {c.name!r} modifies its tensor argument {i} in place, and other "
                    "pipeline ranks hold that tensor too (they would keep the old value); make the layer "
                    "work out of place (e.g. nn.ReLU(inplace=False)) or run the model in one process"
                )
        return out

    def _describe(self, c: LayerCall, route: CallRoute, out: Any) -> None:
        key = shape_key(c.place, self.layers[c.name], c.leaves)
        self._described.send(c.name, c.stage, key, [c.leaves[i] for i in c.where], out, route.failures)

    def _shared(self, route: CallRoute, leaf: int) -> bool:
        """Whether argument ``leaf`` of this call is held by another rank too (received, or computed
        there)."""
        return any(t.leaf == leaf and not t.path for t in route.transfers) or any(
            codes[leaf] != META for s, codes in enumerate(route.codes) if s != self.stage
        )

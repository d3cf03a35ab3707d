"""Other stages' layers on ``meta``, run once per call shape and replayed from then on; or, for a
layer that cannot run on ``meta``, its outputs' shapes as the stage that runs it describes them.

A rank runs the layers of other stages on ``meta`` only for their outputs' shapes and dtypes, yet
torch's meta kernels for common ops (``addmm``, ``relu``, ``add``) are Python decompositions that
cost more than the real op on a small batch (``benchmarks/RESULTS.md``: half of a 2-rank step).
``MetaCalls`` runs such a call once per key (the call's route, its tensor arguments' shapes,
strides and dtypes, its plain arguments, the layer's training flag) and records the outputs as a
``_Template``: new ``meta`` tensors by shape/stride/dtype, or "the i-th argument itself". Every
call, the first included, returns outputs built from the template, so a forward behaves the same
whether or not the layer ran. A call with an argument or output that is not a tensor or a plain
value (a cache object a layer may update) is run every time.

Some layers cannot run on ``meta``: routing that depends on values (an MoE block's ``nonzero``/
``torch.where`` over the tokens each expert takes, a loop over the experts hit), kernels without a
meta implementation. Their outputs' shapes rarely depend on values (an MoE block returns its input's
shape), so the stage that runs the layer for real describes its outputs (``describe``: a template of
real tensors) and sends the description to the other ranks once per call shape (``shape_key``:
shapes and plain values only, the same on every rank); ``Described`` keeps what was sent or
received and checks, on the owner, that every later call of that shape returns those shapes.

Usage (``RankOwnForwardExecutor`` does this)::

    calls = MetaCalls()
    leaves, spec = tree_flatten(to_meta((args, kwargs)))
    out = calls.run(route, module, fn, leaves, spec)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

from .taint import check_unchanged, container_sizes, to_meta
from .together import every_rank

__all__ = ["MISSING", "MetaCalls", "Described", "TiedSwaps", "describe", "guarded", "shape_key"]

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
MISSING: Any = object()  # ``MetaCalls.replay``: no outputs recorded for this call
_LIMIT = 4096  # templates kept (distinct call shapes); past it the cache starts over


class _Template:
    """A call's outputs: the pytree spec, and per leaf ``("in", i)``, ``("new", shape, stride, dtype)`` or
    ``("value", v)``."""

    __slots__ = ("spec", "leaves", "_one")

    def __init__(self, spec: Any, leaves: list[tuple[Any, ...]]) -> None:
        self.spec, self.leaves = spec, leaves
        self._one = (
            len(leaves) == 1 and leaves[0][0] == "new" and spec.is_leaf()
        )  # one new tensor (most layers)

    def __getstate__(self) -> tuple[Any, ...]:  # sent to other ranks: the spec as text where it has one
        try:
            return ("text", treespec_dumps(self.spec), self.leaves)
        except Exception:  # noqa: BLE001 - a pytree node without a serialized name: pickled as is
            return ("spec", self.spec, self.leaves)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        kind, spec, leaves = state
        self.__init__(treespec_loads(spec) if kind == "text" else spec, leaves)  # type: ignore[misc]

    @classmethod
    def of(cls, out: Any, inputs: list[torch.Tensor], real: bool = False) -> _Template | None:
        """The template of ``out`` (``None`` when a leaf is neither a tensor nor a plain value, or, unless
        ``real``, a tensor that is not ``meta``)."""
        leaves, spec = tree_flatten(out)
        ids = {id(t): i for i, t in enumerate(inputs)}
        made: list[tuple[Any, ...]] = []
        for v in leaves:
            if isinstance(v, torch.Tensor):
                if not (real or v.is_meta):
                    return None
                made.append(
                    ("in", ids[id(v)]) if id(v) in ids else ("new", tuple(v.shape), v.stride(), v.dtype)
                )
            elif isinstance(v, _PLAIN):
                made.append(("value", v))
            else:
                return None
        return cls(spec, made)

    def shapes_of(self, out: Any) -> str | None:
        """``None`` when ``out``'s tensors have this template's shapes and dtypes, else what differs."""
        leaves, spec = tree_flatten(out)
        if len(leaves) != len(self.leaves):
            return f"{len(leaves)} outputs where the first call of this shape returned {len(self.leaves)}"
        for i, (v, leaf) in enumerate(zip(leaves, self.leaves)):
            if (
                leaf[0] == "new"
                and isinstance(v, torch.Tensor)
                and (tuple(v.shape), v.dtype) != (leaf[1], leaf[3])
            ):
                return (
                    f"output {i} is {tuple(v.shape)} {v.dtype} where the first call of this shape returned "
                    f"{leaf[1]} {leaf[3]}"
                )
        return None

    def build(self, inputs: list[torch.Tensor]) -> Any:
        if self._one:
            _, shape, stride, dtype = self.leaves[0]
            return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        out = []
        for leaf in self.leaves:
            if leaf[0] == "in":
                out.append(inputs[leaf[1]])
            elif leaf[0] == "new":
                out.append(torch.empty_strided(leaf[1], leaf[2], dtype=leaf[3], device="meta"))
            else:
                out.append(leaf[1])
        return tree_unflatten(out, self.spec)


class _SubHooks:
    """The forward hooks of a layer's submodules that fired while it ran on meta (transformers records
    router logits, attentions and hidden states so), fired again with meta stand-ins whenever a call is
    replayed without running: every call leaves what a meta run would have left."""

    __slots__ = ("calls",)

    def __init__(self, calls: list[tuple[nn.Module, _Template]]) -> None:
        self.calls = calls

    @classmethod
    def of(cls, fired: list[tuple[nn.Module, Any]]) -> _SubHooks | None:
        calls = []
        for module, seen in fired:
            template = _Template.of(seen, [])
            if template is None:
                return None
            calls.append((module, template))
        return cls(calls)

    def fire(self) -> None:
        for module, template in self.calls:
            args, kwargs, out = template.build([])
            for hook_id, hook in list(module._forward_hooks.items()):
                if hook_id in module._forward_hooks_with_kwargs:
                    hook(module, args, kwargs, out)
                else:
                    hook(module, args, out)


@contextmanager
def _watching(module: nn.Module) -> Iterator[list[tuple[nn.Module, Any]]]:
    """The calls of ``module``'s hooked submodules while it runs: ``(submodule, (args, kwargs, output))``."""
    hooked = {id(m) for m in module.modules() if m is not module and m._forward_hooks}
    fired: list[tuple[nn.Module, Any]] = []
    if not hooked:
        yield fired
        return

    def seen(sub: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        if id(sub) in hooked:
            fired.append((sub, (args, kwargs, out)))

    handle = register_module_forward_hook(seen, with_kwargs=True)
    try:
        yield fired
    finally:
        handle.remove()


class MetaCalls:
    """Templates of other stages' layer calls on this rank (see the module docstring)."""

    def __init__(self) -> None:
        self._templates: dict[tuple[Any, ...], tuple[_Template, _SubHooks | None]] = {}
        self._failed: dict[
            Any, _SubHooks | None
        ] = {}  # key -> submodule hooks that fired before the layer failed
        self.ran = 0  # calls that ran the layer (the rest were replayed)

    @staticmethod
    def _key(where: Any, module: nn.Module, leaves: list[Any]) -> tuple[Any, ...] | None:
        key: list[Any] = [where, module.training]
        for v in leaves:
            if isinstance(v, torch.Tensor):
                key.append((v.shape, v.stride(), v.dtype))  # a torch.Size hashes and compares as its tuple
            elif isinstance(v, _PLAIN):
                key.append(v)
            else:
                return None
        return tuple(key)

    def replay(self, where: Any, module: nn.Module, leaves: list[Any]) -> Any:
        """The outputs recorded for this call's key (its submodules' forward hooks fired again), or
        ``MISSING`` when the call has to run (``run``): a replay runs no layer code, so it needs no
        ``no_grad`` or tied swaps."""
        key = self._key(where, module, leaves)
        known = self._templates.get(key) if key is not None else None
        if known is None:
            return MISSING
        template, hooks = known
        if hooks is not None:
            hooks.fire()
        return template.build([t for t in leaves if isinstance(t, torch.Tensor)])

    def single(self, where: Any, module: nn.Module, leaves: list[Any]) -> bool:
        """Whether this call's recorded outputs are one new tensor and no submodule hook fires (a replay makes
        just that)."""
        key = self._key(where, module, leaves)
        known = self._templates.get(key) if key is not None else None
        return known is not None and known[1] is None and known[0]._one

    def run(self, where: Any, module: nn.Module, fn: Callable[..., Any], leaves: list[Any], spec: Any) -> Any:
        """``fn(*args, **kwargs)`` for the flattened ``(args, kwargs)`` (``leaves``: meta tensors and plain
        values, ``spec``), run without grad, or its recorded outputs for this call's key (``where``: the
        call's place in the forward, hashable), its submodules' forward hooks fired again."""
        inputs = [t for t in leaves if isinstance(t, torch.Tensor)]
        key = self._key(where, module, leaves)
        known = self._templates.get(key) if key is not None else None
        if known is None:
            self.ran += 1
            args, kwargs = tree_unflatten(leaves, spec)
            with _watching(module) as fired:
                try:
                    out = fn(*args, **kwargs)
                except Exception:
                    if key is not None:
                        if len(self._failed) >= _LIMIT:
                            self._failed.clear()
                        self._failed[key] = _SubHooks.of(fired)
                    raise
            template = _Template.of(out, inputs) if key is not None else None
            hooks = _SubHooks.of(fired) if fired else None
            if template is None or (fired and hooks is None):
                return out
            if len(self._templates) >= _LIMIT:
                self._templates.clear()
            self._templates[key] = (template, hooks)
            return template.build(inputs)
        template, hooks = known
        if hooks is not None:
            hooks.fire()
        return template.build(inputs)

    def run_failed(
        self, where: Any, module: nn.Module, fn: Callable[..., Any], leaves: list[Any], spec: Any
    ) -> None:
        """A call of a layer that fails on meta here (its outputs come from its owner's description): what its
        meta run leaves before failing, its submodules' forward hooks fired, as ``run`` would (run once per
        key)."""
        key = self._key(where, module, leaves)
        if key is not None and key in self._failed:
            hooks = self._failed[key]
            if hooks is not None:
                hooks.fire()
            return
        try:
            self.run(where, module, fn, leaves, spec)
        except Exception:  # noqa: BLE001 - expected: it failed on meta before
            pass


def shape_key(where: Any, module: nn.Module, leaves: list[Any]) -> tuple[Any, ...] | None:
    """A call's key that every rank computes alike: its place, the layer's training flag, its tensor
    arguments' shapes (a ``meta`` stand-in has its real value's shape, not always its dtype or strides)
    and its plain arguments; ``None`` when an argument is neither (then described at every call)."""
    key: list[Any] = [where, module.training]
    for v in leaves:
        if isinstance(v, torch.Tensor):
            key.append(tuple(v.shape))
        elif isinstance(v, _PLAIN):
            key.append(v)
        else:
            return None
    return tuple(key)


def describe(out: Any, inputs: list[torch.Tensor]) -> _Template | str:
    """The template of a layer's real outputs ``out`` (``inputs``: its tensor arguments), or why there is
    none."""
    template = _Template.of(out, inputs, real=True)
    if template is not None:
        return template
    odd = sorted(
        {type(v).__name__ for v in tree_flatten(out)[0] if not isinstance(v, (torch.Tensor, *_PLAIN))}
    )
    return f"it returns {', '.join(odd)}, which is neither a tensor nor a plain value"


class Described:
    """Outputs of layers that other ranks cannot run on ``meta``, described by the rank that runs them
    (see the module docstring). Per layer stage, the templates by ``shape_key``: received (other ranks)
    or sent (the owner, which checks later calls against them); every rank keeps the same keys, so
    every rank of the pipeline takes part in the same exchanges. ``gather(mine)``: every stage's
    ``mine`` (index = stage) from every rank of the pipeline (``together.Together.gather``);
    ``rank_of(stage)``: the global rank holding a stage.
    """

    def __init__(
        self, stages: int, gather: Callable[[Any], list[Any]], rank_of: Callable[[int], int]
    ) -> None:
        self._templates: list[dict[tuple[Any, ...], _Template]] = [{} for _ in range(stages)]
        self.gather, self.rank_of = gather, rank_of
        self.exchanged = 0  # descriptions sent or received

    def _keep(self, stage: int, key: tuple[Any, ...] | None, template: _Template) -> None:
        if key is not None:
            kept = self._templates[stage]
            if len(kept) >= _LIMIT:  # every rank clears a stage's templates at the same count
                kept.clear()
            kept[key] = template

    def _exchange(self, stage: int, sent: Any) -> Any:
        self.exchanged += 1
        return self.gather(sent)[stage]

    def outputs(
        self, layer: str, stage: int, key: tuple[Any, ...] | None, inputs: list[torch.Tensor], failures: Any
    ) -> Any:
        """On a rank that cannot run ``layer`` (of ``stage``) on meta: its outputs as meta tensors of the
        described shapes (``inputs``: the call's tensor arguments, meta). Raises what the owner raises."""
        template = self._templates[stage].get(key) if key is not None else None
        if template is None:
            got = self._exchange(stage, None)
            if isinstance(got, tuple):
                raise every_rank(
                    RuntimeError(
                        f"torchspan: stage {stage} (rank {self.rank_of(stage)}) failed running layer "
                        f"{layer!r}, whose outputs' shapes this rank waited for: {got[1]}; see that rank's "
                        "traceback"
                    )
                )
            _raise_refused(layer, stage, failures, got)
            template = got
            self._keep(stage, key, template)
        return template.build(inputs)

    def send(
        self,
        layer: str,
        stage: int,
        key: tuple[Any, ...] | None,
        inputs: list[torch.Tensor],
        out: Any,
        failures: Any,
    ) -> None:
        """On ``layer``'s owner, after the call (``out``: its outputs, or the exception it raised): the
        outputs' description, the first time this call shape is reached; later calls are checked against
        it."""
        template = self._templates[stage].get(key) if key is not None else None
        if isinstance(out, BaseException):
            if template is None:  # the other ranks wait for this call's description: they stop too
                self._exchange(stage, ("failed", f"{type(out).__name__}: {out}"[:500]))
            return
        if template is not None:
            differs = template.shapes_of(out)
            if differs is not None:
                raise ValueError(
                    f"torchspan: layer {layer!r}'s outputs change shape with the values of its inputs "
                    f"({differs}); the other ranks of the pipeline cannot run it on meta and take its "
                    "outputs' shapes from this rank once per input shape. Run this model in one process "
                    "(span with devices=[...])"
                )
            return
        made = describe(out, inputs)
        _raise_refused(layer, stage, failures, self._exchange(stage, made))
        self._keep(stage, key, made)  # type: ignore[arg-type]


def _raise_refused(layer: str, stage: int, failures: Any, got: Any) -> None:
    """The owner could not describe the outputs (``got``: why): every rank of the pipeline raises this."""
    if isinstance(got, str):
        meta = "; ".join(f"stage {s}: {why}" for s, why in failures)
        raise every_rank(
            ValueError(
                f"torchspan: layer {layer!r} (stage {stage}) cannot run on meta on the other ranks of the "
                f"pipeline ({meta}), and its outputs cannot be described to them by their shapes: {got}. "
                "Make the layer return tensors and plain values only (for a transformers model, "
                "use_cache=False), or run this model in one process (span with devices=[...])"
            )
        )


def guarded(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` on rebuilt (meta) arguments, raising if it changed a container it was given."""

    def run(*args: Any, **kwargs: Any) -> Any:
        sizes = container_sizes((args, kwargs))
        out = fn(*args, **kwargs)
        check_unchanged(sizes, name)
        return out

    return run


_UNSWAPPED = nullcontext()  # a layer holding no tied tensor (the usual case): nothing to swap


class TiedSwaps:
    """For other stages' layers (``layers``: name -> module), the tensors they hold real on this rank (tied to
    this stage's) with their ``meta`` stand-ins: ``swapped(name)`` makes that layer read the stand-ins while
    it runs on meta."""

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        self._swaps: dict[str, list[tuple[nn.Module, str, str, Any, Any]]] = {}
        for name, layer in layers.items():
            found = [
                (
                    sub,
                    kind,
                    key,
                    t,
                    nn.Parameter(to_meta(t), requires_grad=False) if kind == "_parameters" else to_meta(t),
                )
                for sub in layer.modules()
                for kind in ("_parameters", "_buffers")
                for key, t in getattr(sub, kind).items()
                if t is not None and not t.is_meta
            ]
            if found:
                self._swaps[name] = found

    def swapped(self, name: str) -> AbstractContextManager[None]:
        swaps = self._swaps.get(name)
        return _UNSWAPPED if swaps is None else self._swapping(swaps)

    @staticmethod
    @contextmanager
    def _swapping(swaps: list[tuple[nn.Module, str, str, Any, Any]]) -> Iterator[None]:
        for sub, kind, key, _, meta in swaps:
            getattr(sub, kind)[key] = meta
        try:
            yield
        finally:
            for sub, kind, key, t, _ in swaps:
                getattr(sub, kind)[key] = t

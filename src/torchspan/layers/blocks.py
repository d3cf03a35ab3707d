"""Layers that descend: the finest sensible blocks of a model, in the order one forward runs them.

A model is walked from the top. A module is *descended into* (its children considered instead) when
it is the model itself, holds a block container (``nn.ModuleList``/``nn.Sequential`` with a child
that has parameters) somewhere inside, holds a user split point, or never runs although modules
inside it do (its forward is bypassed). The children of the first container on a path are layers
and are not descended further (a GPT-2 block stays one layer); so are modules with no container
inside (embeddings, final norm, head, pooler). So GPT-2 gives ``transformer.wte``,
``transformer.wpe``, ``transformer.drop``, ``transformer.h.0`` … ``transformer.ln_f``,
``lm_head``; a model without containers gives its top-level children; an ``nn.Sequential`` its
children. ``no_split`` classes are never descended into; ``split_points`` force a layer boundary.

Order is *execution* order, recorded by ``calltrace.record_calls`` (one no-grad forward, random
state and buffers untouched); layers that never run follow, in registration order. Each layer
must run in one piece, because the runtime enforces stage turns with pre-hooks on layers:

- a layer that runs more than once per forward (ALBERT's shared layer) is **merged** into its
  innermost ancestor module that runs once and encloses every call (``Layer.merged`` says why);
  when no ancestor short of the whole model does (``for blk in self.blocks`` twice in the model's
  own forward), it stays a layer that is **called several times** (``Layer.calls``): every call
  must then run in its stage, which ``reuse.check_stages`` enforces on the stages (``LayerSet.calls``
  lists the layer of every call, in order);
- a layer called inside another layer, or whose sub-modules run outside its own call, is merged
  the same way; when no ancestor short of the whole model encloses it, ``find_layers`` raises
  ``ValueError`` naming the module;
- a module with no parameters and no buffers that runs other than once (a dropout reused, an
  unused activation) or inside another layer is not a layer at all: it has nothing to place
  (listed in ``LayerSet.skipped``).

Tensors owned by a descended-into module (the model's own ``nn.Parameter``) are *roots*, reported
with the layer that first reads them. Tied parameters: see ``ties.find_ties``.

Usage: ``layers = find_layers(model, input_ids)``; ``layers.names()``; ``param_layers(model, layers)``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from .calltrace import Trace, record_calls

__all__ = ["Layer", "RootTensor", "ForeignRead", "LayerSet", "find_layers", "param_layers"]

_CONTAINERS = (nn.ModuleList, nn.Sequential)


@dataclass(frozen=True, eq=False)
class Layer:
    """One placeable block: a module that is called once per forward (``calls`` times: see below).

    ``aliases``: other qualified names of the same module object. ``ran``: whether the recording
    forward called it. ``merged``: why finer blocks were merged into it ("" when they were not).
    ``calls``: how many times one forward calls it (more than 1: a module reused, e.g. weight sharing
    like ALBERT's, whose calls must all run in one stage).
    Counts and bytes are over the distinct tensors inside it (a tied parameter counts in each layer).
    """

    name: str
    module: nn.Module
    index: int
    param_count: int
    param_bytes: int
    buffer_bytes: int
    ran: bool = True
    aliases: tuple[str, ...] = ()
    merged: str = ""
    calls: int = 1


@dataclass(frozen=True)
class RootTensor:
    """A parameter or buffer held by a module that is not a layer (the model, a descended-into container).

    ``owner``: that module's qualified name ("" for the model). ``reader``: the innermost layer
    running when an op first read it, else the layer that had last started; None if read before
    any layer started, or never read.
    """

    name: str
    kind: str
    owner: str
    reader: str | None


@dataclass(frozen=True)
class ForeignRead:
    """A layer's tensor read while another layer (or no layer: ``reader`` None) was running."""

    name: str
    owner: str
    reader: str | None


@dataclass(frozen=True, eq=False)
class LayerSet(Sequence[Layer]):
    """The layers of a model in execution order, plus what the recording saw around them.

    ``calls``: the layer of every layer call of the recorded forward, in order (a layer called twice
    appears twice); empty when no forward was recorded.
    """

    layers: tuple[Layer, ...]
    roots: tuple[RootTensor, ...] = ()
    skipped: tuple[str, ...] = ()
    foreign_reads: tuple[ForeignRead, ...] = ()
    calls: tuple[str, ...] = ()

    def __getitem__(self, i: Any) -> Any:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)

    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def by_name(self, name: str) -> Layer:
        for layer in self.layers:
            if name == layer.name or name in layer.aliases:
                return layer
        raise ValueError(f"no layer named {name!r}; the layers are {self.names()}")


def _stateful(mod: nn.Module) -> bool:
    return any(True for _ in mod.parameters()) or any(True for _ in mod.buffers())


def _is_block_container(mod: nn.Module) -> bool:
    return isinstance(mod, _CONTAINERS) and any(_stateful(c) for c in mod.children())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _under(name: str, ancestor: str) -> bool:
    """Whether qualified ``name`` is ``ancestor`` or inside it (the model, "", holds everything)."""
    return not ancestor or name == ancestor or name.startswith(ancestor + ".")


def _keep_whole(mod: nn.Module, no_split: tuple[Any, ...]) -> bool:
    for cls in no_split:
        if (isinstance(cls, str) and type(mod).__name__ == cls) or (
            isinstance(cls, type) and isinstance(mod, cls)
        ):
            return True
    return False


def _check_options(
    model: nn.Module, split_points: Iterable[str] | None, no_split: Iterable[Any] | None
) -> tuple[list[str], tuple[Any, ...]]:
    names = [n for n, _ in model.named_modules(remove_duplicate=False)]
    points = [split_points] if isinstance(split_points, str) else list(split_points or [])
    for p in points:
        if not isinstance(p, str) or not p or p not in names:
            close = difflib.get_close_matches(str(p), names, n=3)
            raise ValueError(
                f"split_points entry {p!r} is not the qualified name of a module of {type(model).__name__}; "
                "use names from "
                f"model.named_modules(){', e.g. ' + ', '.join(map(repr, close)) if close else ''}"
            )
    kinds = tuple([no_split] if isinstance(no_split, (str, type)) else (no_split or []))
    for cls in kinds:
        if not (isinstance(cls, str) or (isinstance(cls, type) and issubclass(cls, nn.Module))):
            raise TypeError(
                f"no_split entries must be nn.Module subclasses or class names, got {cls!r}; e.g. "
                "no_split=[GPT2Block]"
            )
    return points, kinds


class _Picker:
    """Walks the module tree and keeps the current candidate layers and descended-into modules."""

    def __init__(self, model: nn.Module, trace: Trace, points: list[str], kinds: tuple[Any, ...]) -> None:
        self.model, self.trace, self.points, self.kinds = model, trace, points, kinds
        self.layers: dict[int, list[str]] = {}  # id(module) -> its qualified names (first: canonical)
        self.modules: dict[int, nn.Module] = {}
        self.descended: dict[str, nn.Module] = {}
        self.merged: dict[int, str] = {}
        self.skipped: list[str] = []
        self.reused: set[int] = (
            set()
        )  # layers called several times that no module short of the model encloses
        self.visit("", model, False)

    def visit(self, name: str, mod: nn.Module, in_container: bool) -> None:
        children = [(n, c) for n, c in mod._modules.items() if c is not None]
        split_inside = any(p.startswith(name + ".") for p in self.points) if name else True
        whole = mod is not self.model and _keep_whole(mod, self.kinds)
        if whole and split_inside:
            inner = [p for p in self.points if p.startswith(name + ".")]
            raise ValueError(
                f"split_points {inner} lie inside {name!r} ({type(mod).__name__}), a class listed in "
                "no_split; drop one of the two"
            )
        bypassed = not self.trace.ran(mod) and any(self.trace.ran(m) for m in mod.modules())
        descend = mod is self.model or (
            not whole
            and bool(children)
            and (
                split_inside
                or bypassed
                or (not in_container and any(_is_block_container(m) for m in mod.modules()))
            )
        )
        if not descend:
            self.layers.setdefault(id(mod), []).append(name)
            self.modules[id(mod)] = mod
            return
        if not children:
            raise ValueError(
                f"model ({type(mod).__name__}) has no child modules, so there is nothing to place on "
                "separate devices; wrap its pieces in nn.Module attributes or an nn.Sequential"
            )
        self.descended[name] = mod
        for cname, child in children:
            self.visit(_join(name, cname), child, in_container or isinstance(mod, _CONTAINERS))

    # -- checks ---------------------------------------------------------------------------------

    def owners(self) -> dict[int, list[int]]:
        """id(module) -> ids of the layers holding it."""
        out: dict[int, list[int]] = {}
        for lid, mod in self.modules.items():
            for m in mod.modules():
                out.setdefault(id(m), []).append(lid)
        return out

    def layer_call(self, call: int, strict: bool) -> int:
        """The innermost call of a layer enclosing ``call`` (-1: none)."""
        for c in self.trace.chain(call)[1 if strict else 0 :]:
            if id(self.trace.calls[c].module) in self.layers:
                return c
        return -1

    def conflict(self) -> tuple[list[int], list[int], str] | None:
        """The first layer that does not run once in one piece: (layer ids, calls to enclose, why)."""
        t = self.trace
        for lid, mod in self.modules.items():
            runs = t.outer_calls(mod)
            if (len(runs) > 1 and lid not in self.reused) or (not runs and not _stateful(mod)):
                return [lid], runs, f"{self.layers[lid][0]!r} runs {len(runs)} times in one forward"
        owners = self.owners()
        for i, call in enumerate(t.calls):
            mid = id(call.module)
            if mid not in owners:
                continue
            enc = self.layer_call(i, strict=True)
            enc_id = id(t.calls[enc].module) if enc >= 0 else None
            if mid in self.layers and enc_id is not None and enc_id != mid:
                return (
                    [mid, enc_id],
                    [i, enc],
                    f"{self.layers[mid][0]!r} is called inside {self.layers[enc_id][0]!r}",
                )
            if mid not in self.layers and enc_id not in owners[mid]:
                where = f"inside {self.layers[enc_id][0]!r}" if enc_id is not None else "outside every layer"
                inner = next(
                    n for n, m in self.model.named_modules(remove_duplicate=False) if m is call.module
                )
                lids = owners[mid] + ([enc_id] if enc_id is not None else [])
                return (
                    lids,
                    [i] + ([enc] if enc >= 0 else []),
                    f"{inner!r} (part of {self.layers[owners[mid][0]][0]!r}) is called {where}",
                )
        return None

    def resolve(self, lids: list[int], calls: list[int], why: str) -> None:
        """Drop a stateless layer, or merge the layers into their innermost ancestor that runs once around it
        all."""
        for lid in lids:
            if not _stateful(self.modules[lid]):
                self.skipped.extend(self.layers.pop(lid))
                del self.modules[lid]
                return
        t = self.trace
        names = [self.layers[lid][0] for lid in lids]
        parts = [n.split(".") for n in names]
        common = []
        for column in zip(*parts):
            if len(set(column)) > 1:
                break
            common.append(column[0])
        path = ".".join(common)
        if path in names:
            path = path.rpartition(".")[0]
        calls = calls + [c for lid in lids for c in t.calls_of(self.modules[lid])]
        while path:
            mod = self.descended.get(path)
            runs = t.outer_calls(mod) if mod is not None else []
            if len(runs) == 1 and all(t.inside(c, mod) for c in calls):
                self.absorb(path, mod, why)
                return
            path = path.rpartition(".")[0]
        if len(lids) == 1 and lids[0] not in self.reused and len(t.outer_calls(self.modules[lids[0]])) > 1:
            self.reused.add(lids[0])  # a layer called several times: the stages must keep its calls together
            return
        raise ValueError(
            f"{why}, and no module short of the whole model runs once around it, so it cannot be one "
            "layer of a pipeline. Give each use its own module (share the nn.Parameter instead: torchspan "
            "keeps tied parameters in step), or pass no_split=[<the enclosing class>] / split_points to "
            "choose the blocks"
        )

    def absorb(self, path: str, mod: nn.Module, why: str) -> None:
        for lid in [lid for lid, names in self.layers.items() if any(_under(n, path) for n in names)]:
            del self.layers[lid], self.modules[lid]
            self.reused.discard(lid)
        for name in [n for n in self.descended if _under(n, path)]:
            del self.descended[name]
        lost = [p for p in self.points if _under(p, path) and p != path]
        if lost:
            raise ValueError(
                f"split_points {lost} cannot hold: {why}, so all of {path!r} must be one layer; drop them"
            )
        self.layers[id(mod)] = [path]
        self.modules[id(mod)] = mod
        self.merged[id(mod)] = why


def find_layers(
    model: nn.Module,
    *args: Any,
    split_points: Iterable[str] | None = None,
    no_split: Iterable[Any] | None = None,
    **kwargs: Any,
) -> LayerSet:
    """The model's layers in execution order, recorded with one no-grad forward on ``args``/``kwargs``.

    ``split_points``: qualified module names that must start a layer (their ancestors are descended
    into). ``no_split``: module classes (or class names) kept whole. Raises ``ValueError`` for a
    model without children, an unknown split point, or a module that cannot be one layer.
    """
    points, kinds = _check_options(model, split_points, no_split)
    trace = record_calls(model, args, kwargs)
    picker = _Picker(model, trace, points, kinds)
    while (found := picker.conflict()) is not None:
        picker.resolve(*found)
    for p in points:
        if not any(p == names[0] for names in picker.layers.values()) and p not in picker.descended:
            raise ValueError(
                f"split point {p!r} is not a layer boundary: it names a module that is not a layer (an "
                f"alias of one, or a stateless module skipped: {picker.skipped}); name the module's first "
                "path in named_modules()"
            )

    def start(lid: int) -> float:
        runs = trace.outer_calls(picker.modules[lid])
        return trace.calls[runs[0]].start if runs else float("inf")

    order = sorted(picker.layers, key=start)  # stable: unrun layers keep registration order
    layers: list[Layer] = []
    for i, lid in enumerate(order):
        mod = picker.modules[lid]
        params, buffers = list(mod.parameters()), list(mod.buffers())
        layers.append(
            Layer(
                name=picker.layers[lid][0],
                module=mod,
                index=i,
                param_count=sum(p.numel() for p in params),
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                buffer_bytes=sum(b.numel() * b.element_size() for b in buffers),
                ran=trace.ran(mod),
                aliases=tuple(dict.fromkeys(picker.layers[lid][1:])),
                merged=picker.merged.get(lid, ""),
                calls=len(trace.outer_calls(mod)),
            )
        )
    return _annotate(model, trace, picker, layers)


def _reader(
    trace: Trace, by_id: dict[int, Layer], starts: list[tuple[int, str]], call: int, clock: int | None
) -> str | None:
    """The innermost layer whose call encloses ``call``; with ``clock``, else the layer last started before
    it."""
    for c in trace.chain(call):
        layer = by_id.get(id(trace.calls[c].module))
        if layer is not None:
            return layer.name
    if clock is None:
        return None
    before = [name for s, name in starts if s < clock]
    return before[-1] if before else None


def _annotate(model: nn.Module, trace: Trace, picker: _Picker, layers: list[Layer]) -> LayerSet:
    by_id = {id(layer.module): layer for layer in layers}
    starts = sorted(
        (trace.calls[c].start, layer.name) for layer in layers for c in trace.outer_calls(layer.module)
    )
    roots = []
    for owner, mod in picker.descended.items():
        tensors = [("parameter", n, t) for n, t in mod._parameters.items()] + [
            ("buffer", n, t) for n, t in mod._buffers.items()
        ]
        for kind, n, t in tensors:
            if t is None:
                continue
            first = trace.first_read.get(id(t))
            reader = _reader(trace, by_id, starts, first[1], first[0]) if first else None
            roots.append(RootTensor(_join(owner, n), kind, owner, reader))
    owners: dict[int, set[str]] = {}
    for layer in layers:
        for t in list(layer.module.parameters()) + list(layer.module.buffers()):
            owners.setdefault(id(t), set()).add(layer.name)
    foreign = []
    for layer in layers:
        named = list(layer.module.named_parameters(remove_duplicate=False)) + list(
            layer.module.named_buffers(remove_duplicate=False)
        )
        for n, t in named:
            for call in sorted(trace.reads.get(id(t), ())):
                reader = _reader(trace, by_id, starts, call, None)
                if reader not in owners[id(t)]:
                    foreign.append(ForeignRead(_join(layer.name, n), layer.name, reader))
    calls = tuple(name for _, name in starts)  # every layer call, in order
    return LayerSet(tuple(layers), tuple(roots), tuple(picker.skipped), tuple(dict.fromkeys(foreign)), calls)


def param_layers(model: nn.Module, layers: Sequence[Layer], buffers: bool = False) -> dict[str, str]:
    """Every qualified parameter name (tied aliases included; buffers too with ``buffers``) -> its layer's
    name.

    A name inside a layer maps to that layer; a root tensor (``LayerSet.roots``) to the layer that
    first reads it, or to the first layer when nothing reads it before any layer runs.
    Usage: ``param_layers(model, find_layers(model, x))["lm_head.weight"]`` → ``"lm_head"``.
    """
    if not layers:
        raise ValueError("layers is empty; pass the result of find_layers(model, *example_inputs)")
    prefixes = sorted(
        ((n, layer.name) for layer in layers for n in (layer.name, *layer.aliases)), key=lambda p: -len(p[0])
    )
    roots = {r.name: r.reader for r in getattr(layers, "roots", ())}
    first = min(layers, key=lambda layer: layer.index).name
    named = list(model.named_parameters(remove_duplicate=False))
    if buffers:
        named += list(model.named_buffers(remove_duplicate=False))
    out: dict[str, str] = {}
    for qname, _ in named:
        hit = next((lname for prefix, lname in prefixes if qname.startswith(prefix + ".")), None)
        if hit is None and qname not in roots and getattr(layers, "roots", None) is not None:
            raise ValueError(
                f"parameter {qname!r} is in no layer and not a root tensor: these layers are not from this "
                "model"
            )
        out[qname] = hit if hit is not None else (roots.get(qname) or first)
    return out

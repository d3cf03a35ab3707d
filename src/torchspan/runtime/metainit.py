"""A model built on ``meta`` given the weights it would have had: its own initialisation, replayed tensor by
tensor.

``with torch.device("meta"): model = MyModel()`` builds the structure and allocates nothing; nothing random is
drawn either, so the generator stands where a normal build would have started. ``span(model, ...,
weights="init")`` (``runtime.ranks.metaweights``) makes each rank hold only its part (an FSDP2 shard, a
pipeline stage) and then fills that part here, by running the model's own initialisation code again as a
normal build runs it, in the same order, with the same generator:

- **What a normal build runs**: every module's ``reset_parameters()`` (``_reset_parameters()`` for
  ``nn.MultiheadAttention``/``nn.Transformer``), a module's children before itself, as their constructors call
  them; and at the end of each transformers ``PreTrainedModel`` (its ``post_init``), ``initialize_weights()``:
  ``_init_weights`` on each of its modules (flags cleared first, as a normal build starts without them). A
  tied parameter is not tied yet while a normal build initialises it: writes through a holder other than its
  first (``lm_head`` of a tied ``embed_tokens``) go to a scratch tensor, as they went to the holder's own
  tensor that tying replaced. ``fn``: the user's own initialisation, run after that (``lambda m:
  m.init_weights()``).
- **One tensor at a time**: while that code runs, every parameter and buffer position holds a ``Deferred``
  stand-in (a tensor subclass with the shape, no storage). An op on it runs for real on a temporary full CPU
  tensor of that one parameter (created empty when the op overwrites it whole: ``normal_``, ``uniform_``,
  ``fill_``, ``zero_``, ``copy_``...; else from the value already written, read back from its slot); views
  stay stand-ins. After each module's call the temporaries are written to their slots (``Slot.write``: this
  rank's rows of an FSDP2 ``DTensor``, a stage's full tensor, nothing for another stage's) and dropped, so a
  rank holds its part and one module's tensors at most (``budget`` bytes: older temporaries are written out
  first).
- **Exact**: the random ops run on the CPU with the default generator, in the normal build's order, so the
  values are bit-equal to ``torch.manual_seed(s); MyModel()`` on the CPU for models initialised by the code
  above (every ``torch.nn`` layer, transformers models), and the generator ends where that build leaves it.
  Code that a constructor runs outside it (``nn.Parameter(torch.randn(...))``,
  ``self.apply(self._init_weights)`` in ``__init__``) is not seen: pass it as ``fn`` (values then follow it);
  a tensor no code writes whole is refused by name (``check``).

Usage (``metaweights`` does this)::

    slots = meta_slots(model)   # before sharding or placing
    ...materialize the rank's part...; bind(slots, model)
    run_init(model, slots)      # or a checkpoint's values through Slot.region / Slot.write_local
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .metaslots import Slot, bind, has_meta, materialize, meta_slots, restore

__all__ = ["Deferred", "Slot", "bind", "has_meta", "meta_slots", "materialize", "restore", "run_init"]

_aten = torch.ops.aten
# ops that write every element of their first argument without reading it
_OVERWRITES = {
    _aten.normal_.default,
    _aten.uniform_.default,
    _aten.fill_.Scalar,
    _aten.fill_.Tensor,
    _aten.zero_.default,
    _aten.copy_.default,
    _aten.bernoulli_.float,
    _aten.bernoulli_.Tensor,
    _aten.exponential_.default,
    _aten.random_.default,
    _aten.random_.to,
    getattr(_aten.random_, "from"),
    _aten.log_normal_.default,
    _aten.cauchy_.default,
    _aten.geometric_.default,
}
_BUDGET = 256 * 2**20


class Deferred(torch.Tensor):
    """A stand-in for one tensor of a meta-built model while its initialisation runs: shape, no storage; an op
    on it runs on its replay's temporary for that tensor (see the module docstring)."""

    _replay: Replay
    _key: int

    @staticmethod
    def __new__(
        cls,
        replay: Replay,
        key: int,
        size: Sequence[int],
        stride: Sequence[int],
        offset: int,
        dtype: torch.dtype,
    ) -> Deferred:
        t = torch.Tensor._make_wrapper_subclass(
            cls, size, strides=stride, storage_offset=offset, dtype=dtype, device="cpu", requires_grad=False
        )
        t._replay, t._key = replay, key
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        replay = next(a._replay for a in tree_flatten((args, kwargs))[0] if isinstance(a, Deferred))
        return replay.run(func, args, kwargs or {})

    def __repr__(self) -> str:
        return f"Deferred(shape={tuple(self.shape)}, dtype={self.dtype})"


class Replay:
    """The temporaries of one initialisation run (see the module docstring)."""

    def __init__(self, slots: Sequence[Slot], budget: int = _BUDGET) -> None:
        self.slots = {i: s for i, s in enumerate(slots)}
        self.numel = {i: s.numel for i, s in self.slots.items()}
        self.dtype = {i: s.meta.dtype for i, s in self.slots.items()}
        self.stand_ins = {i: self.stand_in(i, s.meta) for i, s in self.slots.items()}
        for i, s in self.slots.items():
            if isinstance(s.meta, nn.Parameter):
                # isinstance(w, nn.Parameter) holds
                self.stand_ins[i]._is_param = True  # type: ignore[attr-defined]
        self.tied = [(i, s) for i, s in self.slots.items() if len(s.positions) > 1]
        self.temps: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.defined: set[int] = set()  # written whole at some point: its value is the model's
        self.written: set[int] = set()  # its slot holds a value to read back
        self.budget = budget

    def stand_in(self, key: int, like: torch.Tensor) -> Deferred:
        return Deferred(self, key, like.size(), like.stride(), like.storage_offset(), like.dtype)

    def scratch(self, like: torch.Tensor) -> Deferred:
        """A stand-in whose writes go nowhere (a tie's other holder before tying)."""
        key = -1 - len(self.numel)
        self.numel[key] = (
            like.untyped_storage().nbytes() // max(like.element_size(), 1)
            if not isinstance(like, Deferred)
            else self.numel[like._key]
        )
        self.dtype[key] = like.dtype
        return self.stand_in(key, like)

    # ------------------------------------------------------------------ ops on stand-ins
    def run(self, func: Any, args: Any, kwargs: Any) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        first = flat[0] if flat else None
        whole = func in _OVERWRITES and isinstance(first, Deferred) and self._covers(first)
        real = [
            self._view(a, fresh=whole and i == 0) if isinstance(a, Deferred) else a
            for i, a in enumerate(flat)
        ]
        rargs, rkwargs = tree_unflatten(real, spec)
        returns = func._schema.returns
        out = func(*rargs, **rkwargs)
        if (
            isinstance(first, Deferred)
            and returns
            and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        ):
            return tree_map(
                lambda t: self._wrap(first._key, t) if isinstance(t, torch.Tensor) else t, out
            )  # a view stays a stand-in
        if whole:
            self.defined.add(first._key)  # type: ignore[union-attr]
        if any(
            r.alias_info is not None and r.alias_info.is_write for r in returns
        ):  # in place: the stand-in it wrote
            back = {id(r): a for r, a in zip(real, flat) if isinstance(a, Deferred)}
            return tree_map(lambda t: back.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)
        return out

    def _covers(self, t: Deferred) -> bool:
        return t.storage_offset() == 0 and t.numel() == self.numel[t._key] and t.is_contiguous()

    def _wrap(self, key: int, view: torch.Tensor) -> Deferred:
        if view.dtype != self.dtype[key]:
            raise ValueError(
                f"an initialisation viewed a {self.dtype[key]} tensor as {view.dtype}; torchspan cannot "
                "replay that on meta"
            )
        return Deferred(self, key, view.size(), view.stride(), view.storage_offset(), view.dtype)

    def _view(self, t: Deferred, fresh: bool) -> torch.Tensor:
        temp = self.temps.get(t._key)
        if temp is None:
            temp = self._start(t._key, fresh)
        else:
            self.temps.move_to_end(t._key)
        return temp.as_strided(t.size(), t.stride(), t.storage_offset())

    def _start(self, key: int, fresh: bool) -> torch.Tensor:
        size = self.numel[key] * torch.empty((), dtype=self.dtype[key]).element_size()
        while self.temps and sum(v.nbytes for v in self.temps.values()) + size > self.budget:
            self.flush([next(iter(self.temps))])
        slot = self.slots.get(key)
        if fresh:
            temp = torch.empty(self.numel[key], dtype=self.dtype[key])
        else:  # what was written so far (zeros where nothing was: the same on every rank)
            temp = torch.zeros(self.numel[key], dtype=self.dtype[key])
            value = slot.read() if slot is not None and key in self.written else None
            if value is not None:
                temp.as_strided(slot.meta.size(), slot.meta.stride(), slot.meta.storage_offset()).copy_(value)  # type: ignore[union-attr]
        self.temps[key] = temp
        return temp

    def flush(self, keys: Sequence[int] | None = None) -> None:
        """Write the temporaries (all, or ``keys``) to their slots and drop them."""
        for key in list(self.temps) if keys is None else keys:
            temp = self.temps.pop(key)
            slot = self.slots.get(key)
            if slot is not None and slot.dest is not None and key in self.defined:
                with torch.no_grad():
                    slot.write(
                        temp.as_strided(slot.meta.size(), slot.meta.stride(), slot.meta.storage_offset())
                    )
                self.written.add(key)

    # ------------------------------------------------------------------ positions
    @contextlib.contextmanager
    def standing_in(self) -> Iterator[None]:
        """Every slot's positions hold its stand-in; what they held comes back after."""
        held = [
            (module, kind, key, getattr(module, kind)[key])
            for s in self.slots.values()
            for module, kind, key in s.positions
        ]
        for i, s in self.slots.items():
            for module, kind, key in s.positions:
                getattr(module, kind)[key] = self.stand_ins[i]
        try:
            yield
        finally:
            for module, kind, key, t in held:
                getattr(module, kind)[key] = t

    @contextlib.contextmanager
    def own(self, module: nn.Module) -> Iterator[None]:
        """While ``module``'s initialisation runs: a tied tensor whose first holder is outside ``module`` is a
        scratch stand-in in ``module`` (a normal build initialises each holder's own tensor before tying
        them)."""
        inside = {id(m) for m in module.modules()}
        swapped = []
        for i, s in self.tied:
            if id(s.positions[0][0]) not in inside:
                for pos in s.positions[1:]:
                    if id(pos[0]) in inside:
                        swapped.append((pos, i))
                        getattr(pos[0], pos[1])[pos[2]] = self.scratch(self.stand_ins[i])
        try:
            yield
        finally:
            for (m, kind, key), i in swapped:
                getattr(m, kind)[key] = self.stand_ins[i]


def _pretrained(module: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (duck-typed: its ``post_init`` initialises weights by
    ``_init_weights``)."""
    return (
        callable(getattr(module, "post_init", None))
        and callable(getattr(module, "_init_weights", None))
        and hasattr(module, "config")
    )


def _construct(module: nn.Module, replay: Replay, seen: set[int], name: str = "") -> None:
    """What ``module``'s construction initialises, in its order: children first, then its own reset, then (a
    transformers model) its ``post_init``'s weight initialisation."""
    if id(module) in seen:
        return
    seen.add(id(module))
    for child_name, child in module.named_children():
        _construct(child, replay, seen, f"{name}.{child_name}" if name else child_name)
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    try:
        if callable(reset):
            with replay.own(module):
                reset()
            replay.flush()
        if _pretrained(module):
            _post_init(module, replay)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(
            f"span(..., weights='init'): the initialisation of {name or 'the model'} "
            f"({type(module).__name__}) failed on the meta model's stand-ins ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); load its weights from a checkpoint instead "
            "(weights='path/to/checkpoint')"
        ) from exc


def _post_init(model: nn.Module, replay: Replay) -> None:
    """transformers' ``initialize_weights`` on ``model``, each ``_init_weights(module)`` call written out
    after it."""
    patched = [m for m in model.modules() if _pretrained(m) and "_init_weights" not in m.__dict__]

    def each(original: Callable[[nn.Module], Any]) -> Callable[[nn.Module], Any]:
        def call(module: nn.Module) -> Any:
            with replay.own(module):
                out = original(module)
            replay.flush()
            return out

        return call

    for m in patched:
        m.__dict__["_init_weights"] = each(m._init_weights)
    try:
        init = getattr(model, "initialize_weights", None)
        if callable(init):
            init()
        else:  # older transformers: init_weights applies _initialize_weights / _init_weights
            model.apply(getattr(model, "_initialize_weights", model._init_weights))
    finally:
        for m in patched:
            m.__dict__.pop("_init_weights", None)
    replay.flush()


def _clear_flags(model: nn.Module) -> None:
    """transformers marks what it initialised (``_is_hf_initialized``); a normal build starts without the
    marks."""
    for m in model.modules():
        m.__dict__.pop("_is_hf_initialized", None)


def run_init(
    model: nn.Module,
    slots: Sequence[Slot],
    fn: Callable[[nn.Module], Any] | None = None,
    *,
    only: set[str] | None = None,
) -> list[str]:
    """Run ``model``'s initialisation (module docstring) into ``slots`` (bound: ``bind``); returns the names
    of the slots no code wrote whole (their values are not the model's; the same on every rank, held or not).
    ``only``: just these slots (non-persistent buffers a checkpoint lacks), by their modules' own
    initialisation; nothing else is written."""
    replay = Replay(slots if only is None else [s if s.name in only else _Nowhere(s) for s in slots])
    _clear_flags(model)
    with replay.standing_in(), torch.no_grad():
        if only is None:
            _construct(model, replay, set())
            if fn is not None:
                fn(model)
        else:
            _owners(model, replay, only)
        replay.flush()
    return [
        s.name
        for i, s in replay.slots.items()
        if (only is None or s.name in only) and i not in replay.defined
    ]


def _owners(model: nn.Module, replay: Replay, only: set[str]) -> None:
    """The modules holding the slots named ``only``: each one's reset and its transformers model's
    ``_init_weights``."""
    parents = {id(child): parent for parent in model.modules() for child in parent.children()}
    owners = {id(m): m for s in replay.slots.values() if s.name in only for m, _, _ in s.positions}
    for module in owners.values():
        reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
        if callable(reset):
            reset()
        owner: nn.Module | None = module
        while owner is not None and not _pretrained(owner):
            owner = parents.get(id(owner))
        if owner is not None:
            owner._init_weights(module)  # type: ignore[operator]
        replay.flush()


class _Nowhere(Slot):
    """A slot whose writes are dropped (``run_init(only=...)``)."""

    def __init__(self, slot: Slot) -> None:
        super().__init__(slot.meta, slot.names, slot.positions, slot.persistent)

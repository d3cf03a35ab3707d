"""Exact count of saved activations per stage, with ``torch.autograd.graph.saved_tensors_hooks``.

Every tensor autograd saves for backward while a stage's forward runs is packed into a small
holder; per storage, the union of the byte ranges its saved views cover is counted once per stage
while any holder refers to them (a micro-batch slice of the input counts as the slice; q, k and v
views of one fused projection count its storage once), and the holder's
finalizer (run when autograd frees the saved tensor) takes it off. Parameters and buffers are
not activations and are not counted. ``peak[s]`` is the most bytes alive at once on stage ``s``
since ``reset``.

Usage::

    meter = ActivationMeter(2)
    meter.reset(model.parameters())
    with meter.saving(0):
        loss = model(x).sum()
    meter.peak[0]
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["ActivationMeter", "MeteredSteps", "behaviour_key"]


class _Held:
    """A saved tensor plus the bookkeeping that un-counts it when autograd lets go of it."""

    __slots__ = ("tensor", "_meter", "_stage", "_key", "_span", "__weakref__")

    def __init__(
        self,
        tensor: torch.Tensor,
        meter: ActivationMeter,
        stage: int,
        key: tuple[Any, ...],
        span: tuple[int, int],
    ) -> None:
        self.tensor = tensor
        self._meter = meter
        self._stage = stage
        self._key = key
        self._span = span

    def __del__(self) -> None:
        self._meter._release(self._stage, self._key, self._span)


def _union_bytes(spans: dict[tuple[int, int], int]) -> int:
    """Bytes covered by the union of ``[start, end)`` byte ranges."""
    total, reach = 0, -1
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


class _Storage:
    """Live byte ranges of one storage held by one stage, and the bytes their union covers."""

    __slots__ = ("spans", "bytes")

    def __init__(self) -> None:
        self.spans: dict[tuple[int, int], int] = {}
        self.bytes = 0


class ActivationMeter:
    """Live and peak bytes of saved activations, per stage."""

    def __init__(self, stages: int) -> None:
        self.live = [0] * stages
        self.peak = [0] * stages
        self._refs: list[dict[tuple[Any, ...], _Storage]] = [{} for _ in range(stages)]
        self._exclude: frozenset[tuple[int, torch.device]] = frozenset()
        self.resets = 0  # how many times ``reset`` was called: a runner sees whether a new peak was asked for
        # what the current peak started from: live bytes, the excluded storages and the caller's ``state``
        self.start: tuple[Any, ...] = (tuple(self.live), self._exclude, None)
        # re-entrant: a garbage collection inside ``hold`` may finalize another holder in this thread
        self._lock = threading.RLock()

    def reset(self, exclude: Iterable[torch.Tensor] = (), state: Hashable = None) -> None:
        """Start a new peak from what is alive now; ``exclude`` (parameters, buffers) is never counted.

        ``state``: what else decides which tensors the coming step saves (``MeteredSteps`` compares it)."""
        keys = set()
        for t in exclude:
            key = self._key(t)
            if key is not None:
                keys.add(key)
        with self._lock:
            self._exclude = frozenset(keys)
            self.peak = list(self.live)
            self.resets += 1
            self.start = (tuple(self.live), self._exclude, state)

    def restart(self) -> None:
        """Start a new peak from what is alive now, excluding what the last ``reset`` excluded."""
        with self._lock:
            self.peak = list(self.live)
            self.start = (tuple(self.live), self._exclude, self.start[2])

    def repeat(self, peak: Iterable[int]) -> None:
        """The peak is ``peak``: a step that starts where a metered one started and saves what it saved."""
        with self._lock:
            self.peak = list(peak)

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[int, torch.device] | None:
        local = getattr(t, "_local_tensor", None)  # a DTensor's storage is its shard's (as ``hold`` keys it)
        try:
            return ((local if isinstance(local, torch.Tensor) else t).untyped_storage().data_ptr(), t.device)
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, some subclasses
            return None

    @staticmethod
    def _extent(t: torch.Tensor, storage_bytes: int) -> tuple[int, int]:
        """``[start, end)`` byte range of ``t`` inside its storage."""
        size = t.element_size()
        start = t.storage_offset() * size
        if t.numel() == 0:
            return start, start
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        return start, min(start + (last + 1) * size, storage_bytes)

    def hold(self, stage: int, t: torch.Tensor) -> Any:
        """Count ``t`` as a live activation of ``stage`` until the returned holder is dropped.

        Per storage, what counts is the union of the byte ranges its live saved views cover: a
        micro-batch slice of the input batch counts as the slice, and several views into one
        storage (q, k, v of a fused projection) count it once.
        """
        local = getattr(
            t, "_local_tensor", None
        )  # a DTensor (tensor parallel): its shard is what this rank holds
        try:
            storage = (local if isinstance(local, torch.Tensor) else t).untyped_storage()
            key = (storage.data_ptr(), t.device)
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, wrapper subclasses
            return t
        if isinstance(local, torch.Tensor):
            t_bytes = local
        else:
            t_bytes = t
        if key in self._exclude or t.is_meta:
            return t
        if t_bytes.is_contiguous():  # the common case: the extent without walking shape and strides
            start = t_bytes.storage_offset() * t_bytes.element_size()
            span = (start, start + t_bytes.numel() * t_bytes.element_size())
        else:
            span = self._extent(t_bytes, storage.nbytes())
        with self._lock:
            refs = self._refs[stage]
            entry = refs.get(key)
            if entry is None:  # the first live view of this storage: its bytes are its own extent
                entry = refs[key] = _Storage()
                entry.spans[span] = 1
                entry.bytes = span[1] - span[0]
                self._grow(stage, entry.bytes)
            else:
                count = entry.spans.get(span, 0)
                entry.spans[span] = count + 1
                if count == 0:
                    before, entry.bytes = entry.bytes, _union_bytes(entry.spans)
                    self._grow(stage, entry.bytes - before)
        # Keep a detached alias: holding `t` itself (an op's output still carrying its grad_fn) would
        # form a cycle through the C++ graph (grad_fn -> saved variable -> holder -> t -> grad_fn) that
        # no garbage collection frees when backward never runs. Autograd restores the link on unpack.
        return _Held(t.detach(), self, stage, key, span)

    def _grow(self, stage: int, added: int) -> None:
        """``added`` bytes more live on ``stage`` (the caller holds the lock); the peak follows."""
        live = self.live[stage] = self.live[stage] + added
        if live > self.peak[stage]:
            self.peak[stage] = live

    def _release(self, stage: int, key: tuple[Any, ...], span: tuple[int, int]) -> None:
        with self._lock:
            entry = self._refs[stage].get(key)
            if entry is None or span not in entry.spans:  # pragma: no cover - defensive
                return
            count = entry.spans[span] - 1
            if count:
                entry.spans[span] = count
                return
            del entry.spans[span]
            if not entry.spans:  # its last live view: the storage's bytes go
                self.live[stage] -= entry.bytes
                del self._refs[stage][key]
                return
            before, entry.bytes = entry.bytes, _union_bytes(entry.spans)
            self.live[stage] -= before - entry.bytes

    @staticmethod
    def unwrap(x: Any) -> Any:
        return x.tensor if type(x) is _Held else x

    @contextlib.contextmanager
    def saving(self, stage: int | Callable[[], int]) -> Iterator[None]:
        """Count what autograd saves inside the ``with`` for ``stage`` (or ``stage()`` at save time)."""
        hold = self.hold
        if callable(stage):
            which = stage

            def pack(t: torch.Tensor) -> Any:
                return hold(which(), t)

        else:
            fixed = stage

            def pack(t: torch.Tensor) -> Any:
                return hold(fixed, t)

        with torch.autograd.graph.saved_tensors_hooks(pack, self.unwrap):
            yield


class MeteredSteps:
    """Which training steps count saved activations (saved-tensor hooks on every saved tensor).

    A step counts when it does not look like the last metered one (its ``signature``: the
    micro-batches' structure, shapes and dtypes, whatever else decides what is saved), and then
    starts a new peak itself. One that looks the same saves the same tensors, so it runs without the
    hooks: where the caller asked for no new peak since (a rank's pipeline after its first step) the
    peak stays; where it did (``meter.reset``: a local ``Spanned`` every step) and the meter started
    from the same state (live bytes, excluded storages, the caller's ``state``: the loss, which
    parameters train, train/eval modes), the metered step's peak is the step's peak.

    Usage: ``if steps.wants(sig): ...run metered...; steps.done(sig)``.
    """

    def __init__(self, meter: ActivationMeter) -> None:
        self.meter = meter
        self._last: Any = None  # the last metered step's signature
        self._resets = meter.resets
        self._start: Any = None  # where the meter started for the metered step, and the peak it reached
        self._peak: list[int] = []

    @property
    def metered(self) -> bool:
        """Whether a training step has counted its saved activations."""
        return self._last is not None

    def wants(self, signature: Any) -> bool:
        """Whether the step with ``signature`` counts (a new peak is started when only its look changed)."""
        meter = self.meter
        if self._last is not None and signature == self._last:
            if meter.resets == self._resets:
                return False
            if meter.start == self._start:  # a new peak, from where the metered step started: its peak
                meter.repeat(self._peak)
                self._resets = meter.resets
                return False
        if meter.resets == self._resets:
            meter.restart()
        return True

    def done(self, signature: Any) -> None:
        """The step with ``signature`` was metered."""
        self._last, self._resets = signature, self.meter.resets
        self._start, self._peak = self.meter.start, list(self.meter.peak)


def behaviour_key(obj: Any) -> Hashable:
    """What a step's saved tensors may depend on in ``obj`` (a loss function), comparable step to step.

    A loss module by its class, options (plain attributes) and buffers' shapes, so ``nn.MSELoss()``
    made anew each call compares equal; a ``functools.partial`` by its function and arguments; any other
    callable by identity."""
    if isinstance(obj, torch.nn.Module):
        options = tuple((k, _value_key(v)) for k, v in sorted(vars(obj).items()) if not k.startswith("_"))
        tensors = tuple(
            (k, _value_key(t))
            for k, t in [*obj.named_buffers(recurse=False), *obj.named_parameters(recurse=False)]
        )
        children = tuple((k, behaviour_key(m)) for k, m in obj.named_children())
        return (type(obj), obj.training, options, tensors, children)
    if isinstance(obj, functools.partial):
        return (
            "partial",
            behaviour_key(obj.func),
            tuple(map(_value_key, obj.args)),
            tuple((k, _value_key(v)) for k, v in sorted(obj.keywords.items())),
        )
    return _value_key(obj)


def _value_key(v: Any) -> Hashable:
    """A plain value as itself, a tensor by shape, dtype, device and storage, anything else by identity."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return (type(v), v)
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype, v.device, v.requires_grad, ActivationMeter._key(v))
    return ("object", id(v), _Same(v))


class _Same:
    """Equal only to a holder of the very same object (never calls the object's own ``__eq__``)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

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
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["ActivationMeter", "MeteredSteps"]


class _Held:
    """A saved tensor plus the bookkeeping that un-counts it when autograd lets go of it."""

    __slots__ = ("tensor", "_meter", "_stage", "_key", "_span", "__weakref__")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, stage: int, key: tuple[Any, ...], span: tuple[int, int]) -> None:
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
        self._exclude: set[tuple[int, torch.device]] = set()
        self.resets = 0  # how many times ``reset`` was called: a runner sees whether a new peak was asked for
        # re-entrant: a garbage collection inside ``hold`` may finalize another holder in this thread
        self._lock = threading.RLock()

    def reset(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        """Start a new peak from what is alive now; ``exclude`` (parameters, buffers) is never counted."""
        keys = set()
        for t in exclude:
            key = self._key(t)
            if key is not None:
                keys.add(key)
        with self._lock:
            self._exclude = keys
            self.peak = list(self.live)
            self.resets += 1

    def restart(self) -> None:
        """Start a new peak from what is alive now, excluding what the last ``reset`` excluded."""
        with self._lock:
            self.peak = list(self.live)

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[int, torch.device] | None:
        try:
            return (t.untyped_storage().data_ptr(), t.device)
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
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, some subclasses
            return t
        key = (storage.data_ptr(), t.device)
        if key in self._exclude or t.is_meta:
            return t
        span = self._extent(t, storage.nbytes())
        with self._lock:
            entry = self._refs[stage].get(key)
            if entry is None:
                entry = self._refs[stage][key] = _Storage()
            count = entry.spans.get(span, 0)
            entry.spans[span] = count + 1
            if count == 0:
                before, entry.bytes = entry.bytes, _union_bytes(entry.spans)
                live = self.live[stage] = self.live[stage] + entry.bytes - before
                if live > self.peak[stage]:
                    self.peak[stage] = live
        # Keep a detached alias: holding `t` itself (an op's output still carrying its grad_fn) would
        # form a cycle through the C++ graph (grad_fn -> saved variable -> holder -> t -> grad_fn) that
        # no garbage collection frees when backward never runs. Autograd restores the link on unpack.
        return _Held(t.detach(), self, stage, key, span)

    def _release(self, stage: int, key: tuple[Any, ...], span: tuple[int, int]) -> None:
        with self._lock:
            entry = self._refs[stage].get(key)
            if entry is None or span not in entry.spans:  # pragma: no cover - defensive
                return
            entry.spans[span] -= 1
            if entry.spans[span] == 0:
                del entry.spans[span]
                before, entry.bytes = entry.bytes, _union_bytes(entry.spans)
                self.live[stage] -= before - entry.bytes
                if not entry.spans:
                    del self._refs[stage][key]

    @staticmethod
    def unwrap(x: Any) -> Any:
        return x.tensor if isinstance(x, _Held) else x

    @contextlib.contextmanager
    def saving(self, stage: int | Callable[[], int]) -> Iterator[None]:
        """Count what autograd saves inside the ``with`` for ``stage`` (or ``stage()`` at save time)."""
        which = stage if callable(stage) else (lambda: stage)

        def pack(t: torch.Tensor) -> Any:
            return self.hold(which(), t)

        with torch.autograd.graph.saved_tensors_hooks(pack, self.unwrap):
            yield


class MeteredSteps:
    """Which training steps count saved activations (saved-tensor hooks on every saved tensor).

    Always when the caller started a new peak since the last metered step (``meter.reset``: a
    local ``Spanned`` does every step, a rank's pipeline until one step is metered); otherwise only
    when the step does not look like the last metered one (its ``signature``: the micro-batches'
    structure, shapes and dtypes, whatever else decides what is saved), which then starts a new
    peak itself. A step that looks the same saves the same tensors, so the peak stays.

    Usage: ``if steps.wants(sig): ...run metered...; steps.done(sig)``.
    """

    def __init__(self, meter: ActivationMeter) -> None:
        self.meter = meter
        self._last: Any = None  # the last metered step's signature
        self._resets = meter.resets

    @property
    def metered(self) -> bool:
        """Whether a training step has counted its saved activations."""
        return self._last is not None

    def wants(self, signature: Any) -> bool:
        """Whether the step with ``signature`` counts (a new peak is started when only its look changed)."""
        if self.meter.resets == self._resets and signature == self._last:
            return False
        if self.meter.resets == self._resets:
            self.meter.restart()
        return True

    def done(self, signature: Any) -> None:
        """The step with ``signature`` was metered."""
        self._last, self._resets = signature, self.meter.resets

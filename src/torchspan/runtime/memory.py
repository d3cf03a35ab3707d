"""Exact count of saved activations per stage, with ``torch.autograd.graph.saved_tensors_hooks``.

Every tensor autograd saves for backward while a stage's forward runs is packed into a small
holder; the bytes it spans in its storage (a micro-batch slice of the input batch counts as the
slice, not the whole batch) are counted once per stage while any holder refers to them, and the holder's
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

__all__ = ["ActivationMeter"]


class _Held:
    """A saved tensor plus the bookkeeping that un-counts it when autograd lets go of it."""

    __slots__ = ("tensor", "_meter", "_stage", "_key", "__weakref__")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, stage: int, key: tuple[Any, ...]) -> None:
        self.tensor = tensor
        self._meter = meter
        self._stage = stage
        self._key = key

    def __del__(self) -> None:
        self._meter._release(self._stage, self._key)


class ActivationMeter:
    """Live and peak bytes of saved activations, per stage."""

    def __init__(self, stages: int) -> None:
        self.live = [0] * stages
        self.peak = [0] * stages
        self._refs: list[dict[tuple[Any, ...], list[int]]] = [{} for _ in range(stages)]
        self._exclude: set[tuple[int, torch.device]] = set()
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

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[int, torch.device] | None:
        try:
            return (t.untyped_storage().data_ptr(), t.device)
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, some subclasses
            return None

    @staticmethod
    def _extent(t: torch.Tensor, storage_bytes: int) -> tuple[int, int]:
        """(first byte offset, bytes spanned) of ``t`` inside its storage."""
        size = t.element_size()
        start = t.storage_offset() * size
        if t.numel() == 0:
            return start, 0
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        return start, min((last + 1) * size, storage_bytes - start)

    def hold(self, stage: int, t: torch.Tensor) -> Any:
        """Count ``t`` as a live activation of ``stage`` until the returned holder is dropped."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, some subclasses
            return t
        if (storage.data_ptr(), t.device) in self._exclude or t.is_meta:
            return t
        start, span = self._extent(t, storage.nbytes())
        # Views of one storage at the same place count once; distinct slices (micro-batches) each count.
        key = (storage.data_ptr() + start, span, t.device)
        with self._lock:
            entry = self._refs[stage].get(key)
            if entry is None:
                nbytes = span
                self._refs[stage][key] = [nbytes, 1]
                live = self.live[stage] = self.live[stage] + nbytes
                if live > self.peak[stage]:
                    self.peak[stage] = live
            else:
                entry[1] += 1
        return _Held(t, self, stage, key)

    def _release(self, stage: int, key: tuple[Any, ...]) -> None:
        with self._lock:
            entry = self._refs[stage].get(key)
            if entry is None:  # pragma: no cover - defensive
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._refs[stage][key]
                self.live[stage] -= entry[0]

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

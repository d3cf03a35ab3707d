"""Timeline recording: the ``Event`` record and the ``Recorder`` that collects one list per step.

An ``Event`` is one block of work (``kind`` in ``KINDS``) of one micro-batch in one stage on one
device; times are seconds from the start of the step.

CPU blocks are timed with ``time.perf_counter``. CUDA blocks record timing events on the stream
doing the work and are converted to seconds when the step ends (after its work is complete), so
blocks show when the GPU really ran them, not when the host queued them.

Usage::

    events = spanned.timeline()            # list[Event] of the last step
    rec = Recorder()
    rec.start_step([torch.device("cpu")])
    with rec.block(0, torch.device("cpu"), 0, "forward"):
        y = layer(x)
    rec.finish_step(); rec.events
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["Event", "KINDS", "Recorder"]

KINDS = (
    "forward",
    "backward",
    "transfer",
    "recompute",
    "backward_weight",
)  # backward_weight: zero-bubble's W


@dataclass(frozen=True)
class Event:
    """One block of work: ``kind`` of micro-batch ``microbatch`` in ``stage`` on ``device``."""

    step: int
    stage: int
    device: str
    microbatch: int
    kind: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Recorder:
    """Collects the timeline ``Event``s of the current step (``events`` holds the last step's)."""

    def __init__(self) -> None:
        self.step = 0
        self._events: list[Event] = []
        # Blocks as raw tuples (stage, device, microbatch, kind, start, end), append-only within a step;
        # ``events`` makes the Events when read, so a step whose timeline nobody reads costs a tuple per
        # block.
        self._raw: list[tuple[int, Any, int, str, float, float]] = []
        self._t0 = time.perf_counter()
        self._cuda_ref: dict[torch.device, tuple[Any, float]] = {}
        self._pending: list[tuple[int, str, int, str, Any, Any, torch.device]] = []
        self._lock = threading.Lock()

    @property
    def events(self) -> list[Event]:
        """The last step's events (of the step running, those recorded so far), sorted by start."""
        with self._lock:
            raw, done = self._raw, len(self._events)
            if len(raw) > done:  # append-only within a step: workers may still be adding
                self._events.extend(
                    Event(self.step, s, str(d), mb, k, a, b) for s, d, mb, k, a, b in raw[done : len(raw)]
                )
                self._events.sort(key=lambda e: (e.start, e.stage))
            return self._events

    def start_step(self, devices: Sequence[torch.device]) -> None:
        """Begin a new step: forget the previous step's events; time 0 is now."""
        self.step += 1
        self._events = []
        self._raw = []
        self._pending = []
        self._cuda_ref = {}
        self._t0 = time.perf_counter()
        for dev in dict.fromkeys(devices):
            if dev.type == "cuda":  # pragma: no cover - needs a GPU
                ref = torch.cuda.Event(enable_timing=True)
                ref.record(torch.cuda.current_stream(dev))
                self._cuda_ref[dev] = (ref, time.perf_counter() - self._t0)

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def add(
        self, stage: int, device: torch.device | str, microbatch: int, kind: str, start: float, end: float
    ) -> None:
        """Record a block timed by the caller (seconds from step start)."""
        self._raw.append((stage, device, microbatch, kind, start, end))  # list.append is atomic

    def block(self, stage: int, device: torch.device, microbatch: int, kind: str, stream: Any = None) -> Any:
        """Time the work done inside the ``with`` as one block of ``kind``."""
        if device.type == "cuda" and device in self._cuda_ref:  # pragma: no cover - needs a GPU
            return self._cuda_block(stage, device, microbatch, kind, stream)
        return _Block(self, stage, device, microbatch, kind)

    @contextlib.contextmanager
    def _cuda_block(
        self, stage: int, device: torch.device, microbatch: int, kind: str, stream: Any
    ) -> Iterator[None]:  # pragma: no cover - needs a GPU
        stream = stream or torch.cuda.current_stream(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            with self._lock:
                self._pending.append((stage, str(device), microbatch, kind, start, end, device))

    def finish_step(self) -> None:
        """Resolve CUDA blocks into seconds (waits for their work); ``events`` sorts them by start when
        read."""
        for stage, dev_name, mb, kind, start, end, dev in self._pending:  # pragma: no cover - needs a GPU
            ref, offset = self._cuda_ref[dev]
            end.synchronize()
            s = offset + ref.elapsed_time(start) / 1e3
            e = offset + ref.elapsed_time(end) / 1e3
            self._raw.append((stage, dev_name, mb, kind, s, e))
        self._pending = []


class _Block:
    """``Recorder.block`` on the host clock: a plain context manager (cheaper than a generator's)."""

    __slots__ = ("_rec", "_stage", "_device", "_mb", "_kind", "_start")

    def __init__(self, rec: Recorder, stage: int, device: Any, microbatch: int, kind: str) -> None:
        self._rec, self._stage, self._device, self._mb, self._kind = rec, stage, device, microbatch, kind

    def __enter__(self) -> None:
        self._start = time.perf_counter() - self._rec._t0

    def __exit__(self, *exc: Any) -> None:
        rec = self._rec
        rec._raw.append(
            (self._stage, self._device, self._mb, self._kind, self._start, time.perf_counter() - rec._t0)
        )

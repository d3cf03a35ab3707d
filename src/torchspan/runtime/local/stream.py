"""Streams and copies between stages' devices.

On a GPU each device gets a *copy stream*, so a transfer overlaps the next computation; the CPU
(and any other device) has a no-op stream and copies there are ordinary synchronous copies.

Usage::

    moved, ready = transfer(tensors, torch.device("cuda:0"), torch.device("cpu"))
    wait_ready(ready, torch.device("cpu"))      # before the consumer reads ``moved``
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

__all__ = ["copy_stream", "use_device", "transfer", "wait_ready", "Ready"]

_copy_streams: dict[torch.device, Any] = {}
_lock = threading.Lock()


def copy_stream(device: torch.device) -> Any:
    """The dedicated copy stream of a CUDA ``device`` (created once); ``None`` elsewhere."""
    if device.type != "cuda":
        return None
    with _lock:  # pragma: no cover - needs a GPU
        stream = _copy_streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            _copy_streams[device] = stream
        return stream


_NOTHING = contextlib.nullcontext()  # reusable: entering it does nothing


def use_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` current in this thread (CUDA); nothing to do for CPU and others (a shared no-op)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return _NOTHING


class Ready:
    """Marks when a transfer's data may be read: a CUDA event, or nothing (already done)."""

    __slots__ = ("event",)

    def __init__(self, event: Any = None) -> None:
        self.event = event


def transfer(values: list[Any], src: torch.device, dst: torch.device) -> tuple[list[Any], Ready]:
    """Copy the tensors among ``values`` from ``src`` to ``dst`` (others pass through).

    On CUDA the copy runs ``non_blocking`` on a copy stream after the producer's current stream,
    and the returned ``Ready`` tells the consumer what to wait for. Tensors are detached: the
    runtime connects stages through explicit gradients, not through autograd.
    """
    if src == dst:
        return [v.detach() if isinstance(v, torch.Tensor) else v for v in values], Ready()
    cuda_side = src if src.type == "cuda" else dst if dst.type == "cuda" else None
    if cuda_side is None:
        return [v.detach().to(dst) if isinstance(v, torch.Tensor) else v for v in values], Ready()
    stream = copy_stream(cuda_side)
    with torch.cuda.device(cuda_side):  # pragma: no cover - needs a GPU
        stream.wait_stream(torch.cuda.current_stream(cuda_side))
        out: list[Any] = []
        with torch.cuda.stream(stream):
            for v in values:
                if isinstance(v, torch.Tensor):
                    if v.device.type == "cuda":
                        v.record_stream(stream)  # keep the source alive until the copy ran
                    moved = v.detach().to(dst, non_blocking=True)
                    out.append(moved)
                else:
                    out.append(v)
        event = torch.cuda.Event()
        event.record(stream)
    return out, Ready(event)


def wait_ready(ready: Ready, dst: torch.device, values: list[Any] | None = None) -> None:
    """Make the consumer on ``dst`` wait until a transfer's data has arrived."""
    if ready.event is None:
        return
    if dst.type != "cuda":  # pragma: no cover - needs a GPU
        ready.event.synchronize()  # a non_blocking copy to host memory is done only after this
        return
    stream = torch.cuda.current_stream(dst)  # pragma: no cover - needs a GPU
    stream.wait_event(ready.event)  # pragma: no cover
    for v in values or []:  # pragma: no cover
        if isinstance(v, torch.Tensor) and v.device.type == "cuda":
            v.record_stream(stream)  # allocated on the copy stream, used on the compute stream

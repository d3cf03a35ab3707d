"""Workers: one thread per device, a mailbox between them, and errors that never hang.

``run_workers(jobs)`` runs each job (a function taking the shared ``Mailbox``) in its own thread,
except that a single job runs in the caller's thread. When any job raises, the mailbox is
aborted so every other job stops at its next ``get``; once all have stopped, the first error is
re-raised in the caller with its original traceback.

A ``Transport`` says which of a pipeline's stages run in this process and carries values to and
from the others: the base class keeps every stage here (the mailbox carries everything);
``torchspan.runtime.ranks.p2p.RankTransport`` runs one rank's stages and sends the rest by
``torch.distributed`` point-to-point. ``Pipeline`` runs the same schedule walk over either.

Usage::

    def producer(box): box.put(("act", 1, 0), tensor)
    def consumer(box): use(box.get(("act", 1, 0)))
    run_workers([producer, consumer])
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

__all__ = [
    "Mailbox",
    "Aborted",
    "Transport",
    "run_workers",
    "worker_groups",
    "intra_op_threads",
    "note_failure",
]


class Aborted(Exception):
    """Raised inside a worker waiting on a mailbox that another worker's failure aborted."""


class Mailbox:
    """Values handed between workers by key; ``get`` blocks until the value is there."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[Hashable, Any] = {}
        self._aborted = False

    def put(self, key: Hashable, value: Any) -> None:
        with self._cond:
            self._items[key] = value
            self._cond.notify_all()

    def get(self, key: Hashable) -> Any:
        with self._cond:
            while key not in self._items:
                if self._aborted:
                    raise Aborted(f"step aborted while waiting for {key!r}")
                self._cond.wait()
            return self._items.pop(key)

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            self._items.clear()


class _OneWorkerBox(Mailbox):
    """The mailbox of a single worker: no other thread puts or waits, so no lock and no waiting.

    A value taken before it was put can never arrive (nobody else runs): that is an error, not a wait."""

    def put(self, key: Hashable, value: Any) -> None:
        self._items[key] = value

    def get(self, key: Hashable) -> Any:
        try:
            return self._items.pop(key)
        except KeyError:
            raise RuntimeError(
                f"torchspan's only worker asked for {key!r} before any step put it there (a schedule out "
                "of order)"
            ) from None


class Transport:
    """Where a pipeline's stages run and how values reach stages in other processes.

    This base runs every stage in this process: values between stages go through the ``Mailbox``
    (and device copies), so ``send``/``receive`` are never called. A transport across processes
    overrides them all. Usage: ``Pipeline(devices, ..., transport=RankTransport(mesh, rank, device))``.
    """

    def is_local(self, stage: int) -> bool:
        """True where ``stage`` runs in this process."""
        return True

    def where(self, stage: int) -> str:
        """Words naming where ``stage`` runs, for error notes (empty: this process)."""
        return ""

    def send(
        self, values: list[Any], spec: Any, src: int, dst: int, kind: str, mb: int = 0, seq: int = 0
    ) -> None:
        """Hand ``values`` (flattened leaves, ``spec`` their pytree spec) of micro-batch ``mb`` (its
        ``seq``-th message of ``kind``) from local ``src`` to remote ``dst``."""
        raise RuntimeError(
            f"stage {dst} runs in this process: its values go through the mailbox, not a transport"
        )

    def receive(self, src: int, dst: int, kind: str, mb: int = 0, seq: int = 0) -> tuple[list[Any], Any]:
        """The ``(values, spec)`` of micro-batch ``mb`` (its ``seq``-th message) that remote ``src`` sent to
        local ``dst`` with ``kind`` (``"fwd"``/``"bwd"``)."""
        raise RuntimeError(
            f"stage {src} runs in this process: its values come through the mailbox, not a transport"
        )

    def expect(self, src: int, dst: int, kind: str, mbs: Sequence[int]) -> None:
        """Micro-batches ``mbs`` of ``kind`` will come from remote ``src`` to local ``dst`` in this order: a
        transport may post their receives now (nothing to do in one process)."""

    def finish(self, ok: bool) -> None:
        """End of a run: wait for sends still in flight (``ok``), or drop them after an error."""


def worker_groups(devices: Sequence[torch.device], per_stage: bool = False) -> list[list[int]]:
    """Stage indices per worker thread: one worker per distinct device (stages sharing it take turns),
    or one per stage (``per_stage``)."""
    if per_stage:
        return [[s] for s in range(len(devices))]
    by_dev: dict[torch.device, list[int]] = {}
    for s, d in enumerate(devices):
        by_dev.setdefault(d, []).append(s)
    return list(by_dev.values())


def intra_op_threads(
    devices: Sequence[torch.device], groups: Sequence[Sequence[int]], limit: int | None = None
) -> int | None:
    """Intra-op threads for each CPU worker when several run at once (the cores split between them, no
    oversubscription); ``None`` where one CPU worker or none runs. ``limit``: at most this many run at
    once."""
    cpu_workers = sum(1 for g in groups if g and devices[g[0]].type == "cpu")
    if limit is not None:
        cpu_workers = min(cpu_workers, limit)
    return max(1, torch.get_num_threads() // cpu_workers) if cpu_workers > 1 else None


def note_failure(exc: BaseException, where: str) -> None:
    """Add ``(raised by torchspan <where>)`` to ``exc``'s notes, once (the innermost torchspan frame wins)."""
    if not hasattr(exc, "add_note") or getattr(exc, "_torchspan_noted", False):
        return
    exc.add_note(f"(raised by torchspan{where})")
    exc._torchspan_noted = True  # type: ignore[attr-defined]


def run_workers(jobs: Sequence[Callable[[Mailbox], None]], names: Sequence[str] | None = None) -> None:
    """Run ``jobs`` concurrently (one in the caller's thread if there is only one)."""
    if len(jobs) == 1:
        box: Mailbox = _OneWorkerBox()
        try:
            jobs[0](box)
        finally:
            box.clear()
        return
    box = Mailbox()
    errors: list[BaseException] = []
    lock = threading.Lock()
    num_threads = torch.get_num_threads()
    grad_enabled = torch.is_grad_enabled()

    def target(job: Callable[[Mailbox], None]) -> None:
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)
        try:
            with torch.set_grad_enabled(grad_enabled):
                job(box)
        except Aborted:
            pass
        except BaseException as exc:  # re-raised in the caller below
            with lock:
                errors.append(exc)
            box.abort()

    threads = [
        threading.Thread(
            target=target, args=(job,), name=(names[i] if names else f"torchspan-worker-{i}"), daemon=True
        )
        for i, job in enumerate(jobs)
    ]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.1)
    except BaseException:  # KeyboardInterrupt in the caller: stop the workers, then re-raise
        box.abort()
        for t in threads:
            t.join()
        raise
    finally:
        box.clear()
        # Workers may set their intra-op threads and MKL's count is process-wide: restore the caller's.
        torch.set_num_threads(num_threads)
    if errors:
        exc = errors[0]
        raise exc.with_traceback(exc.__traceback__)
    if box._aborted:  # pragma: no cover - defensive: an abort without a recorded error
        raise RuntimeError("a torchspan worker stopped the step without an error")

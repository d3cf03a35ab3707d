"""Megatron's interleaved 1F1B for the model's own forward with several stages per rank (``ownlooped``).

Placed looped (stage ``s`` on rank ``s % P``), each rank runs its actions in the order
``schedule.build("interleaved-1f1b", m, stages, P)`` gives its stages (``interleaved_plan``), as stage
functions do: forwards of ``P`` micro-batches through the rank's first stage (chunk 0), then through chunk 1,
..., then one forward and one backward at a time. A micro-batch's forward is one call of the model's own
forward, so here it runs in a thread of its own (``Turn``) that pauses where it reaches a layer of a later
chunk of this rank until the schedule's forward of that chunk comes. The rank's main thread walks the actions
(``run_interleaved``): a forward starts or resumes the micro-batch's thread and waits until it pauses again
or ends (with its loss, on the last rank), so one thread runs at a time, a hand-off without concurrency; a
backward runs in the main thread for what crossed during that chunk's turn (``chunk_backward``): the
gradients of the values the turn sent come back, those of the values it received go out. Each gradient
message has a tag of its own (its micro-batch, its place among the pair's values needing one), so no order
between micro-batches or chunks on a link is assumed. Each backward call keeps the graph (a value made in one
chunk may reach a later one); what only the chunk's sent values and loss reach goes when they are let go,
after its backward.

A forward taking a path no earlier step took records each new call's route with every rank (``together``),
which needs every rank to meet the micro-batches' new calls in one order: a step whose micro-batch shapes no
earlier training step had runs in the common 1F1B order (``ownlooped.common_plan``), later steps with those
shapes interleave, and a new path met in an interleaved step raises (``NEW_PATH``) on the rank meeting it.

Usage (``RankOwnForwardExecutor`` does this)::

    plan = interleaved_plan(microbatches=4, stages=4, ranks=2)
    run_interleaved(plan[rank], 2, Turns({"h.0": 0, "h.2": 1}), recorder, device, job, backward)
    chunk_backward(st, turn, chunk=1, messages=messages, device=device)   # inside ``backward``
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ... import schedule as sched
from ..record import Recorder
from .forwardstate import Forward
from .ownmessages import ForwardMessages

__all__ = ["NEW_PATH", "Turn", "Turns", "chunk_backward", "interleaved_plan", "run_interleaved"]

NEW_PATH = (
    "torchspan: micro-batch {mb}'s forward took a path at {where} that no earlier training step with these "
    "micro-batch shapes took, in a schedule='interleaved-1f1b' step of several own-forward stages per rank: "
    "every rank records a new path together, which the interleaved order cannot do (a step with new shapes "
    "records in the common 1F1B order first); make the forward's path depend on the shapes only (e.g. pass "
    "the same kind of attention_mask every step), or pass schedule='1f1b'"
)


# in place of a sent value whose backward ran: the graph behind it goes once nothing else needs it
_SPENT = torch.empty(0)


class _Stop(BaseException):
    """Raised in a paused micro-batch's thread when the step stops: its forward unwinds (model code catching
    ``Exception`` does not hold it)."""


class Turn:
    """Micro-batch ``mb``'s forward in a thread of its own, paused between this rank's chunks (``chunk_of``:
    the chunk of each layer of this rank)."""

    def __init__(self, mb: int, chunk_of: dict[str, int]) -> None:
        self.mb, self.chunk_of = mb, chunk_of
        self.chunk = 0  # the chunk whose turn it holds (paused: the one it waits for)
        self.marks: dict[int, tuple[int, int]] = {0: (0, 0)}  # chunk -> values (sent, received) before it
        self.paused = self.finished = False
        self._to_thread: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._to_main: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, job: Callable[[Turn], None]) -> None:
        """Chunk 0's forward: ``job(self)`` (the forward and its loss) starts in a new thread; returns when it
        pauses or ends, raising what it raised."""
        self._thread = threading.Thread(
            target=self._run, args=(job,), name=f"torchspan-own-microbatch-{self.mb}", daemon=True
        )
        self._thread.start()
        self._wait()

    def resume(self, chunk: int) -> None:
        """``chunk``'s forward: the paused forward runs on until it reaches a later chunk or ends (nothing
        when it did not stop at ``chunk``: a chunk whose layers this micro-batch does not call)."""
        if self.paused and self.chunk == chunk:
            self.paused = False
            self._to_thread.put(True)
            self._wait()

    def reach(self, st: Forward, name: str) -> bool:
        """In the forward's thread, at each layer call: before the first layer of a later chunk of this rank,
        pause until its turn; returns whether it paused (another forward ran meanwhile)."""
        c = self.chunk_of.get(name)
        if c is None or c <= self.chunk:
            return False
        self.chunk = c
        self._to_main.put(("paused", c))
        if not self._to_thread.get():
            raise _Stop
        self.marks[c] = (len(st.sent), len(st.inbound))
        return True

    def stop(self) -> None:
        """The step stops: a paused forward unwinds and its thread ends."""
        if self.paused:
            self.paused = False
            self._to_thread.put(False)
            self._to_main.get()
        if self._thread is not None:
            self._thread.join(timeout=60.0)

    def _run(self, job: Callable[[Turn], None]) -> None:
        try:
            job(self)
        except _Stop:
            self._to_main.put(("stopped", None))
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            self._to_main.put(("failed", exc))
        else:
            self._to_main.put(("finished", None))

    def _wait(self) -> None:
        what, value = self._to_main.get()
        if what == "paused":
            self.paused = True
            return
        self.finished = True
        if what == "failed":
            raise value


class Turns:
    """The step's ``Turn`` of each micro-batch (``chunk_of``: as ``Turn``)."""

    def __init__(self, chunk_of: dict[str, int]) -> None:
        self.chunk_of = chunk_of
        self.of: dict[int, Turn] = {}

    def forward(self, mb: int, chunk: int, job: Callable[[Turn], None]) -> None:
        """The forward of ``mb`` on ``chunk``: its thread starts (the first) or resumes."""
        turn = self.of.get(mb)
        if turn is None:
            turn = self.of[mb] = Turn(mb, self.chunk_of)
            turn.start(job)
        else:
            turn.resume(chunk)

    def close(self) -> None:
        """After the step (or its failure): every paused forward unwinds, every thread ends."""
        for turn in self.of.values():
            turn.stop()
        self.of.clear()


def interleaved_plan(microbatches: int, stages: int, ranks: int) -> list[list[sched.Action]]:
    """Each rank's actions of ``schedule.build("interleaved-1f1b", ...)`` for its stages ``r, r + ranks,
    ...``, in the order it runs them (``merged_order``: Megatron's)."""
    full = sched.build("interleaved-1f1b", microbatches, stages, ranks)
    return [sched.merged_order(full, list(range(r, stages, ranks))) for r in range(ranks)]


def run_interleaved(
    actions: Sequence[sched.Action],
    ranks: int,
    turns: Turns,
    recorder: Recorder,
    device: torch.device,
    job: Callable[[Turn], None],
    backward: Callable[[int, int, bool], None],
) -> None:
    """This rank's ``actions`` in order, each in its timeline block: a forward runs ``job`` in its
    micro-batch's thread up to the next chunk (``Turns.forward``); a backward is ``backward(mb, chunk, last)``
    (``last``: the rank's last backward of the step)."""
    last = max(i for i, a in enumerate(actions) if a.kind == sched.BACKWARD)
    try:
        for i, a in enumerate(actions):
            with recorder.block(a.stage, device, a.microbatch, a.kind):
                if a.kind == sched.FORWARD:
                    turns.forward(a.microbatch, a.stage // ranks, job)
                else:
                    backward(a.microbatch, a.stage // ranks, i == last)
    finally:
        turns.close()


def _places(crossed: Sequence[tuple[torch.Tensor, int]]) -> list[int]:
    """Each value's place among those crossing to (or from) the same stage: its gradient message's number."""
    seen: dict[int, int] = {}
    places = []
    for _, stage in crossed:
        places.append(seen.get(stage, 0))
        seen[stage] = places[-1] + 1
    return places


def chunk_backward(
    st: Forward, turn: Turn, chunk: int, messages: ForwardMessages, device: torch.device
) -> bool:
    """The backward of what crossed during ``chunk``'s turn of ``st``'s forward (and of its loss, when the
    forward ended in that turn), in segments latest first as ``ownlooped``'s; returns whether it was the
    micro-batch's last on this rank (its first chunk: ``st`` may go)."""
    if chunk not in turn.marks:  # the forward did not reach this chunk's layers
        return False
    later = [c for c in turn.marks if c > chunk]
    (s_lo, i_lo), (s_hi, i_hi) = (
        turn.marks[chunk],
        turn.marks[min(later)] if later else (len(st.sent), len(st.inbound)),
    )
    sent_at, received_at = _places(st.sent), _places(st.inbound)

    def post(lo: int, hi: int) -> None:
        for j in reversed(range(lo, hi)):
            t, stage = st.inbound[j]
            messages.post(t.grad if t.grad is not None else torch.zeros_like(t), stage, st.mb, received_at[j])

    if not later and st.loss is not None and st.loss.requires_grad:
        torch.autograd.backward([st.loss], retain_graph=True)
        st.loss = None
    sends, hi = list(range(s_lo, s_hi)), i_hi
    while sends:
        k = st.sent_after[sends[-1]]
        post(k, hi)
        hi = k
        outs, grads = [], []
        while sends and st.sent_after[sends[-1]] == k:
            j = sends.pop()
            t, stage = st.sent[j]
            outs.append(t)
            grads.append(messages.take(torch.empty_like(t, device=device), stage, st.mb, sent_at[j]))
            st.sent[j] = (_SPENT, stage)
        torch.autograd.backward(outs, grads, retain_graph=True)
    post(i_lo, hi)
    return chunk == min(turn.marks)

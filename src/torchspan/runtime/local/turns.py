"""Turn-taking for threads that run micro-batches through one model: whose turn it is on each stage.

The own-forward executor (``threaded``) runs one thread per micro-batch, each calling the model's own forward
(and backward). ``Turns`` decides when a thread may run a stage: the actions ``(kind, stage,
micro-batch)`` of ``torchspan.schedule`` are grouped per worker (stages sharing one worker take
turns, as in the pipelined mode) and merged in clock order; an action may start once the action
before it in its worker's list has finished. The schedule orders every action after its
dependencies, so the threads can never wait on each other in a circle.

Turns are tokens in a ``Mailbox`` (``runtime.local.worker``): a failing thread aborts the mailbox
and every waiting thread stops with ``Aborted`` instead of hanging.

A ``Flow`` is one micro-batch walking the stages in one direction (forward: up, backward: down):
``go(stage)`` ends the current stage's block (timeline event, turn handed on), passes through
stages the micro-batch skips, and takes the new stage's turn; ``finish()`` passes through the rest.

Usage::

    turns = Turns(box, orders(sched.gpipe(3, 2), [[0], [1]], backward="all"))   # box: the step's Mailbox
    flow = Flow(turns, "forward", mb=0, stages=2, recorder=rec, devices=devs)
    flow.go(0); ...; flow.go(1); ...; flow.finish()
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from ... import schedule as sched
from ..record import Recorder
from .worker import Mailbox

__all__ = ["orders", "Turns", "Flow", "OrderError"]


class OrderError(ValueError):
    """A micro-batch entered a stage after a later stage: the stages do not follow execution order."""


def orders(
    schedule: list[list[sched.Action]], groups: Sequence[Sequence[int]], *, backward: str = "all"
) -> list[list[sched.Action]]:
    """Each worker group's actions in the order it runs them (``sched.merged_order``).

    ``backward``: ``"all"`` keeps every backward action (backward takes turns stage by stage);
    ``"start"`` keeps only the last stage's (where a micro-batch's backward starts: the rest of
    backward runs unordered, e.g. on GPU autograd threads); ``"none"`` drops them.
    """
    if backward not in ("all", "start", "none"):
        raise ValueError(f"backward={backward!r} is not one of 'all', 'start', 'none'")
    last = len(schedule) - 1

    def keep(a: sched.Action) -> bool:
        if a.kind == sched.FORWARD:
            return True
        return backward == "all" or (backward == "start" and a.stage == last)

    kept = [[a for a in stage if keep(a)] for stage in schedule]
    return [sched.merged_order(kept, list(g)) for g in groups]


class Turns:
    """Whose turn it is, per worker group; ``take`` waits for an action's turn, ``give`` hands it on."""

    def __init__(self, box: Mailbox, group_orders: Sequence[Sequence[sched.Action]]) -> None:
        self.box = box
        self._where: dict[tuple[str, int, int], tuple[int, int]] = {}
        for g, actions in enumerate(group_orders):
            for i, a in enumerate(actions):
                self._where[(a.kind, a.stage, a.microbatch)] = (g, i)
            box.put(("turn", g, 0), None)

    def has(self, kind: str, stage: int, mb: int) -> bool:
        """Whether ``(kind, stage, mb)`` takes turns at all."""
        return (kind, stage, mb) in self._where

    def take(self, kind: str, stage: int, mb: int) -> None:
        """Wait until it is ``(kind, stage, mb)``'s turn (raises ``Aborted`` if the step was aborted)."""
        where = self._where.get((kind, stage, mb))
        if where is not None:
            self.box.get(("turn",) + where)

    def give(self, kind: str, stage: int, mb: int) -> None:
        """``(kind, stage, mb)`` is done: the next action of its worker may start."""
        where = self._where.get((kind, stage, mb))
        if where is not None:
            g, i = where
            self.box.put(("turn", g, i + 1), None)


class Flow:
    """Micro-batch ``mb`` walking the stages forward (up) or backward (down), one timeline block per stage.

    ``turns=None``: only records (nothing waits), for backward run by threads that must not block.
    """

    def __init__(
        self,
        turns: Turns | None,
        kind: str,
        mb: int,
        stages: int,
        recorder: Recorder,
        devices: Sequence[torch.device],
    ) -> None:
        if kind not in (sched.FORWARD, sched.BACKWARD):
            raise ValueError(f"kind={kind!r} is not 'forward' or 'backward'")
        self.turns = turns
        self.kind = kind
        self.mb = mb
        self.stages = stages
        self.recorder = recorder
        self.devices = list(devices)
        self.step = 1 if kind == sched.FORWARD else -1
        self.current: int | None = None  # the stage whose turn this flow holds
        self.next = 0 if self.step == 1 else stages - 1  # first stage not yet visited
        self._start = 0.0
        self._lock = threading.Lock()  # backward hooks may run on autograd's device threads

    def _behind(self, stage: int) -> bool:
        return stage < self.next if self.step == 1 else stage > self.next

    def _leave(self) -> None:
        if self.current is None:
            return
        s, self.current = self.current, None
        self.recorder.add(s, self.devices[s], self.mb, self.kind, self._start, self.recorder.now())
        if self.turns is not None:
            self.turns.give(self.kind, s, self.mb)

    def _pass(self, stage: int) -> None:
        """A stage this micro-batch does not run: its turn is taken and handed on at once."""
        if self.turns is not None:
            self.turns.take(self.kind, stage, self.mb)
            self.turns.give(self.kind, stage, self.mb)

    def go(self, stage: int, layer: str = "") -> bool:
        """Enter ``stage`` (no-op if already there). Returns whether the stage changed.

        Forward, a stage behind the current one raises ``OrderError``; backward, it is ignored
        (gradients of a skip connection can arrive after the stages it skipped).
        """
        with self._lock:
            if stage == self.current:
                return False
            if self._behind(stage):
                if self.step == -1:
                    return False
                raise OrderError(
                    f"micro-batch {self.mb} ran layer {layer!r} of stage {stage} after stage "
                    f"{self.current}: the model runs its layers in another order than the stages list "
                    "them; stages must follow execution order. Re-plan with torchspan.plan(model, x, ...) "
                    "or pass devices and balance"
                )
            self._leave()
            for s in range(self.next, stage, self.step):
                self._pass(s)
            if self.turns is not None:
                self.turns.take(self.kind, stage, self.mb)
            self.current, self.next = stage, stage + self.step
            self._start = self.recorder.now()
            return True

    def finish(self) -> None:
        """Leave the current stage and pass through every stage not yet visited."""
        with self._lock:
            self._leave()
            end = self.stages if self.step == 1 else -1
            for s in range(self.next, end, self.step):
                self._pass(s)
            self.next = end

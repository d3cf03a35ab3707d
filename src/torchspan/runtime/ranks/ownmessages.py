"""The messages of the own-forward executor (``ownforward``): values crossing inside its forwards, and
their gradients (and the step's loss) going back as raw messages in the order both sides run them.

Each value is one slot of the transport's header protocol (``p2p``): micro-batch ``mb``'s ``seq``-th value
from one stage to another, counted by the ``Forward`` on both sides (they walk the same path of calls). A
slot's header is predicted from the step before, so a value is one message as a rule; training forwards
(``"own-fwd"``) and no-grad forwards (``"own-eval"``) keep their own slots. When the stage sending to this
one runs all its forwards first (``schedule.forwards_first``: GPipe, merged-weights but the last stage),
this stage posts the receives of every slot known from the step before at its first receive of the step
(after the step's gate), so a value lands while this rank still computes. A slot an earlier step used and
this forward did not (its path changed) is closed on both sides after the forward (``RankTransport.close``
/ ``drain``): a receive posted for it gets a "none", never another step's value.

Usage (``RankOwnForwardExecutor`` does this)::

    messages = ForwardMessages(transport, stage=1, stages=2)
    messages.start_step(plan)                       # before a training step's actions
    got = messages.receive(st, "blocks.2", shape, dtype, 0)
    messages.done(st)                               # after each forward
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ... import schedule as sched
from .forwardstate import Forward
from .p2p import Diverged, RankTransport, step_slot
from .routes import DivergedError

__all__ = ["ForwardMessages"]


class ForwardMessages:
    """This rank's (``stage`` of ``stages``) side of the forward values, over ``transport``."""

    def __init__(self, transport: RankTransport, stage: int, stages: int) -> None:
        self.transport, self.stage, self.stages = transport, stage, stages
        self._expect: list[tuple[int, list[int]]] | None = (
            None  # this step's early receives: (earlier stage, micro-batches)
        )
        self._steps = 0  # training steps started: each step's loss has its own slot
        self._loss: Callable[[], torch.Tensor] | None = None  # this step's loss, its receive posted

    def start_step(self, plan: Sequence[Sequence[sched.Action]]) -> None:
        """A training step of ``plan`` (every stage's actions) starts: its first receive posts what can be."""
        self._expect = sched.early_receives(plan, self.stage, range(self.stage))
        self._steps += 1
        self._loss = None

    def end_step(self) -> None:
        self._expect = self._loss = None

    @staticmethod
    def _kind(st: Forward) -> str:
        return "own-fwd" if st.grad else "own-eval"

    def send(self, st: Forward, value: torch.Tensor, stage: int) -> None:
        """One value of this forward to ``stage``."""
        self.transport.send(
            [value.detach()], None, self.stage, stage, self._kind(st), st.mb, st.next_message(True, stage)
        )

    def receive(
        self, st: Forward, layer: str, shape: torch.Size, dtype: torch.dtype, stage: int
    ) -> torch.Tensor:
        """One value of this forward from ``stage``, for ``layer``'s argument of ``shape`` and ``dtype``."""
        if self._expect is not None and st.grad:  # the step's first receive, after its gate
            for src, mbs in self._expect:
                self.transport.expect(src, self.stage, "own-fwd", mbs)
            self._expect = None
        seq = st.next_message(False, stage)
        try:
            values, _ = self.transport.receive(stage, self.stage, self._kind(st), st.mb, seq)
        except Diverged as exc:
            raise DivergedError(f"{exc} (at layer {layer!r})") from None
        got = values[0] if len(values) == 1 else None
        if not isinstance(got, torch.Tensor) or got.shape != shape or got.dtype != dtype:
            seen = (
                f"{tuple(got.shape)} {got.dtype}"
                if isinstance(got, torch.Tensor)
                else f"{len(values)} values"
            )
            raise DivergedError(
                f"torchspan: layer {layer!r} expected a {tuple(shape)} {dtype} tensor from stage {stage} "
                f"(micro-batch {st.mb}, message {seq}), which sent {seen}: the ranks' forwards took "
                "different paths"
            )
        return got

    def post(self, t: torch.Tensor, stage: int, mb: int | None = None, seq: int = 0) -> None:
        """A gradient of a received value to ``stage`` as one raw message (``"own-bwd"``; ``mb``: on the slot
        of micro-batch ``mb``'s ``seq``-th value from ``stage`` that needs one, else in order)."""
        self.transport.post(
            t.detach().contiguous().to(self.transport.comm_device),
            self.transport.peer(stage),
            "own-bwd",
            mb,
            seq,
        )

    def send_loss(self, loss: torch.Tensor, stage: int) -> None:
        """The step's summed loss (float64, one element) to ``stage``, from the last stage after its last
        backward."""
        mb, seq = step_slot(
            self._steps
        )  # a tag per step: a receive a failed step left posted never takes a later loss
        self.transport.post(
            loss.detach().reshape(1).to(self.transport.comm_device, torch.float64),
            self.transport.peer(stage),
            "own-loss",
            mb,
            seq,
        )

    def expect_loss(self, stage: int) -> None:
        """Post the receive of the step's loss from ``stage`` now (once per step, after the gate), so it lands
        while this rank still computes: a receive posted after the send costs a round trip of gloo's threads
        (~0.25 ms)."""
        if self._loss is None:
            mb, seq = step_slot(self._steps)
            self._loss = self.transport.receive_early(
                torch.empty(1, dtype=torch.float64), stage, self.stage, "own-loss", mb, seq
            )

    def take_loss(self, stage: int) -> torch.Tensor:
        """The step's loss from ``stage`` (float64, shape ``()``), on this rank's device."""
        self.expect_loss(stage)
        wait, self._loss = self._loss, None
        assert wait is not None
        return wait().reshape(()).to(self.transport.device)

    def take(self, buf: torch.Tensor, stage: int, mb: int | None = None, seq: int = 0) -> torch.Tensor:
        """The next raw ``"own-bwd"`` message from ``stage`` (``mb``: the one on that slot, as ``post``), into
        ``buf``."""
        return self.transport.receive_into(buf, stage, self.stage, "own-bwd", mb, seq)

    def done(self, st: Forward) -> None:
        """After a forward: slots an earlier step used and this one did not are closed on both sides."""
        kind = self._kind(st)
        others = [s for s in range(self.stages) if s != self.stage]
        for (
            stage
        ) in others:  # every close (a send) before any drain (a receive): no rank waits on another's drain
            self.transport.close(stage, kind, st.mb, st.messages.get((True, stage), 0))
        for stage in others:
            try:
                self.transport.drain(stage, self.stage, kind, st.mb, st.messages.get((False, stage), 0))
            except Diverged as exc:
                raise DivergedError(str(exc)) from None

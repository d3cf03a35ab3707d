"""Point-to-point transport between pipeline ranks: activations forward, gradients back.

One message per transfer in the steady state. A *slot* (peer, kind, micro-batch, seq) carries one
transfer per step: stage functions send one per micro-batch (seq 0), the own-forward executor one per
value crossing in a micro-batch's forward (seq counts them). Both ends remember, per slot, the
*header* of the last transfer (pytree spec, each leaf's shape/dtype or pickled plain value) and so
agree on the size of the next message before it is sent. A message is one ``uint8`` buffer (one ``torch.cat``
of byte views): a 16-byte prefix, then every tensor leaf (16-byte aligned):

- header as predicted (the same micro-batch shapes as last step): prefix ``[0, 0]`` + data.
  **One message.**
- header changed (first step, uneven micro-batches moved, a new sequence length): the sender,
  which tracks the same prediction, still sends a message of the predicted size, its prefix
  ``[len(header), data bytes]``; then a second message, the pickled header then the data.
  The receiver reads the prefix and receives the second. Exact for any change: nothing is
  guessed that is not checked.
- a slot the last step used and this one does not (an own forward that took a shorter path):
  the sender ``close``s it, a message of the predicted size with prefix ``[-1, 0]``, and the
  receiver ``drain``s it; both forget the slot. A receive posted early for it so never waits
  for a message that will not come, and never takes the next step's.

Sends are ``isend`` (waited for at the end of the run), so two ranks sending to each other at
once (1F1B) never block each other. Receives are posted when the schedule needs them, unless the
pipeline ``expect``s a channel: then the receives of every micro-batch whose message size is known
are posted at once (``irecv``), after the step's gate. A receive posted early makes gloo write the
payload inside the sender's ``isend`` (on its compute thread); a late one leaves gloo's own thread to
ship it once the receiver asks, a wake-up on each side that two busy ranks on shared cores serve late
(0.5-1.5 ms per message, measured). So the pipeline expects a stage's forwards when the stage before
sends them all first (its forwards run before any backward: ``merged-weights``, GPipe): on 2 shared
cores that made 2-rank steps 1-3% faster under merged-weights and 5-10% under GPipe (in the same
rounds), where posting one transfer ahead under 1F1B made steps 5-20% slower. Batched ``P2POp`` lists are not
used: they can hang on gloo. Tags (``tag``) keep forward and backward traffic, each slot's messages, and the
two executors' messages apart: an early receive can only ever match its own slot's message (a changed header's
second message, of another size, follows on the same tag once the first was read).
A ``gate`` set for one step (``RankStage.check_same_batch``'s verdict) runs before that step's first
transfer, so a refused step leaves every channel as it was.

Usage (``RankPipelineExecutor`` does this)::

    transport = RankTransport(mesh, rank=dist.get_rank(), device=torch.device("cpu"))
    Pipeline(devices, ..., transport=transport).train(...)
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import treespec_dumps, treespec_loads

from ..local.worker import Transport
from .mesh import Mesh

__all__ = ["RankTransport", "PeerError", "Diverged", "TAGS", "tag", "step_slot"]

# Every message tag of a pipeline across ranks: stage functions' transfers (``send``/``receive``, one tag per
# kind and micro-batch), the own-forward executor's values in its training and no-grad forwards (``send``/
# ``receive``, one tag per kind, micro-batch and message of that micro-batch) and its raw gradients
# (``post``/``receive_into``) and its step's loss (``post``/``receive_early``, one tag per step) never share
# one.
TAGS = {"fwd": 0, "bwd": 1, "own-fwd": 2, "own-bwd": 3, "own-eval": 4, "own-loss": 5}
_WHAT = {
    "fwd": "activations",
    "bwd": "gradients",
    "own-fwd": "activations",
    "own-bwd": "gradients",
    "own-eval": "activations",
    "own-loss": "the step's loss",
}
_PREFIX = 16  # two int64: header length (0: as predicted, -1: no message in this slot), data bytes
_ALIGN = 16
# micro-batches per step that the tags tell apart (seq-th message of micro-batch mb: mb + _MBS * seq)
_MBS = 4096
_VOID = -1


def tag(kind: str, mb: int | None = None, seq: int = 0) -> int:
    """The tag of ``kind``'s messages (of micro-batch ``mb``, its ``seq``-th message on that channel):
    ``TAGS[kind] + len(TAGS) * (mb + 1 + 4096 * seq)``, so no two kinds, micro-batches or messages share
    one."""
    if mb is None:
        return TAGS[kind]
    if not 0 <= mb < _MBS:
        raise ValueError(
            f"torchspan: a pipeline across ranks tells at most {_MBS} micro-batches per step apart, got "
            f"micro-batch {mb}: use fewer micro-batches"
        )
    return TAGS[kind] + len(TAGS) * (mb + 1 + _MBS * seq)


def step_slot(step: int) -> tuple[int, int]:
    """The (micro-batch, message) numbers that give training step ``step``'s message of a kind sent once per
    step a tag of its own: steps repeat a tag only 4096 * 87000 steps apart (the tag stays an int32)."""
    return step % _MBS, step // _MBS % 87_000


class PeerError(RuntimeError):
    """A point-to-point exchange with another rank failed (that rank stopped, or the group timed out)."""


class Diverged(RuntimeError):
    """Two ranks disagree on which messages a micro-batch has: one sent none where the other receives one, or
    one more than the other received (their forwards took different paths)."""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Header:
    """What the receiver needs to rebuild a transfer: spec, and per leaf ``(shape, dtype)`` or a pickled
    value."""

    __slots__ = ("spec", "metas", "offsets", "nbytes")

    def __init__(self, spec: Any, metas: list[Any]) -> None:
        self.spec, self.metas = spec, metas
        self.offsets: list[int] = []  # per tensor leaf, from the start of the data
        size = 0
        for m in metas:
            if m[0] == "tensor":
                self.offsets.append(size)
                size += _aligned(_nbytes(m[1], m[2]))
        self.nbytes = size

    @classmethod
    def of(cls, values: list[Any], spec: Any) -> _Header:
        metas: list[Any] = []
        for v in values:
            if isinstance(v, torch.Tensor):
                metas.append(("tensor", tuple(v.shape), v.dtype))
            else:
                metas.append(("value", pickle.dumps(v)))
        return cls(spec, metas)

    def matches(self, values: list[Any], spec: Any) -> bool:
        """Whether ``_Header.of(values, spec)`` would be ``same`` as this one (without building it)."""
        metas = self.metas
        if len(values) != len(metas):
            return False
        for v, m in zip(values, metas):
            if isinstance(v, torch.Tensor):
                if m[0] != "tensor" or v.dtype != m[2] or v.shape != m[1]:
                    return False
            elif m[0] != "value" or pickle.dumps(v) != m[1]:
                return False
        try:
            return self.spec is spec or bool(self.spec == spec)
        except Exception:  # an odd pytree context: treat as changed (one extra message, still exact)
            return False

    def same(self, other: _Header | None) -> bool:
        if other is None or self.metas != other.metas:
            return False
        try:
            return self.spec is other.spec or bool(self.spec == other.spec)
        except Exception:  # an odd pytree context: treat as changed (one extra message, still exact)
            return False

    def dumps(self) -> bytes:
        return pickle.dumps((None if self.spec is None else treespec_dumps(self.spec), self.metas))

    @classmethod
    def loads(cls, blob: bytes) -> _Header:
        spec_text, metas = pickle.loads(blob)
        return cls(None if spec_text is None else treespec_loads(spec_text), metas)


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


class RankTransport(Transport):
    """This rank's stage of replica ``mesh.coords(rank)[0]``; the other stages are other ranks.

    ``device``: where received tensors are placed (and sent from); under nccl a CUDA device.
    ``comm_device``: where messages travel (default ``device``; gloo sends CPU tensors).
    """

    def __init__(
        self, mesh: Mesh, rank: int, device: torch.device, comm_device: torch.device | None = None
    ) -> None:
        self.mesh = mesh
        self.rank = rank
        self.replica, self.stage = mesh.coords(rank)
        self.device = device
        self.comm_device = comm_device if comm_device is not None else device
        self._pending: list[tuple[Any, Any]] = []  # (work, buffer kept alive until sent)
        # A slot is (peer, kind, micro-batch, seq): the seq-th message of that micro-batch on that channel.
        self._sent: dict[tuple[int, str, int, int], _Header] = {}  # slot -> last header sent
        self._received: dict[tuple[int, str, int, int], _Header] = {}  # slot -> last header received
        self._zero_bytes: dict[int, torch.Tensor] = {}  # zero padding by length (read-only)
        self._early: dict[
            tuple[int, str, int, int], tuple[Any, torch.Tensor]
        ] = {}  # slot -> posted irecv, its buffer
        self._orphans: list[
            tuple[Any, torch.Tensor]
        ] = []  # early receives of a failed run: gloo may still write into them
        self.gate: Callable[[], None] | None = (
            None  # run once before the step's first transfer (RankStage.check_same_batch)
        )

    def run_gate(self) -> None:
        """Before a transfer (or an exchange, or when a step fails): the step's ``gate`` (set by
        ``RankStage.check_same_batch``) runs once, if it has not yet, and may raise."""
        gate = self.gate
        if gate is not None:
            self.gate = None
            gate()

    def peer(self, stage: int) -> int:
        """The rank holding ``stage`` in this rank's replica."""
        return self.mesh.rank(self.replica, stage)

    def is_local(self, stage: int) -> bool:
        return stage == self.stage

    def where(self, stage: int) -> str:
        return f"rank {self.peer(stage)} ("

    # ------------------------------------------------------------------ sending
    def _pack(self, head: torch.Tensor, values: list[Any]) -> torch.Tensor:
        """One ``uint8`` message: ``head`` (a multiple of 16 bytes), then each tensor leaf's bytes, 16-byte
        aligned (``_Header.offsets``), made by a single ``torch.cat`` of byte views."""
        parts = [head]
        for v in values:
            if isinstance(v, torch.Tensor):
                n = v.numel() * v.element_size()
                if n:
                    parts.append(v.detach().reshape(-1).view(torch.uint8).to(self.comm_device))
                    if n % _ALIGN:
                        parts.append(self._zeros(_ALIGN - n % _ALIGN))
        return torch.cat(parts) if len(parts) > 1 else head

    def _zeros(self, n: int) -> torch.Tensor:
        z = self._zero_bytes.get(n)
        if z is None:
            z = self._zero_bytes[n] = torch.zeros(n, dtype=torch.uint8, device=self.comm_device)
        return z

    def post(self, buf: torch.Tensor, peer: int, kind: str, mb: int | None = None, seq: int = 0) -> None:
        """``isend`` ``buf`` (on ``comm_device``) to rank ``peer`` with ``tag(kind, mb, seq)``; kept alive and
        waited for in ``finish``."""
        self.run_gate()
        self._pending.append((dist.isend(buf, dst=peer, tag=tag(kind, mb, seq)), buf))

    def send(
        self, values: list[Any], spec: Any, src: int, dst: int, kind: str, mb: int = 0, seq: int = 0
    ) -> None:
        peer = self.peer(dst)
        known = self._sent.get((peer, kind, mb, seq))
        if known is not None and known.matches(values, spec):  # as predicted: one message, prefix [0, 0]
            self.post(self._pack(self._zeros(_PREFIX), values), peer, kind, mb, seq)
            return
        header = _Header.of(values, spec)
        blob = header.dumps()
        self.post(self._first(known, len(blob), header.nbytes), peer, kind, mb, seq)
        head = torch.zeros(_aligned(len(blob)), dtype=torch.uint8)
        head[: len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        self.post(self._pack(head.to(self.comm_device), values), peer, kind, mb, seq)
        self._sent[(peer, kind, mb, seq)] = header

    def _first(self, known: _Header | None, blob_len: int, data_len: int) -> torch.Tensor:
        """A message of the size the receiver predicts (``known``'s) that carries only a prefix: ``[blob_len,
        data_len]``."""
        first = torch.zeros(_PREFIX + (known.nbytes if known is not None else 0), dtype=torch.uint8)
        first[:_PREFIX].view(torch.int64).copy_(torch.tensor([blob_len, data_len]))
        return first.to(self.comm_device)

    def close(self, dst: int, kind: str, mb: int, seq: int) -> None:
        """After micro-batch ``mb``'s last message to stage ``dst`` on ``kind`` (``seq`` messages sent): a
        slot the receiver still predicts (an earlier step sent more) gets a message of its predicted size that
        says "none", and is forgotten on both sides (``drain``), so a receive posted early for it is never
        left waiting."""
        peer = self.peer(dst)
        while (known := self._sent.pop((peer, kind, mb, seq), None)) is not None:
            self.post(self._first(known, _VOID, 0), peer, kind, mb, seq)
            seq += 1

    def drain(self, src: int, dst: int, kind: str, mb: int, seq: int) -> None:
        """After micro-batch ``mb``'s last message from stage ``src`` on ``kind`` (``seq`` received): reads
        the "none" of every slot still predicted (``close``); raises ``Diverged`` when one holds a message
        after all."""
        peer = self.peer(src)
        while (peer, kind, mb, seq) in self._received:
            buf, _ = self._first_message(src, dst, kind, mb, seq)
            blob_len = int(buf[:_PREFIX].view(torch.int64)[0])
            if blob_len != _VOID:
                raise Diverged(
                    f"torchspan: rank {peer} (stage {src}) sent micro-batch {mb}'s message {seq} on "
                    f"{kind!r}, which rank {self.rank} (stage {dst}) did not ask for: the ranks' forwards "
                    "took different paths"
                )
            del self._received[(peer, kind, mb, seq)]
            seq += 1

    # ------------------------------------------------------------------ receiving
    def expect(self, src: int, dst: int, kind: str, mbs: Sequence[int]) -> None:
        """Post now (after the step's gate) the receives of ``mbs`` from stage ``src`` whose message size is
        known from an earlier step (every message of each, in seq order); ``receive`` then waits for them. The
        others are received when asked for."""
        self.run_gate()
        if (
            self.comm_device.type != "cpu"
        ):  # nccl matches a pair's messages in order, whatever the tag: an early
            return  # receive could take another micro-batch's message (and its progress needs no host thread)
        peer = self.peer(src)
        for mb in mbs:
            seq = 0
            while (known := self._received.get((peer, kind, mb, seq))) is not None:
                if (peer, kind, mb, seq) not in self._early:
                    buf = torch.empty(_PREFIX + known.nbytes, dtype=torch.uint8, device=self.comm_device)
                    self._early[(peer, kind, mb, seq)] = (
                        dist.irecv(buf, src=peer, tag=tag(kind, mb, seq)),
                        buf,
                    )
                seq += 1

    def _first_message(
        self, src: int, dst: int, kind: str, mb: int, seq: int
    ) -> tuple[torch.Tensor, _Header | None]:
        """The slot's first message (posted early, or received now, of the predicted size) and the predicted
        header."""
        self.run_gate()
        peer = self.peer(src)
        known = self._received.get((peer, kind, mb, seq))
        try:
            early = self._early.pop((peer, kind, mb, seq), None)
            if early is not None:  # posted by expect(): the first message is in its buffer once waited for
                early[0].wait()
                return early[1], known
            buf = torch.empty(
                _PREFIX + (known.nbytes if known is not None else 0),
                dtype=torch.uint8,
                device=self.comm_device,
            )
            dist.recv(buf, src=peer, tag=tag(kind, mb, seq))
            return buf, known
        except RuntimeError as exc:
            raise self._lost(_WHAT[kind], dst, src, exc) from exc

    def receive(self, src: int, dst: int, kind: str, mb: int = 0, seq: int = 0) -> tuple[list[Any], Any]:
        peer, key = self.peer(src), tag(kind, mb, seq)
        buf, known = self._first_message(src, dst, kind, mb, seq)
        blob_len, data_len = buf[:_PREFIX].view(torch.int64).tolist()
        if blob_len == _VOID:
            self._received.pop((peer, kind, mb, seq), None)
            raise Diverged(
                f"torchspan: rank {self.rank} (stage {dst}) waited for micro-batch {mb}'s message {seq} on "
                f"{kind!r} from rank {peer} (stage {src}), which sent none: the ranks' forwards took "
                "different paths"
            )
        try:
            if blob_len:
                start = _aligned(blob_len)
                buf = torch.empty(start + data_len, dtype=torch.uint8, device=self.comm_device)
                dist.recv(buf, src=peer, tag=key)
                header = _Header.loads(buf[:blob_len].cpu().numpy().tobytes())
                self._received[(peer, kind, mb, seq)] = header
            else:
                if known is None:
                    raise RuntimeError(
                        "a transfer without a header on a new channel (the two ranks' headers diverged)"
                    )
                header, start = known, _PREFIX
        except (RuntimeError, KeyError) as exc:
            raise self._lost(_WHAT[kind], dst, src, exc) from exc
        values: list[Any] = []
        offsets = iter(header.offsets)
        for meta in header.metas:
            if meta[0] == "tensor":
                off = start + next(offsets)
                t = buf[off : off + _nbytes(meta[1], meta[2])].view(meta[2]).view(meta[1])
                values.append(t if t.device == self.device else t.to(self.device))
            else:
                values.append(pickle.loads(meta[1]))
        return values, header.spec

    def receive_into(
        self, buf: torch.Tensor, src: int, dst: int, kind: str, mb: int | None = None, seq: int = 0
    ) -> torch.Tensor:
        """Receive one raw tensor message of ``kind`` (``tag(kind, mb, seq)``) from stage ``src``'s rank into
        ``buf`` (any device) and return it."""
        self.run_gate()
        comm = buf if buf.device == self.comm_device else torch.empty_like(buf, device=self.comm_device)
        try:
            dist.recv(comm, src=self.peer(src), tag=tag(kind, mb, seq))
        except RuntimeError as exc:
            raise self._lost(_WHAT[kind], dst, src, exc) from exc
        return comm if comm is buf else buf.copy_(comm)

    def receive_early(
        self, buf: torch.Tensor, src: int, dst: int, kind: str, mb: int, seq: int = 0
    ) -> Callable[[], torch.Tensor]:
        """Post now (after the step's gate) the receive of one raw tensor message of slot (``src``'s rank,
        ``kind``, ``mb``, ``seq``) into ``buf``; the returned function waits for it and returns ``buf``. Under
        nccl (which matches a pair's messages in order, whatever the tag) nothing is posted early: the
        function receives then (``receive_into``). Give each step's message its own slot: a receive left
        posted by a failed step can only ever take that step's message."""
        self.run_gate()
        if self.comm_device.type != "cpu":
            return lambda: self.receive_into(buf, src, dst, kind, mb, seq)
        comm = buf if buf.device == self.comm_device else torch.empty_like(buf, device=self.comm_device)
        slot = (self.peer(src), kind, mb, seq)
        self._early[slot] = (dist.irecv(comm, src=slot[0], tag=tag(kind, mb, seq)), comm)

        def wait() -> torch.Tensor:
            early = self._early.pop(slot, None)
            if early is None:  # the step's transfers were settled before it was waited for: receive it now
                return self.receive_into(buf, src, dst, kind, mb, seq)
            try:
                early[0].wait()
            except RuntimeError as exc:
                raise self._lost(_WHAT[kind], dst, src, exc) from exc
            return comm if comm is buf else buf.copy_(comm)

        return wait

    def _lost(self, what: str, dst: int, src: int, exc: BaseException) -> PeerError:
        peer = self.peer(src)
        return PeerError(
            f"rank {self.rank} (stage {dst}) could not receive {what} from rank {peer} (stage {src}): {exc}. "
            f"Rank {peer} probably failed or was killed: see its traceback; the job stops instead of waiting"
        )

    def finish(self, ok: bool) -> None:
        if ok:
            self.run_gate()  # a step without a transfer still gets its verdict
        self.gate = None
        pending, self._pending = self._pending, []
        early, self._early = list(self._early.values()), {}
        if not ok:  # a failed run: peers are stopping too; waiting on their receives could hang
            # and what each side predicts may differ now: start again from announced headers
            self._sent.clear()
            self._received.clear()
            self._orphans.extend(early)  # a posted receive cannot be withdrawn: its buffer must outlive it
            return
        if early:  # never after a run that received what the schedule asked for
            self._orphans.extend(early)
            raise RuntimeError(
                f"rank {self.rank}: {len(early)} expected message(s) were never received (the transport "
                "was told to expect more than the schedule ran)"
            )
        for work, _ in pending:
            try:
                work.wait()
            except RuntimeError as exc:
                raise PeerError(
                    f"rank {self.rank} could not finish sending to its pipeline neighbours: {exc}"
                ) from exc

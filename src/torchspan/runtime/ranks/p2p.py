"""Point-to-point transport between pipeline ranks: activations forward, gradients back.

Every message is a *header* then the tensors. The header (pickled: the pytree spec as JSON and, per leaf,
a tensor's shape/dtype, ``None``, or a plain value) tells the receiver what to allocate, so uneven
micro-batches and non-tensor leaves need no shape probe. A channel (peer, kind) remembers the last
header each way: an unchanged header costs one 8-byte message (``[0]``), a new one its length then
its bytes. Sends are ``isend`` (waited for at the end of the run), so two ranks sending to each
other at once (1F1B's forward and backward) never block each other; receives are plain ``recv`` /
``irecv`` posted in the order the schedule sends them. Batched ``P2POp`` lists are not used: they
can hang on gloo. Tags keep forward (0) and backward (1) traffic apart on gloo; nccl orders one
pair's messages itself.

Usage (``RankPipelineExecutor`` does this)::

    transport = RankTransport(mesh, rank=dist.get_rank(), device=torch.device("cpu"))
    Pipeline(devices, ..., transport=transport).train(...)
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import treespec_dumps, treespec_loads

from ..local.worker import Transport
from .mesh import Mesh

__all__ = ["RankTransport", "PeerError"]

_TAGS = {"fwd": 0, "bwd": 1}
_WHAT = {"fwd": "activations", "bwd": "gradients"}


class PeerError(RuntimeError):
    """A point-to-point exchange with another rank failed (that rank stopped, or the group timed out)."""


def _header(values: list[Any], spec: Any) -> tuple[str | None, list[Any]]:
    """What the receiver needs to rebuild ``values``: the spec as pytree JSON, and each leaf's shape/dtype or value."""
    metas: list[Any] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            metas.append(("tensor", tuple(v.shape), v.dtype))
        else:
            metas.append(("value", v))
    return (None if spec is None else treespec_dumps(spec)), metas


class RankTransport(Transport):
    """This rank's stage of replica ``mesh.coords(rank)[0]``; the other stages are other ranks.

    ``device``: where received tensors are placed (and sent from); under nccl a CUDA device.
    ``comm_device``: where headers travel (default ``device``; gloo sends CPU tensors).
    """

    def __init__(self, mesh: Mesh, rank: int, device: torch.device, comm_device: torch.device | None = None) -> None:
        self.mesh = mesh
        self.rank = rank
        self.replica, self.stage = mesh.coords(rank)
        self.device = device
        self.comm_device = comm_device if comm_device is not None else device
        self._pending: list[tuple[Any, Any]] = []  # (work, tensor kept alive until sent)
        self._sent: dict[tuple[int, str], bytes] = {}
        self._received: dict[tuple[int, str], tuple[Any, list[Any]]] = {}

    def peer(self, stage: int) -> int:
        """The rank holding ``stage`` in this rank's replica."""
        return self.mesh.rank(self.replica, stage)

    def is_local(self, stage: int) -> bool:
        return stage == self.stage

    def where(self, stage: int) -> str:
        return f"rank {self.peer(stage)} ("

    # ------------------------------------------------------------------ sending
    def _isend(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self._pending.append((dist.isend(tensor, dst=peer, tag=tag), tensor))

    def send(self, values: list[Any], spec: Any, src: int, dst: int, kind: str) -> None:
        peer, tag = self.peer(dst), _TAGS[kind]
        blob = pickle.dumps(_header(values, spec))
        if self._sent.get((peer, kind)) == blob:
            self._isend(torch.zeros(1, dtype=torch.int64, device=self.comm_device), peer, tag)
        else:
            self._sent[(peer, kind)] = blob
            self._isend(torch.tensor([len(blob)], dtype=torch.int64, device=self.comm_device), peer, tag)
            self._isend(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.comm_device), peer, tag)
        for v in values:
            if isinstance(v, torch.Tensor):
                self._isend(v.detach().to(self.device).contiguous(), peer, tag)

    # ------------------------------------------------------------------ receiving
    def receive(self, src: int, dst: int, kind: str) -> tuple[list[Any], Any]:
        peer, tag = self.peer(src), _TAGS[kind]
        try:
            size = torch.zeros(1, dtype=torch.int64, device=self.comm_device)
            dist.recv(size, src=peer, tag=tag)
            n = int(size.item())
            if n:
                buf = torch.empty(n, dtype=torch.uint8, device=self.comm_device)
                dist.recv(buf, src=peer, tag=tag)
                self._received[(peer, kind)] = pickle.loads(buf.cpu().numpy().tobytes())
            spec_text, metas = self._received[(peer, kind)]
            spec = None if spec_text is None else treespec_loads(spec_text)
            values: list[Any] = []
            works = []
            for meta in metas:
                if meta[0] == "tensor":
                    t = torch.empty(meta[1], dtype=meta[2], device=self.device)
                    works.append(dist.irecv(t, src=peer, tag=tag))
                    values.append(t)
                else:
                    values.append(meta[1])
            for w in works:
                w.wait()
        except (RuntimeError, KeyError) as exc:
            raise PeerError(
                f"rank {self.rank} (stage {dst}) could not receive {_WHAT[kind]} from rank {peer} (stage {src}): {exc}. "
                f"Rank {peer} probably failed or was killed: see its traceback; the job stops instead of waiting"
            ) from exc
        return values, spec

    def finish(self, ok: bool) -> None:
        pending, self._pending = self._pending, []
        if not ok:
            return  # a failed run: peers are stopping too; waiting on their receives could hang
        for work, _ in pending:
            try:
                work.wait()
            except RuntimeError as exc:
                raise PeerError(f"rank {self.rank} could not finish sending to its pipeline neighbours: {exc}") from exc

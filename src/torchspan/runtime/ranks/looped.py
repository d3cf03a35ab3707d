"""Several pipeline stages per rank, placed looped: stage ``s`` on pipeline rank ``s % P``.

A plan (or ``balance``/``devices``) with more stages than pipeline ranks gives each of the ``P`` ranks
``v = stages / P`` stages, as Megatron's interleaved 1F1B needs (``schedule="interleaved-1f1b"``; any other
schedule runs too). The mesh and ``RankStage`` keep counting *positions* (one per rank of a pipeline):
a rank's layers are those of all its stages (``position_groups``), so other ranks' layers become meta, tied
parameters are found between ranks (a tie between two stages of one rank is one parameter, summed by
autograd), and the last position holds the last stage. Between stages of one rank a value is a local
hand-off (``Pipeline``'s mailbox); ``LoopedTransport`` sends the others to ``s % P``'s rank, each pair of
stages on its own message slot (``seq`` = the lower stage's chunk, ``s // P``), so two stage pairs between the
same ranks never share a tag or a predicted header.

Usage (``RankPipelineExecutor`` does this)::

    transport = LoopedTransport(Mesh(2), rank=0, device=torch.device("cpu"), stages=4)
    transport.is_local(2), transport.peer(3)       # True, 1
    position_groups([["a"], ["b"], ["c"], ["d"]], 2)  # [["a", "c"], ["b", "d"]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .mesh import Mesh
from .p2p import _PREFIX, RankTransport, tag

__all__ = ["LastBackwards", "LoopedTransport", "looped_mesh", "position_groups"]


def position_groups(groups: Sequence[Sequence[str]], positions: int) -> list[list[str]]:
    """The layers of each pipeline rank: its stages' groups (``s % positions``), in stage order."""
    return [[name for s in range(p, len(groups), positions) for name in groups[s]] for p in range(positions)]


def looped_mesh(world_size: int, stages: int) -> Mesh | None:
    """One pipeline over ``world_size`` ranks when ``stages`` exceeds it (looped), ``None`` otherwise;
    ``ValueError`` naming the fix when the stages do not split evenly over the ranks."""
    if stages <= world_size:
        return None
    if stages % world_size:
        lower = stages // world_size * world_size
        raise ValueError(
            f"{stages} stages on WORLD_SIZE({world_size}) ranks: more stages than ranks are placed looped "
            f"(stage s on rank s % {world_size}), which needs a multiple of {world_size} stages; pass "
            f"balance= (or devices=) with {lower} or {lower + world_size} entries, or launch {stages} "
            "processes"
        )
    return Mesh(world_size, 1)


class LoopedTransport(RankTransport):
    """``RankTransport`` for ``stages`` stages looped over the ``mesh.stages`` ranks of each pipeline."""

    def __init__(
        self,
        mesh: Mesh,
        rank: int,
        device: torch.device,
        comm_device: torch.device | None = None,
        *,
        stages: int,
    ) -> None:
        super().__init__(mesh, rank, device, comm_device)
        self.positions = mesh.stages
        self.chunks = stages // mesh.stages
        self._prepost: tuple[int, int] | None = None  # (stages, micro-batches) whose receives the gate posts
        if self.chunks * self.positions != stages:
            raise ValueError(
                f"{stages} stages cannot be looped over pp({mesh.stages}) ranks: give a multiple of "
                f"{mesh.stages}"
            )

    def peer(self, stage: int) -> int:
        return self.mesh.rank(self.replica, stage % self.positions)

    def is_local(self, stage: int) -> bool:
        return stage % self.positions == self.stage

    def where(self, stage: int) -> str:
        return f"rank {self.peer(stage)} ("

    def _slot(self, src: int, dst: int, seq: int) -> int:
        return seq * self.chunks + min(src, dst) // self.positions

    def send(
        self, values: list[Any], spec: Any, src: int, dst: int, kind: str, mb: int = 0, seq: int = 0
    ) -> None:
        super().send(values, spec, src, dst, kind, mb, self._slot(src, dst, seq))

    def receive(self, src: int, dst: int, kind: str, mb: int = 0, seq: int = 0) -> tuple[list[Any], Any]:
        return super().receive(src, dst, kind, mb, self._slot(src, dst, seq))

    def expect(self, src: int, dst: int, kind: str, mbs: Sequence[int]) -> None:
        """Post now the receives of ``mbs`` from stage ``src`` to ``dst`` whose size an earlier step announced
        (on the pair's slot; a CPU transport only, as ``RankTransport.expect``)."""
        self.run_gate()
        if self.comm_device.type != "cpu":
            return
        peer, seq = self.peer(src), self._slot(src, dst, 0)
        for mb in mbs:
            known = self._received.get((peer, kind, mb, seq))
            if known is not None and (peer, kind, mb, seq) not in self._early:
                buf = torch.empty(_PREFIX + known.nbytes, dtype=torch.uint8, device=self.comm_device)
                self._early[(peer, kind, mb, seq)] = (dist.irecv(buf, src=peer, tag=tag(kind, mb, seq)), buf)

    def expect_step(self, stages: int, microbatches: int) -> None:
        """At the start of a step: every receive of this rank's stages from other ranks (forwards from the
        stage before, gradients from the stage after) whose size is known, posted at once (``expect``) once
        the step's gate has run (at its first transfer: the first stage's first forward still overlaps the
        batch check)."""
        self._prepost = (stages, microbatches)

    def run_gate(self) -> None:
        super().run_gate()
        todo, self._prepost = self._prepost, None
        if todo is not None:
            self._post_step(*todo)

    def finish(self, ok: bool) -> None:
        if not ok:
            self._prepost = None  # a failed step posts nothing more
        super().finish(ok)

    def _post_step(self, stages: int, microbatches: int) -> None:
        for s in range(self.stage, stages, self.positions):
            if s > 0:
                self.expect(s - 1, s, "fwd", range(microbatches))
            if s < stages - 1:
                self.expect(s + 1, s, "bwd", range(microbatches))


class LastBackwards:
    """Calls ``done(loss)`` once every one of a rank's ``stages`` has run its last backward (``Pipeline``'s
    ``finished`` fires once per local stage): a rank's gradient reductions start after its last stage's.

    Usage: ``finished = LastBackwards(2, reduction.finished)``; ``Pipeline.train(..., finished=finished)``."""

    def __init__(self, stages: int, done: Any) -> None:
        self.left, self.done = stages, done

    def __call__(self, stage: int, loss: torch.Tensor) -> None:
        self.left -= 1
        if self.left == 0:
            self.done(loss)

"""Several pipeline stages per rank (looped: stage s on rank s % P) and Megatron's interleaved 1F1B, across 2
gloo ranks.

``span(model, balance=[1, 1, 1, 1], schedule="interleaved-1f1b")`` in a 2-rank job puts stages 0 and 2 on rank
0, 1 and 3 on rank 1. Each spawned rank checks the gradients of every parameter it holds against one device's
on the whole batch (float64), for uneven micro-batches, a tie between two ranks (embedding and head, stages 0
and
3) and a tie inside one rank (stages 0 and 2), after several optimizer steps, and its no-grad forward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from ranks_spawn import join_job, spawn
from test_ranks_pipeline import LOSS_TOL, TOL, _check, _leave, _seq
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port
from torchspan.runtime.ranks.looped import LoopedTransport, looped_mesh, position_groups
from torchspan.runtime.ranks.mesh import Mesh


class Tied4(nn.Module):
    """embed+a | b | c | head: ``c`` shares ``a``'s weight (stages 0 and 2: one rank), ``head`` the
    embedding's (stages 0 and 3: two ranks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(11, 6)
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.c.weight = self.a.weight
        self.head.weight = self.embed.weight
        self.double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(self.embed(ids)))
        return self.head(torch.tanh(self.c(torch.tanh(self.b(h))))).flatten(0, 1)


def _steps(rank: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Gradients of 4 stages on 2 ranks equal one device's: schedules, losses, uneven micro-batches,
    accumulation."""
    labels = torch.tensor([0, 3, 3, 1, 2, 3, 0])
    schedules = (
        ("interleaved-1f1b", 4),
        ("interleaved-1f1b", 2),
        ("1f1b", 3),
        ("gpipe", 3),
        ("zero-bubble", 3),
        ("merged-weights", 3),
    )
    for schedule, m in schedules:
        for loss_fn, target in ((nn.MSELoss(), y), (nn.CrossEntropyLoss(ignore_index=1), labels)):
            label = f"{schedule}, {m} micro-batches, {type(loss_fn).__name__}"
            model = _seq()
            reference = copy.deepcopy(model)
            spanned = torchspan.span(model, balance=[1, 1, 1, 1], microbatches=m, schedule=schedule)
            got = spanned.train_step(x, target, loss_fn)  # 7 rows: uneven micro-batches
            want = loss_fn(reference(x), target)
            want.backward()
            torch.testing.assert_close(
                got.double(), want.detach(), **LOSS_TOL, msg=lambda e, label=label: f"{label}: loss: {e}"
            )
            assert _check(spanned, reference, label, rank) == (
                4 if rank == 0 else 2
            )  # Linears 0 and 2, or Linear 3
            spanned.train_step(x[:5], target[:5], loss_fn)  # accumulated, as on one device
            loss_fn(reference(x[:5]), target[:5]).backward()
            _check(spanned, reference, f"{label}, accumulated", rank)
            with torch.no_grad():
                torch.testing.assert_close(spanned(x), reference(x).detach(), **TOL)


def _optimizer_and_ties(rank: int, g: torch.Generator) -> None:
    model = _seq()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, devices=["cpu"] * 4, microbatches=4, schedule="interleaved-1f1b")
    opt, ref_opt = (
        torch.optim.Adam(spanned.parameters(), lr=0.05),
        torch.optim.Adam(reference.parameters(), lr=0.05),
    )
    for n in (7, 6, 4):
        xs, ys = (
            torch.randn(n, 5, generator=g, dtype=torch.float64),
            torch.randn(n, 4, generator=g, dtype=torch.float64),
        )
        opt.zero_grad()
        spanned.train_step(xs, ys, nn.MSELoss())
        opt.step()
        ref_opt.zero_grad()
        nn.MSELoss()(reference(xs), ys).backward()
        ref_opt.step()
    ref = dict(reference.named_parameters())
    for name, p in spanned.module.named_parameters():
        if p.device.type != "meta":
            torch.testing.assert_close(p.detach(), ref[name].detach(), rtol=1e-9, atol=1e-11)

    ids = torch.randint(0, 11, (7, 3), generator=g)
    tokens = torch.randint(0, 11, (21,), generator=g)
    model = Tied4()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, balance=[2, 1, 1, 1], microbatches=4, schedule="interleaved-1f1b")
    assert spanned.mode == "fx"
    loss_fn = nn.CrossEntropyLoss()
    got = spanned.train_step(
        ids, tokens.view(7, 3), lambda out, t: loss_fn(out, t.flatten()), loss_reduction="mean"
    )
    want = loss_fn(reference(ids), tokens)
    want.backward()
    torch.testing.assert_close(got.double(), want.detach(), **LOSS_TOL)
    # rank 0 holds embed, a and c (c.weight is a.weight): 4 parameters; rank 1 b and head (head.weight is
    # embed's): 3
    assert _check(spanned, reference, "ties inside and across ranks", rank) == (4 if rank == 0 else 3)
    torch.optim.SGD(spanned.parameters(), lr=0.5).step()
    copies = [torch.zeros(11, 6, dtype=torch.float64) for _ in range(2)]
    torch.distributed.all_gather(copies, model.embed.weight.detach())
    assert torch.equal(copies[0], copies[1]), "the tied weight's copies drifted apart"


def _messages(rank: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Once the headers are known, a step of 4 micro-batches sends one message per stage boundary that crosses
    ranks and micro-batch: rank 0 the forwards of stages 0 and 2 and the backward of stage 2 (12), rank 1
    likewise."""
    from torchspan.runtime.ranks import p2p

    sent: list[int] = []
    isend = p2p.dist.isend

    def counted(*args: object, **kwargs: object) -> object:
        sent.append(1)
        return isend(*args, **kwargs)

    spanned = torchspan.span(_seq(), balance=[1, 1, 1, 1], microbatches=4, schedule="interleaved-1f1b")
    spanned.train_step(x, y, nn.MSELoss())  # announces the headers
    p2p.dist.isend = counted
    try:
        spanned.train_step(x, y, nn.MSELoss())
    finally:
        p2p.dist.isend = isend
    assert len(sent) == 12, f"rank {rank} sent {len(sent)} messages"


def _worker(rank: int, world: int, port: int) -> None:
    join_job(rank, world, port, timeout=30)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64)
    y = torch.randn(7, 4, generator=g, dtype=torch.float64)
    _steps(rank, x, y)
    _optimizer_and_ties(rank, g)
    _messages(rank, x, y)
    with pytest.raises(ValueError, match=r"microbatches=3 is not a multiple of 2; pass microbatches=2 or 4"):
        torchspan.span(_seq(), balance=[1, 1, 1, 1], microbatches=3, schedule="interleaved-1f1b").train_step(
            x, y, nn.MSELoss()
        )
    _leave()


def test_looped_placement_and_its_transport() -> None:
    """Stage s on rank s % P; a stage of this rank is local (a hand-off), each remote stage pair on its own
    slot."""
    assert position_groups([["a"], ["b"], ["c"], ["d"]], 2) == [["a", "c"], ["b", "d"]]
    assert looped_mesh(2, 4) == Mesh(2, 1) and looped_mesh(4, 4) is None
    with pytest.raises(
        ValueError, match=r"5 stages on WORLD_SIZE\(2\) .* balance= \(or devices=\) with 4 or 6 entries"
    ):
        looped_mesh(2, 5)
    t = LoopedTransport(Mesh(2), 0, torch.device("cpu"), stages=4)
    assert [t.is_local(s) for s in range(4)] == [True, False, True, False]
    assert [t.peer(s) for s in range(4)] == [0, 1, 0, 1]
    assert {t._slot(0, 1, 0), t._slot(2, 3, 0)} == {0, 1} and t._slot(1, 2, 0) == 0  # 0->1 and 2->3 apart


@pytest.mark.slow
def test_four_stages_on_two_ranks_match_one_device() -> None:
    spawn(_worker, 2, free_port(), deadline=240)

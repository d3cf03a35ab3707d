"""A pipeline across 2 gloo ranks on 127.0.0.1: every rank's own gradients equal one device's.

``span(model, balance=[2, 2], ...)`` in a launched job puts one stage on each rank. Each spawned
rank checks the parameters it holds, by qualified name, against a single-device reference on the
whole batch (float64: only the order of additions differs) — torch's ``test_schedule_multiproc``
pattern. One spawn runs all cases to keep the suite fast on a small machine; a failing stage must
end both ranks, naming the rank, well within 60 s.
"""

from __future__ import annotations

import copy
import os
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from ranks_spawn import spawn
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port, init_distributed
from torchspan.runtime.ranks.mesh import Mesh, launched_stages

TOL = dict(rtol=1e-10, atol=1e-12)
LOSS_TOL = dict(rtol=1e-6, atol=1e-7)  # the returned loss is float32, as the local runtime's


def _seq() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6), nn.Linear(6, 4)).double()


class TiedLM(nn.Module):
    """Embedding and output head share one weight; with balance [2, 1] they sit on different ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight
        self.double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(ids)))).flatten(0, 1)


def _check(spanned: torchspan.Spanned, reference: nn.Module, label: str, rank: int) -> int:
    """Compare every parameter this rank holds (not meta) with the reference's gradient; returns how many."""
    ref = dict(reference.named_parameters())
    held = 0
    for name, p in spanned.module.named_parameters():
        if p.device.type == "meta":
            assert not p.requires_grad, f"{label}: rank {rank}: {name} is another stage's but trainable"
            continue
        held += 1
        assert p.grad is not None, f"{label}: rank {rank}: {name} has no gradient"
        torch.testing.assert_close(
            p.grad, ref[name].grad, **TOL, msg=lambda m: f"{label}: rank {rank}: {name}: {m}"
        )
    return held


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    init_distributed(timeout=30)


def _leave() -> None:
    """Leave the job together: a rank exiting with its gloo groups alive can abort in their threads' teardown
    (spawned children skip the atexit hook init_distributed registers)."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _pipeline_worker(rank: int, world: int, port: int) -> None:
    _join(rank, world, port)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64)  # 7 rows in 3 micro-batches: 3 + 2 + 2
    y = torch.randn(7, 4, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 3, 3, 1, 2, 3, 0])
    weights = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64)
    for schedule in ("gpipe", "1f1b"):
        for loss_fn, target in (
            (nn.MSELoss(), y),
            (nn.CrossEntropyLoss(weight=weights, ignore_index=1), labels),
        ):
            label = f"{schedule}, {type(loss_fn).__name__}"
            model = _seq()
            reference = copy.deepcopy(model)
            spanned = torchspan.span(model, balance=[2, 2], microbatches=3, schedule=schedule)
            got = spanned.train_step(x, target, loss_fn)
            want = loss_fn(reference(x), target)
            want.backward()
            torch.testing.assert_close(
                got.double(), want.detach(), **LOSS_TOL, msg=lambda m: f"{label}: loss on rank {rank}: {m}"
            )
            assert _check(spanned, reference, label, rank) == (2 if rank == 0 else 4)  # its own Linears only
            # accumulation over a second step without zero_grad, as on one device
            spanned.train_step(x[:5], target[:5], loss_fn)
            loss_fn(reference(x[:5]), target[:5]).backward()
            _check(spanned, reference, f"{label}, accumulated", rank)

    # a few optimizer steps: the split model trains exactly like the whole one
    model = _seq()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, devices=["cpu", "cpu"], microbatches=4, schedule="1f1b")
    opt = torch.optim.Adam(spanned.parameters(), lr=0.05)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
    for n in (7, 6, 5):
        opt.zero_grad()
        spanned.train_step(x[:n], y[:n], nn.MSELoss())
        opt.step()
        ref_opt.zero_grad()
        nn.MSELoss()(reference(x[:n]), y[:n]).backward()
        ref_opt.step()
    ref = dict(reference.named_parameters())
    for name, p in spanned.module.named_parameters():
        if p.device.type != "meta":
            torch.testing.assert_close(p.detach(), ref[name].detach(), rtol=1e-9, atol=1e-11)
    # forward: the last stage's outputs on every rank, equal to the whole model's
    with torch.no_grad():  # in training, a pipeline's spanned(x) refuses (its backward needs train_step)
        torch.testing.assert_close(spanned(x), reference(x).detach(), **TOL)

    # an fx-split model whose tied embedding/head weight spans the two ranks
    ids = torch.randint(0, 11, (7, 3), generator=g)
    tokens = torch.randint(0, 11, (21,), generator=g)
    model = TiedLM()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, balance=[2, 1], microbatches=3, schedule="1f1b")
    assert spanned.mode == "fx"
    loss_fn = nn.CrossEntropyLoss()
    got = spanned.train_step(
        ids, tokens.view(7, 3), lambda out, t: loss_fn(out, t.flatten()), loss_reduction="mean"
    )
    want = loss_fn(reference(ids), tokens)
    want.backward()
    torch.testing.assert_close(got.double(), want.detach(), **LOSS_TOL)
    assert _check(spanned, reference, "tied across ranks", rank) == (3 if rank == 0 else 1)
    torch.optim.SGD(spanned.parameters(), lr=0.5).step()
    copies = [torch.zeros(11, 6, dtype=torch.float64) for _ in range(world)]
    torch.distributed.all_gather(copies, model.embed.weight.detach())
    assert torch.equal(copies[0], copies[1]), "the tied weight's copies drifted apart"

    # shapes change between steps (sequence length, micro-batch sizes; a forward in between shares the
    # channels): the transport's predicted headers must notice every change and stay exact, receives posted
    # early (the stage before sends its forwards first: gpipe, merged-weights) included
    for schedule in ("1f1b", "gpipe", "merged-weights"):
        model = _seq()
        reference = copy.deepcopy(model)
        spanned = torchspan.span(model, balance=[2, 2], microbatches=3, schedule=schedule)
        for rows, length in ((7, 3), (7, 5), (5, 5), (7, 3), (7, 3)):
            xs = torch.randn(rows, length, 5, generator=g, dtype=torch.float64)
            ys = torch.randn(rows, length, 4, generator=g, dtype=torch.float64)
            spanned.zero_grad()
            reference.zero_grad()
            got = spanned.train_step(xs, ys, nn.MSELoss())
            want = nn.MSELoss()(reference(xs), ys)
            want.backward()
            label = f"{schedule}, {rows} rows of length {length}"
            torch.testing.assert_close(
                got.double(), want.detach(), **LOSS_TOL, msg=lambda m: f"{label}: loss: {m}"
            )
            _check(spanned, reference, label, rank)
            if length == 5:
                with torch.no_grad():  # evaluation: in training a pipeline's spanned(x) refuses (train_step)
                    torch.testing.assert_close(spanned(xs[:4]), reference(xs[:4]).detach(), **TOL)
    _early_receives(rank, x, y)
    _leave()


def _early_receives(rank: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Once a step announced the message sizes, the last stage posts every forward receive at its first one
    when the stage before runs its forwards first (merged-weights, gpipe), never under 1F1B; stage 0 posts
    none."""
    from torchspan.runtime.ranks import p2p

    posted: list[int] = []
    irecv = p2p.dist.irecv

    def counted(*args: object, **kwargs: object) -> object:
        posted.append(1)
        return irecv(*args, **kwargs)

    for schedule, early in (("merged-weights", 3), ("gpipe", 3), ("1f1b", 0)):
        spanned = torchspan.span(_seq(), balance=[2, 2], microbatches=3, schedule=schedule)
        spanned.train_step(x, y, nn.MSELoss())  # announces the headers
        posted.clear()
        p2p.dist.irecv = counted
        try:
            spanned.train_step(x, y, nn.MSELoss())
        finally:
            p2p.dist.irecv = irecv
        assert len(posted) == (early if rank == 1 else 0), (
            f"{schedule}: rank {rank} posted {len(posted)} early receive(s)"
        )


def _failing_worker(rank: int, world: int, port: int, out: str) -> None:
    _join(rank, world, port)

    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom in the last stage")

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), Boom())
    spanned = torchspan.span(model, balance=[2, 1], microbatches=2, schedule="1f1b")
    torch.manual_seed(0)  # the same batch on both ranks
    try:
        spanned.train_step(torch.randn(4, 4), torch.randn(4, 4), nn.MSELoss())
    except BaseException as exc:
        text = "".join(traceback.format_exception(exc))
        Path(out, f"rank{rank}.txt").write_text(text)
        raise
    Path(out, f"rank{rank}.txt").write_text("no error")


def _spawn(fn, world: int, *args, deadline: float = 90.0) -> float:
    """Run ``fn`` on ``world`` processes; fail the test (never hang) past ``deadline``; return the seconds
    taken."""
    return spawn(fn, world, *args, deadline=deadline)


def test_mesh_equation_and_stage_count() -> None:
    assert Mesh.for_world(4, 2).stage_ranks(1) == [1, 3]
    with pytest.raises(ValueError, match=r"pp\(2\) \* dp_replicate\(2\) \* dp_shard\(1\) != WORLD_SIZE\(6\)"):
        Mesh.for_world(6, 2, replicas=2)
    with pytest.raises(ValueError, match=r"WORLD_SIZE\(6\) is not a multiple of pp\(4\)"):
        Mesh.for_world(6, 4)
    assert launched_stages(None, "cpu,cpu", None) == 2 and launched_stages(None, None, [1, 2, 1]) == 3
    assert launched_stages(None, None, None) == 1


@pytest.mark.slow
def test_two_rank_pipeline_matches_one_device() -> None:
    _spawn(_pipeline_worker, 2, free_port())


@pytest.mark.slow
def test_failing_stage_ends_every_rank_naming_it(tmp_path: Path) -> None:
    ctx = mp.start_processes(
        _failing_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    start = time.monotonic()
    # Every rank must stop on its own (not only because a launcher kills it): poll the processes, kill none.
    while any(p.is_alive() for p in ctx.processes) and time.monotonic() - start < 60:
        time.sleep(0.2)
    alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
    for i in alive:
        ctx.processes[i].kill()
    assert not alive, f"rank(s) {alive} still waiting 60 s after stage 1 failed"
    last = (tmp_path / "rank1.txt").read_text()
    assert "boom in the last stage" in last and "stage 1 on rank 1" in last, last
    first = (tmp_path / "rank0.txt").read_text()
    assert "from rank 1 (stage 1)" in first, first

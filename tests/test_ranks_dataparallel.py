"""Exact data parallel over gloo processes on 127.0.0.1: every rank's gradients equal one device's.

Each spawned rank checks its own gradients by parameter name against a single-device reference
computed on the concatenation of all ranks' shards (float64, so the only difference is the order
of additions). One spawn runs all cases to keep the suite fast on a small machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from ranks_spawn import spawn
from torch import nn

from torchspan.runtime.ranks import DataParallelReplica, free_port, init_distributed, shard_batch, shard_sizes

TOL = dict(rtol=1e-10, atol=1e-12)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def _check_grads(replica: DataParallelReplica, reference: nn.Module, label: str) -> None:
    ref = dict(reference.named_parameters())
    for name, p in replica.named_parameters():
        assert p.grad is not None, f"{label}: {name} has no gradient"
        torch.testing.assert_close(p.grad, ref[name].grad, **TOL, msg=lambda m: f"{label}: {name}: {m}")


def _case(
    replica: DataParallelReplica,
    rank: int,
    world: int,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn,
    label: str,
    **declared,
) -> None:
    """One train_step on this rank's shard, checked against the whole batch on one device."""
    reference = _model()
    reference.load_state_dict(replica.state_dict())
    want = loss_fn(reference(x), y)
    want.backward()
    replica.module.zero_grad()
    got = replica.train_step(*shard_batch((x, y), rank, world), loss_fn, **declared)
    torch.testing.assert_close(got, want.detach(), **TOL, msg=lambda m: f"{label}: loss: {m}")
    _check_grads(replica, reference, label)


def _parity_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    info = init_distributed(timeout=60)
    assert (info.rank, info.world_size, info.backend) == (rank, world, "gloo")
    assert init_distributed() == info  # idempotent
    torch.manual_seed(123 + rank)  # different initial weights on every rank: the broadcast must fix them
    replica = DataParallelReplica(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).double())
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64)  # 7 rows over 2 ranks: 4 + 3
    y = torch.randn(7, 4, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 3, 3, 1, 2, 3, 0])
    padded = torch.tensor([0, 1, 3, 2, -1, -1, -1])  # rank 1's rows (4, 5, 6) are all padding
    weights = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64)
    _case(replica, rank, world, x, y, nn.MSELoss(), "mse mean, uneven")
    _case(replica, rank, world, x, y, nn.MSELoss(reduction="sum"), "mse sum, uneven")
    _case(
        replica, rank, world, x, labels, nn.CrossEntropyLoss(weight=weights), "class-weighted cross-entropy"
    )
    _case(replica, rank, world, x, padded, nn.CrossEntropyLoss(ignore_index=-1), "padded cross-entropy")
    _case(
        replica,
        rank,
        world,
        x,
        padded,
        nn.CrossEntropyLoss(weight=weights, ignore_index=-1),
        "weighted + padded",
    )
    _case(replica, rank, world, x[:1], y[:1], nn.MSELoss(), "empty shard on rank 1")
    _case(replica, rank, world, x, labels, torch.nn.functional.cross_entropy, "functional cross-entropy")
    token_mean = lambda out, t: (
        torch.nn.functional.cross_entropy(out, t, ignore_index=-1, reduction="sum") / (t != -1).sum()
    )  # noqa: E731
    _case(
        replica,
        rank,
        world,
        x[:5],
        padded[:5],
        token_mean,
        "lambda with loss_normalizer",
        loss_normalizer=lambda t: (t != -1).sum(),
    )
    summed = lambda out, t: ((out - t) ** 2).sum()  # noqa: E731
    _case(replica, rank, world, x, y, summed, "lambda declared as a sum", loss_reduction="sum")

    # several optimizer steps: the replicas stay identical, and equal to one device's training
    reference = _model()
    reference.load_state_dict(replica.state_dict())
    opt = torch.optim.Adam(replica.parameters(), lr=0.05)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss(weight=weights)
    for step in range(4):
        n = 7 - step  # uneven global batches: 7, 6, 5, 4 rows
        opt.zero_grad()
        replica.train_step(*shard_batch((x[:n], labels[:n]), rank, world), loss_fn)
        opt.step()
        ref_opt.zero_grad()
        loss_fn(reference(x[:n]), labels[:n]).backward()
        ref_opt.step()
    for name, p in replica.named_parameters():
        torch.testing.assert_close(
            p.detach(), dict(reference.named_parameters())[name].detach(), rtol=1e-9, atol=1e-11
        )

    # gradients accumulate over two train_steps without zero_grad, as on one device
    replica.module.zero_grad()
    reference.zero_grad()
    for n in (7, 5):
        replica.train_step(*shard_batch((x[:n], y[:n]), rank, world), nn.MSELoss())
        nn.MSELoss()(reference(x[:n]), y[:n]).backward()
    _check_grads(replica, reference, "accumulated over two steps")

    # uneven epoch ends: rank 0 has three batches, the others two; join(optimizer) shadows the third
    opt = torch.optim.SGD(replica.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    mine = [
        (x[2 * step + rank : 2 * step + rank + 1], y[2 * step + rank : 2 * step + rank + 1])
        for step in range(2)
    ]
    if rank == 0:
        mine.append((x[4:7], y[4:7]))
    for rows, targets in mine:
        opt.zero_grad()
        loss = replica.train_step(rows, targets, nn.MSELoss())
        last_grads = {name: p.grad.clone() for name, p in replica.named_parameters()}
        opt.step()
    for step, rows in enumerate(
        [torch.arange(2 * s, 2 * s + world) for s in range(2)] + [torch.arange(4, 7)]
    ):
        ref_opt.zero_grad()
        want = nn.MSELoss()(reference(x[rows]), y[rows])
        want.backward()
        ref_opt.step()
    if rank == 0:  # its last step ran alone: the global batch is its own three rows
        torch.testing.assert_close(loss, want.detach(), **TOL)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(last_grads[name], p.grad, **TOL)
    shadowed = replica.join(opt)
    assert shadowed == (0 if rank == 0 else 1), shadowed
    for name, p in replica.named_parameters():
        torch.testing.assert_close(
            p.detach(), dict(reference.named_parameters())[name].detach(), rtol=1e-9, atol=1e-11
        )
    torch.save(replica.state_dict(), Path(out) / f"rank{rank}.pt")


def _spawn(fn, world: int, *args, deadline: float = 90.0) -> None:
    spawn(fn, world, *args, deadline=deadline)


@pytest.mark.slow
def test_two_ranks_uneven_shards_match_one_device(tmp_path: Path) -> None:
    assert shard_sizes(7, 2) == [4, 3]
    _spawn(_parity_worker, 2, free_port(), str(tmp_path))
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert list(states[0]) == ["0.weight", "0.bias", "2.weight", "2.bias"]  # the model's own keys
    for other in states[1:]:
        for key, value in states[0].items():
            assert torch.equal(value, other[key]), f"replicas differ at {key}"

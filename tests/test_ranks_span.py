"""``torchspan.span(model)`` in a launched job is an exact data-parallel replica (issue 12's three-line
script).

Two gloo ranks on 127.0.0.1 run ``init_distributed(); spanned = span(model); spanned.train_step(shard...)``
and check their gradients by parameter name against one device on the whole batch (7 rows = 4 + 3,
float64). One spawn runs every case; a non-launched ``span(model)`` stays the local runtime.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from ranks_spawn import spawn
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port, shard_batch

TOL = dict(rtol=1e-10, atol=1e-12)
LOSS_TOL = dict(rtol=1e-6, atol=1e-7)  # the returned loss may be float32


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def _grads_match(spanned: torchspan.Spanned, reference: nn.Module, label: str) -> None:
    ref = dict(reference.named_parameters())
    for name, p in spanned.module.named_parameters():
        assert p.grad is not None, f"{label}: {name} has no gradient"
        torch.testing.assert_close(p.grad, ref[name].grad, **TOL, msg=lambda m: f"{label}: {name}: {m}")


def _case(
    rank: int, world: int, x: torch.Tensor, y: torch.Tensor, loss_fn, label: str, **declared
) -> torchspan.Spanned:
    model = _model()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model)
    assert spanned.mode == "data-parallel", label
    got = spanned.train_step(*shard_batch((x, y), rank, world), loss_fn, **declared)
    want = loss_fn(reference(x), y)
    want.backward()
    torch.testing.assert_close(got.double(), want.detach(), **LOSS_TOL, msg=lambda m: f"{label}: loss: {m}")
    _grads_match(spanned, reference, label)
    return spanned


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    torchspan.init_distributed(timeout=30)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64)  # 7 rows over 2 ranks: 4 + 3
    y = torch.randn(7, 4, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 3, 3, 1, 2, 3, 0])
    weights = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64)

    spanned = _case(rank, world, x, y, nn.MSELoss(), "mse mean, uneven")
    assert list(spanned.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]  # the model's own keys
    assert spanned.stages == [("cpu", ["0", "1", "2"])] and spanned.balance == [3]
    assert [e.kind for e in spanned.timeline()] == ["forward", "backward"]
    assert spanned.memory()[0]["activations"] > 0 and spanned.memory()[0]["grads"] > 0
    # the saved-activation meter runs on the first step only: later steps cost what the bare replica does
    first, held = spanned.memory()[0]["activations"], []
    spanned._meter.hold = lambda stage, t: held.append(t) or t  # type: ignore[method-assign]
    spanned.train_step(*shard_batch((x, y), rank, world), nn.MSELoss())
    assert held == [] and not spanned._executor.meters(), "the meter still counts after the first step"
    assert spanned.memory()[0]["activations"] == first and [e.kind for e in spanned.timeline()] == [
        "forward",
        "backward",
    ]
    empty = _case(rank, world, x[:1], y[:1], nn.MSELoss(), "empty shard on rank 1, first step")
    assert empty._executor.meters() == (rank == 1)  # nothing saved yet on rank 1: its next step is metered
    _case(
        rank,
        world,
        x,
        labels,
        nn.CrossEntropyLoss(weight=weights, ignore_index=1),
        "class-weighted cross-entropy",
    )
    _case(rank, world, x[:1], y[:1], nn.MSELoss(), "empty shard on rank 1")
    # opaque lambdas: calibrated on each shard's halves and agreed by the ranks, as a local span calibrates
    # them
    _case(rank, world, x, y, lambda out, t: ((out - t) ** 2).mean(), "lambda mean, calibrated")
    _case(rank, world, x, y, lambda out, t: ((out - t) ** 2).sum(), "lambda sum, calibrated")
    with pytest.raises(ValueError, match="is not a per-sample mean or a sum"):
        _case(rank, world, x, y, lambda out, t: ((out - t) ** 2).mean().sqrt(), "lambda neither")
    with pytest.raises(ValueError, match="no rank's shard has 2 samples or more"):
        _case(rank, world, x[:2], y[:2], lambda out, t: (out - t).abs().max(), "one row per rank")
    _case(
        rank,
        world,
        x[:2],
        y[:2],
        lambda out, t: (out - t).abs().sum(),
        "one row per rank, declared",
        loss_reduction="sum",
    )
    assert (
        torchspan.span(_model(), microbatches=2).microbatches == 2
    )  # taken as locally (test_ranks_dataparallel_settings)
    with pytest.raises(ValueError, match="join.. is not supported by a 'sequential' executor across ranks"):
        torchspan.span(_model(), balance=[2, 1]).join()  # a pipeline across the ranks has no join

    # forward: this rank's shard through the replica; state, optimizer steps and join at an uneven epoch end
    model = _model()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model)
    with torch.no_grad():
        torch.testing.assert_close(spanned(x[:3]), reference(x[:3]), **TOL)
    opt = torch.optim.SGD(spanned.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    batches = [x[0:2], x[2:4]] + ([x[4:7]] if rank == 0 else [])  # rank 0 has a third batch
    for step, rows in enumerate(batches):
        mine = rows[rank : rank + 1] if step < 2 else rows
        target = y[(2 * step + rank) : (2 * step + rank + 1)] if step < 2 else y[4:7]
        opt.zero_grad()
        spanned.train_step(mine, target, nn.MSELoss())
        opt.step()
    for rows in (slice(0, 2), slice(2, 4), slice(4, 7)):
        ref_opt.zero_grad()
        nn.MSELoss()(reference(x[rows]), y[rows]).backward()
        ref_opt.step()
    assert spanned.join(opt) == (0 if rank == 0 else 1)
    ref = dict(reference.named_parameters())
    for name, p in spanned.module.named_parameters():
        torch.testing.assert_close(
            p.detach(), ref[name].detach(), rtol=1e-9, atol=1e-11, msg=lambda m: f"after join: {name}: {m}"
        )


def _spawn(fn, world: int, *args, deadline: float = 90.0) -> None:
    spawn(fn, world, *args, deadline=deadline)


@pytest.mark.slow
def test_launched_span_is_an_exact_data_parallel_replica() -> None:
    _spawn(_worker, 2, free_port())


def test_span_without_a_launch_is_unchanged() -> None:
    assert torchspan.span(_model()).mode == "sequential"
    torchspan.init_distributed(timeout=30)  # a world of one: still the local runtime
    try:
        spanned = torchspan.span(_model())
        assert spanned.mode == "sequential"
        assert spanned.join() == 0
        x = torch.randn(3, 5, dtype=torch.float64)
        spanned.train_step(x, torch.randn(3, 4, dtype=torch.float64), nn.MSELoss())
    finally:
        torch.distributed.destroy_process_group()

"""A rank's pipeline meters saved activations once per micro-batch shape, not every step (issue 13's speed).

The saved-tensor hooks behind ``Spanned.memory()`` cost ~5% of a small 2-rank step, so a launched
pipeline counts them on its first training step and again only when a step's micro-batches differ
(shapes, dtypes, structure): ``memory()`` still reports activations after many steps, a repeated
shape installs no hooks, and a new shape is metered afresh (its own peak). A local span meters a
repeated step once too (tests/test_runtime_meter_repeat.py), though its façade asks for a new peak every step.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port, init_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def _counting(spanned: torchspan.Spanned) -> list[int]:
    """Count the tensors the meter is asked to hold (still counting them)."""
    calls: list[int] = []
    hold = spanned._meter.hold

    def counted(stage: int, t: torch.Tensor):  # type: ignore[no-untyped-def]
        calls.append(stage)
        return hold(stage, t)

    spanned._meter.hold = counted  # type: ignore[method-assign]
    return calls


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    init_distributed(timeout=30)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 5, generator=g, dtype=torch.float64)
    y = torch.randn(8, 4, generator=g, dtype=torch.float64)
    spanned = torchspan.span(_model(), balance=[3, 2], microbatches=2, schedule="1f1b")
    assert spanned.mode == "sequential" and spanned._executor.meters()
    calls = _counting(spanned)

    spanned.train_step(x, y, nn.MSELoss())
    first = spanned.memory()[rank]["activations"]
    assert calls and first > 0, f"rank {rank}: the first step was not metered"
    assert not spanned._executor.meters(), "the façade still resets the meter after a metered step"
    for _ in range(3):  # the same shapes: no saved-tensor hooks, the first step's peak stays
        calls.clear()
        spanned.train_step(x, y, nn.MSELoss())
        assert calls == [], f"rank {rank}: a repeated shape was metered again ({len(calls)} saved tensors)"
        assert spanned.memory()[rank]["activations"] == first
    assert [e.kind for e in spanned.timeline() if e.kind != "transfer"].count(
        "backward"
    ) == 2  # the timeline still records

    spanned.train_step(x[:4], y[:4], nn.MSELoss())  # fewer rows: metered again, its own (smaller) peak
    assert calls, f"rank {rank}: a new micro-batch shape was not metered"
    assert 0 < spanned.memory()[rank]["activations"] < first
    calls.clear()
    spanned.train_step(x[:4], y[:4], nn.MSELoss())
    assert calls == []
    spanned.train_step(x.float().double(), y, nn.MSELoss())  # back to the first shape: metered again
    assert calls and spanned.memory()[rank]["activations"] == first
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_rank_pipeline_meters_once_per_shape() -> None:
    start = time.monotonic()
    ctx = mp.start_processes(_worker, args=(2, free_port()), nprocs=2, join=False, start_method="spawn")
    while not ctx.join(timeout=0.5):
        if time.monotonic() - start > 90:
            for p in ctx.processes:
                p.kill()
            pytest.fail("ranks still running after 90 s")


def test_local_pipeline_meters_a_repeated_step_once() -> None:
    spanned = torchspan.span(
        _model(), balance=[3, 2], devices=["cpu", "cpu"], microbatches=2, schedule="1f1b"
    )
    calls = _counting(spanned)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    spanned.train_step(x, y, nn.MSELoss())
    first = spanned.memory()[1]["activations"]
    assert calls and first > 0
    calls.clear()
    spanned.train_step(x, y, nn.MSELoss())
    assert calls == [] and spanned.memory()[1]["activations"] == first

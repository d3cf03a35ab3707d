"""Gradient accumulation over ``train_step`` calls in data parallel (issue 21 item 2): no ``zero_grad()``
between calls, and after each call ``.grad`` is one device's sum of the full-batch gradients so far.

Two gloo ranks on 127.0.0.1, uneven shards (7, 5 and 3 rows: 4 + 3, 3 + 2, 2 + 1), float64 compared with
one device on each whole batch. The replica's DDP reduces gradients it already holds again on every call
(its mean keeps them, each backward being of the loss times the world size), so an accumulation path that
reduced earlier gradients as a sum (double-reduced) or forgot the world size fails here:

- ``span(model)``: three calls with mean, class-weighted and summed losses, then ``clip_grad_norm_`` and an
  optimizer step (one device's weights), and a second window after ``zero_grad()``;
- the bare ``DataParallelReplica`` with ``microbatches=2`` (DDP's ``no_sync`` inside a call, accumulation
across),
  the returned loss carried in DDP's buckets, and with ``find_unused_parameters`` (all-reduced on its own);
- an uneven end: rank 1 runs out after two calls and ``join()``s (no optimizer), shadowing rank 0's third;
- fp16 (a SUM hook, earlier gradients set aside during the backward): a bare replica with a ``GradScaler`` and
a
  span's ``SpanScaler``, against the same autocast on the same rows in one process;
- a backward the user runs through ``replica(x)`` / ``spanned(x)`` sums the ranks' losses' gradients.
"""

from __future__ import annotations

import copy
import os
import traceback
from pathlib import Path

import pytest
import torch
from test_ranks_pipeline import _leave, _spawn
from torch import nn

import torchspan
from torchspan.runtime.ranks import DataParallelReplica, free_port, shard_batch

TOL = dict(rtol=1e-10, atol=1e-12)
ROWS = (7, 5, 3)  # three calls: uneven shards 4 + 3, 3 + 2, 2 + 1
WEIGHTS = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64)


def _mlp(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).to(dtype)


def _data(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return (
        torch.randn(18, 5, generator=g, dtype=dtype),
        torch.randn(18, 4, generator=g, dtype=dtype),
        torch.randint(0, 4, (18,), generator=g),
    )


def _batches() -> list[tuple[slice, str]]:
    """Each call's rows and loss: different losses, so each call weighs its shards its own way."""
    starts = [0, 7, 12]
    return [(slice(s, s + n), kind) for s, n, kind in zip(starts, ROWS, ("mse", "weighted-ce", "mse-sum"))]


def _loss(kind: str) -> nn.Module:
    return {
        "mse": nn.MSELoss(),
        "weighted-ce": nn.CrossEntropyLoss(weight=WEIGHTS),
        "mse-sum": nn.MSELoss(reduction="sum"),
    }[kind]


def _target(kind: str, y: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return labels if kind == "weighted-ce" else y


def _same_grads(module: nn.Module, reference: nn.Module, label: str, **tol: float) -> None:
    ref = dict(reference.named_parameters())
    for name, p in module.named_parameters():
        assert p.grad is not None, f"{label}: {name} has no gradient"
        torch.testing.assert_close(
            p.grad, ref[name].grad, **(tol or TOL), msg=lambda m: f"{label}: {name}: {m}"
        )


def _span_case(rank: int) -> None:
    """``span(model)``: three calls accumulate; clip; step; a second window after ``zero_grad()``."""
    x, y, labels = _data()
    model = _mlp()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model)
    assert spanned.mode == "data-parallel"
    opt, ref_opt = (
        torch.optim.SGD(spanned.parameters(), lr=0.1),
        torch.optim.SGD(reference.parameters(), lr=0.1),
    )
    for window in range(2):
        for call, (rows, kind) in enumerate(_batches()):
            target = _target(kind, y, labels)
            got = spanned.train_step(*shard_batch((x[rows], target[rows]), rank, 2), _loss(kind))
            want = _loss(kind)(reference(x[rows]), target[rows])
            want.backward()
            torch.testing.assert_close(got, want.detach(), **TOL)
            _same_grads(spanned.module, reference, f"span, window {window}, after call {call + 1}")
        norm = spanned.clip_grad_norm_(0.05)
        ref_norm = nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        torch.testing.assert_close(norm, ref_norm, **TOL)
        assert float(ref_norm) > 0.05, "the clip must scale something"
        _same_grads(spanned.module, reference, f"span, window {window}, clipped")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(dict(spanned.module.named_parameters())[name].detach(), p.detach(), **TOL)


def _microbatch_case(rank: int) -> None:
    """A bare replica cutting each shard in two chunks (``no_sync`` inside a call), accumulating across calls;
    and one with ``find_unused_parameters`` (no loss carrier in DDP's buckets: the loss is all-reduced on its
    own)."""
    x, y, labels = _data()
    for options in ({}, {"find_unused_parameters": True}):
        replica = DataParallelReplica(_mlp(), **options)
        reference = _mlp()
        for call, (rows, kind) in enumerate(_batches()):
            target = _target(kind, y, labels)
            got = replica.train_step(
                *shard_batch((x[rows], target[rows]), rank, 2), _loss(kind), microbatches=2
            )
            want = _loss(kind)(reference(x[rows]), target[rows])
            want.backward()
            torch.testing.assert_close(got, want.detach(), **TOL)
            _same_grads(
                replica.module, reference, f"replica {options}, 2 micro-batches, after call {call + 1}"
            )


def _join_case(rank: int) -> None:
    """Rank 1 runs out after two calls and joins (no optimizer: the window goes on); rank 0's third call is
    its rows alone, and both ranks end with one device's accumulated gradients, clipped alike."""
    x, y, labels = _data()
    model = _mlp()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model)
    calls = _batches() if rank == 0 else _batches()[:2]
    for rows, kind in calls:
        target = _target(kind, y, labels)
        spanned.train_step(*shard_batch((x[rows], target[rows]), rank, 2), _loss(kind))
    assert spanned.join() == (0 if rank == 0 else 1)
    for i, (rows, kind) in enumerate(_batches()):
        target = _target(kind, y, labels)
        if i == 2:  # rank 0's shard of the third batch was all there was
            rows = slice(rows.start, rows.start + 2)
        _loss(kind)(reference(x[rows]), target[rows]).backward()
    _same_grads(spanned.module, reference, f"rank {rank} after join")
    torch.testing.assert_close(
        spanned.clip_grad_norm_(0.05), nn.utils.clip_grad_norm_(reference.parameters(), 0.05), **TOL
    )
    _same_grads(spanned.module, reference, f"rank {rank} after join, clipped")


def _fp16_case(rank: int) -> None:
    """fp16: a bare replica with a GradScaler (scaled gradients) and a span (SpanScaler: unscaled), three
    calls."""
    x, y, _ = _data(torch.float32)
    scalers = torch.amp.GradScaler("cpu", init_scale=256.0), torch.amp.GradScaler("cpu", init_scale=256.0)
    replica = DataParallelReplica(_mlp(torch.float32), precision="fp16", scaler=scalers[0])
    spanned = torchspan.span(_mlp(torch.float32), precision="fp16")
    reference = _mlp(torch.float32)
    for call, (rows, _) in enumerate(_batches()):
        replica.train_step(*shard_batch((x[rows], y[rows]), rank, 2), nn.functional.mse_loss)
        spanned.train_step(*shard_batch((x[rows], y[rows]), rank, 2), nn.functional.mse_loss)
        n, half = rows.stop - rows.start, (rows.stop - rows.start + 1) // 2
        for part in (
            slice(rows.start, rows.start + half),
            slice(rows.start + half, rows.stop),
        ):  # each rank's shard
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(reference(x[part]), y[part]) * ((part.stop - part.start) / n)
            scalers[1].scale(loss).backward()
        _same_grads(
            replica.module, reference, f"fp16 GradScaler, after call {call + 1}", rtol=1e-5, atol=1e-6
        )
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    scalers[1].unscale_(opt)
    _same_grads(spanned.module, reference, "fp16 span, three calls", rtol=1e-5, atol=1e-6)


def _manual_case(rank: int) -> None:
    """A backward the user runs through the replica's forward sums every rank's loss gradient."""
    x, y, _ = _data()
    replica = DataParallelReplica(_mlp())
    spanned = torchspan.span(_mlp(), loss_reduction="sum")  # the plain loop's opaque loss, declared
    reference = _mlp()
    xs, ys = shard_batch((x[:7], y[:7]), rank, 2)
    ((replica(xs) - ys) ** 2).sum().backward()
    ((spanned(xs) - ys) ** 2).sum().backward()
    ((reference(x[:7]) - y[:7]) ** 2).sum().backward()
    _same_grads(replica.module, reference, "replica(x), backward run by the user")
    _same_grads(spanned.module, reference, "spanned(x), backward run by the user")


CASES = (_span_case, _microbatch_case, _join_case, _fp16_case, _manual_case)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    torchspan.init_distributed(timeout=60)
    done = []
    try:
        for case in CASES:
            case(rank)
            done.append(case.__name__)
    except BaseException:
        done.append("FAILED " + traceback.format_exc())
    Path(out, f"rank{rank}.txt").write_text("\n".join(done))
    _leave()


@pytest.mark.slow
def test_gradients_accumulate_over_train_steps_as_on_one_device(tmp_path: Path) -> None:
    _spawn(_worker, 2, free_port(), str(tmp_path), deadline=180.0)
    for rank in range(2):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert "FAILED" not in text, f"rank {rank}:\n{text}"
        assert text.split() == [case.__name__ for case in CASES], text

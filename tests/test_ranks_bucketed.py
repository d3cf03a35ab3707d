"""A pipeline stage's replicas reduce in DDP's buckets during the last backward (``ranks.bucketed``).

4 gloo ranks, 2 stages x 2 replicas; every stage reduces bucketed under 1F1B, GPipe and zero-bubble (its
last weight pass), a merged weight pass stays flat: the test fails unless the reducer took some parameter's
gradient from the armed backward's hooks on every rank (``used``). Each case trains one step twice
from the same parameters, bucketed (the default) and flat (``RankStage.bucketed = False``, one all-reduce
per dtype after the backward): the gradients must be equal bit for bit, and both equal to one device's.
The first stage holds a branch taken only for some rows (a data-dependent model, as a mixture of
experts): taken in an earlier micro-batch of both replicas but not in their last (given -0.0 after the
backward: its earlier gradient summed in its bucket), taken by one replica only, or by none (its
gradient stays ``None``, as on one device).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_ranks_pipeline import _join, _leave, _spawn
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port, shard_batch
from torchspan.runtime.ranks.stage import RankStage


class Gated(nn.Module):
    """A linear layer, plus ``extra`` for a micro-batch with a row whose first feature is over 50."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 8)
        self.extra = nn.Linear(5, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if bool((x[:, 0] > 50).any()):
            y = y + self.extra(x)
        return y


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(Gated(), nn.Tanh(), nn.Linear(8, 6), nn.Linear(6, 4)).double()


def _grads(spanned: torchspan.Spanned) -> dict[str, torch.Tensor | None]:
    return {
        n: (None if p.grad is None else p.grad.clone())
        for n, p in spanned.module.named_parameters()
        if p.device.type != "meta"
    }


def _step(bucketed: bool, schedule: str, x: torch.Tensor, y: torch.Tensor, replica: int) -> Any:
    RankStage.bucketed = bucketed
    spanned = torchspan.span(_model(), balance=[2, 2], microbatches=2, schedule=schedule)
    spanned.train_step(*shard_batch((x, y), replica, 2), nn.MSELoss(reduction="sum"))
    buckets = spanned._executor.ranks._buckets
    # how many parameters' gradients the reducer took from the hooks of the armed backward
    reduced = int(buckets.used.sum()) if buckets is not None and buckets.launched else 0
    return _grads(spanned), reduced


def _worker(rank: int, world: int, port: int) -> None:
    _join(rank, world, port)
    RankStage.bucket_later_above = 0  # later stages bucketed too, however small
    replica = rank // 2
    g = torch.Generator().manual_seed(11)
    x = torch.randn(8, 5, generator=g, dtype=torch.float64)
    y = torch.randn(8, 4, generator=g, dtype=torch.float64)
    # rows 4r, 4r+1 are replica r's first micro-batch, 4r+2, 4r+3 its last
    cases = {"earlier only": [0, 4], "one replica": [0, 2], "none": []}
    for schedule in ("1f1b", "gpipe", "zero-bubble", "merged-weights"):
        for label, rows in cases.items():
            xs = x.clone()
            xs[rows, 0] = 100.0
            got, used = _step(True, schedule, xs, y, replica)
            flat, _ = _step(False, schedule, xs, y, replica)
            bucketed = schedule != "merged-weights"  # a merged weight pass stays flat
            assert (used > 0) == bucketed, f"{schedule} {label}: rank {rank}: {used} parameter(s) bucketed"
            reference = _model()
            for i in range(0, 8, 2):  # one device, micro-batch by micro-batch as the branch is taken
                nn.MSELoss(reduction="sum")(reference(xs[i : i + 2]), y[i : i + 2]).backward()
            ref = dict(reference.named_parameters())
            for name, grad in got.items():
                want = ref[name].grad
                assert (grad is None) == (flat[name] is None) == (want is None), f"{label}: {name}"
                if grad is not None:
                    assert torch.equal(grad, flat[name]), f"{schedule} {label}: rank {rank}: {name}"
                    torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-11)
    RankStage.bucketed = True

    # gradients accumulate over steps as without replicas (the earlier step's added back after); the loss
    # (summed over the replicas in the reducer's last bucket) is the full batch's
    spanned = torchspan.span(_model(), balance=[2, 2], microbatches=2, schedule="1f1b")
    reference = copy.deepcopy(_model())
    for _ in range(2):
        loss = spanned.train_step(*shard_batch((x, y), replica, 2), nn.MSELoss(reduction="sum"))
        want = nn.MSELoss(reduction="sum")(reference(x), y)
        want.backward()
        torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-6, atol=1e-9)
    assert spanned._executor.ranks._buckets.used.sum() > 0, f"rank {rank}: not bucketed"
    ref = dict(reference.named_parameters())
    for name, p in spanned.module.named_parameters():
        if p.device.type != "meta" and ref[name].grad is not None:
            torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-9, atol=1e-11)

    RankStage.bucket_later_above = 26 << 20  # the default: a later stage this small stays flat
    _, used = _step(True, "1f1b", x, y, replica)
    assert (used > 0) == (rank % 2 == 0), f"rank {rank}: {used} parameter(s) bucketed by default"
    _leave()


@pytest.mark.slow
def test_bucketed_replicas_match_flat_and_one_device() -> None:
    _spawn(_worker, 4, free_port(), deadline=170.0)

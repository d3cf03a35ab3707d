"""A stage replica whose last micro-batch reaches none of its stage's parameters (``ranks.bucketed``).

4 gloo ranks, 2 stages x 2 replicas. Every parameter of the stages below sits in a branch taken only for a
micro-batch with a row whose first feature is over 50 (data-dependent, as a mixture of experts), so one
replica's last backward may reach none of its stage's parameters (its stage output then may not even
need a gradient) while the other replica's reaches them. Every replica of a stage must still take part in
the same bucket all-reduces (else the others wait for the process group's timeout: a hang, bounded here
by the spawn deadline), and the gradients must equal the flat reduction's bit for bit and one device's,
``None`` where one device leaves it ``None``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_ranks_pipeline import _join, _leave, _spawn
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port, shard_batch
from torchspan.runtime.ranks.stage import RankStage


class Branch(nn.Module):
    """``x``, plus a small ``extra(x)`` for a micro-batch with a row whose first feature is over 50 (kept
    over 50 for the next one)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] > 50).any()):
            return x + 0.01 * self.extra(x)
        return x


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def _model(scaled: bool) -> nn.Module:
    """``scaled=False``: stage 0 is one ``Branch`` (its last backward may reach nothing, its output need no
    gradient); ``True``: stage 0 always reaches ``Scale``, stage 1's input always needs a gradient."""
    torch.manual_seed(5)
    layers = [Scale(), Branch(), Branch(), nn.Tanh()] if scaled else [Branch(), Branch(), nn.Tanh()]
    return nn.Sequential(*layers).double()


def _step(
    bucketed: bool, scaled: bool, schedule: str, xs: torch.Tensor, y: torch.Tensor, replica: int
) -> Any:
    RankStage.bucketed = bucketed
    spanned = torchspan.span(
        _model(scaled), balance=[2, 2] if scaled else [1, 2], microbatches=2, schedule=schedule
    )
    spanned.train_step(*shard_batch((xs, y), replica, 2), nn.MSELoss(reduction="sum"))
    buckets = spanned._executor.ranks._buckets
    grads = {
        n: (None if p.grad is None else p.grad.clone())
        for n, p in spanned.module.named_parameters()
        if p.device.type != "meta"
    }
    return grads, (buckets.launched if buckets is not None else 0)


def _reference(scaled: bool, xs: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One device, micro-batch by micro-batch as the branches are taken."""
    model = _model(scaled)
    for i in range(0, 8, 2):
        loss = nn.MSELoss(reduction="sum")(model(xs[i : i + 2]), y[i : i + 2])
        if loss.requires_grad:
            loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _worker(rank: int, world: int, port: int, schedules: tuple[str, ...]) -> None:
    _join(rank, world, port)
    RankStage.bucket_later_above = 0  # later stages bucketed too, however small
    replica = rank // 2
    g = torch.Generator().manual_seed(13)
    x = torch.randn(8, 5, generator=g, dtype=torch.float64)
    y = torch.randn(8, 5, generator=g, dtype=torch.float64)
    # rows 4r, 4r+1 are replica r's first micro-batch, 4r+2, 4r+3 its last
    cases = {"one replica's last": [2, 4], "earlier only": [0, 4], "last of both": [2, 6]}
    try:
        for scaled in (False, True):
            for schedule in schedules:
                for label, rows in cases.items():
                    xs = x.clone()
                    xs[rows, 0] = 100.0
                    got, launched = _step(True, scaled, schedule, xs, y, replica)
                    flat, _ = _step(False, scaled, schedule, xs, y, replica)
                    where = f"scaled={scaled} {schedule} {label}: rank {rank}"
                    bucketed = schedule != "merged-weights"  # a merged weight pass stays flat
                    assert (launched > 0) == bucketed, f"{where}: {launched} bucket(s) launched"
                    ref = _reference(scaled, xs, y)
                    for name, grad in got.items():
                        want = ref[name]
                        assert (grad is None) == (flat[name] is None) == (want is None), f"{where}: {name}"
                        if grad is not None:
                            assert torch.equal(grad, flat[name]), f"{where}: {name}"
                            torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-11)
    finally:
        RankStage.bucketed = True
    _leave()


@pytest.mark.slow
def test_a_replica_reaching_no_parameter_neither_hangs_nor_drifts() -> None:
    schedules = ("1f1b", "gpipe", "zero-bubble", "merged-weights")
    _spawn(_worker, 4, free_port(), schedules, deadline=150.0)

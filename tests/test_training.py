"""torchspan.training: the measured loop shared by `torchspan run` and the demo."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console
from torch import nn

import torchspan
from torchspan.training import LossNotFinite, mse_loss, train


def _spanned() -> tuple[torchspan.Spanned, torch.optim.Optimizer]:
    torch.manual_seed(0)
    spanned = torchspan.span(
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), devices=["cpu", "cpu"], microbatches=2
    )
    return spanned, torch.optim.SGD(spanned.parameters(), lr=0.1)


def test_train_measures_every_step_and_learns() -> None:
    spanned, opt = _spanned()
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    seen = []

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(step)
        return x, y

    out = io.StringIO()
    trained = train(
        spanned,
        opt,
        batch,
        nn.functional.mse_loss,
        12,
        console=Console(file=out, width=120),
        items_per_step=8,
    )
    assert seen == list(range(12))
    assert len(trained.losses) == len(trained.step_times) == len(trained.optimizer_times) == 12
    assert trained.losses[-1] < trained.losses[0]
    assert all(t > 0 for t in trained.step_times) and trained.seconds >= sum(trained.step_times)
    assert trained.items_per_second == pytest.approx(8 * 12 / trained.seconds)
    assert "12/12" in out.getvalue() and "mem " in out.getvalue()


def test_a_diverging_loss_names_the_step_and_the_learning_rate() -> None:
    spanned, opt = _spanned()
    x = torch.randn(4, 4)
    targets = [torch.randn(4, 2), torch.full((4, 2), float("inf"))]
    with pytest.raises(
        LossNotFinite, match=r"loss became inf at step 1; lower the learning rate \(lr=0.1\)"
    ) as info:
        train(
            spanned,
            opt,
            lambda step: (x, targets[step]),
            nn.functional.mse_loss,
            3,
            console=Console(file=io.StringIO()),
            items_per_step=4,
        )
    assert info.value.step == 1 and isinstance(info.value, FloatingPointError)
    with pytest.raises(ValueError, match="steps=0 must be an int >= 1"):
        train(
            spanned,
            opt,
            lambda step: (x, targets[0]),
            nn.functional.mse_loss,
            0,
            console=Console(file=io.StringIO()),
            items_per_step=4,
        )


def test_mse_loss_sums_over_floating_outputs() -> None:
    a, b = torch.ones(2, 3), torch.zeros(2, 3)
    out = {"x": a, "ids": torch.ones(2, dtype=torch.long), "y": 2 * a}
    assert mse_loss(out, {"x": b, "ids": torch.zeros(2, dtype=torch.long), "y": b}).item() == pytest.approx(
        1.0 + 4.0
    )
    with pytest.raises(ValueError, match="no floating-point tensor"):
        mse_loss(torch.ones(2, dtype=torch.long), torch.ones(2, dtype=torch.long))

"""Buffers after a step: a checkpoint recompute must not update BatchNorm statistics or counters twice."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import torchspan


class Counter(nn.Module):
    """Counts the samples it has seen in a registered buffer (updated in place in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return self.lin(x)


class Net(nn.Module):
    """fx-traceable; with ``branch=True`` fx cannot trace it (hook placement)."""

    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.count = Counter()
        self.out = nn.Linear(8, 2)
        self.branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.branch and h.sum() > 1e9:  # data-dependent: never true here
            h = h * 0
        return self.out(self.count(torch.relu(self.bn(h))))


def _net(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "sequential":
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), Counter(), nn.Linear(8, 2))
    return Net(branch=kind == "own-forward-serial")


@pytest.mark.parametrize("kind", ["sequential", "fx", "own-forward-serial"])
@pytest.mark.parametrize("path", ["train_step", "forward"])
def test_checkpoint_recompute_leaves_buffers_as_one_forward(kind: str, path: str) -> None:
    model = _net(kind)
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    nn.functional.mse_loss(ref(x), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # hook-mode notice
        spanned = torchspan.span(model, devices=["cpu", "cpu", "cpu"], microbatches=1, recompute="always")
    assert spanned.mode == kind
    if path == "train_step":
        spanned.train_step(x, y, nn.functional.mse_loss)
    else:
        nn.functional.mse_loss(spanned(x), y).backward()
    for (name, want), got in zip(ref.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(got, want, msg=f"buffer/parameter {name} after one checkpointed step")
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=f"grad of {name}")


def test_counter_counts_each_sample_once_with_microbatches() -> None:
    model = _net("fx")
    model.bn.eval()  # keep BatchNorm out of it: per-micro-batch statistics are expected to differ
    spanned = torchspan.span(
        model, devices=["cpu", "cpu"], microbatches=3, recompute="except_last", schedule="1f1b"
    )
    spanned.train_step(torch.randn(7, 4), torch.randn(7, 2), nn.functional.mse_loss)
    assert float(model.count.seen) == 7.0


class DropNet(nn.Module):
    """fx cannot trace it (data-dependent branch); dropout and BatchNorm in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.inp(x))
        if h.sum() > 1e9:
            h = h * 0
        return self.out(nn.functional.dropout(h, 0.5, training=self.training))


def test_hook_mode_recording_forward_leaves_no_trace() -> None:
    """The forward that finds the execution order must not draw random numbers or update statistics."""
    torch.manual_seed(0)
    model = DropNet()
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    torch.manual_seed(7)
    nn.functional.mse_loss(ref(x), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spanned = torchspan.span(model, devices=["cpu", "cpu"], microbatches=1)
    torch.manual_seed(7)
    spanned.train_step(x, y, nn.functional.mse_loss)
    for (name, want), got in zip(ref.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(got, want, msg=f"{name} after the first hook-mode step")
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=f"grad of {name} (same dropout mask)")


class RootOwned(nn.Module):
    """fx cannot trace it; the model itself owns ``gain`` (read after ``b``) and ``shift`` (read first)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 2)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.register_buffer("shift", torch.full((4,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x + self.shift)
        if h.sum() > 1e9:
            h = h * 0
        return self.c(torch.tanh(self.b(h)) * self.gain)


@pytest.mark.parametrize("balance, gain_on", [([1, 2], "meta"), (None, "cpu")])
def test_hook_mode_puts_model_owned_tensors_where_first_read(balance: list[int] | None, gain_on: str) -> None:
    """``meta`` stands for a second device: ``gain`` must live with ``b``, ``shift`` with ``a``."""
    torch.manual_seed(0)
    model = RootOwned()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spanned = torchspan.span(model, devices=["cpu", "meta"], balance=balance, microbatches=2)
    out = spanned(torch.randn(4, 4))
    assert spanned.stages[0][0] == "cpu" and model.b.weight.device.type == gain_on
    assert out.device.type == "meta" and out.shape == (4, 2)
    assert model.gain.device.type == gain_on and model.shift.device.type == "cpu"


def test_hook_mode_model_owned_parameter_trains_exactly() -> None:
    torch.manual_seed(0)
    model = RootOwned()
    ref = copy.deepcopy(model)
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    nn.functional.mse_loss(ref(x), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spanned = torchspan.span(model, devices=["cpu", "cpu", "cpu"], microbatches=2)
    spanned.train_step(x, y, nn.functional.mse_loss)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=f"grad of {name}")

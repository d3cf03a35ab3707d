"""Exact gradients for losses whose mean is not a mean over samples (class weights, ignore_index).

Weighting micro-batch losses by their share of samples is only exact for plain means; these tests
compare every case with a single-device full-batch reference, uneven splits included.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from runtime_models import sequential
from torch import nn

import torchspan


def _reference(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., Any]
) -> tuple[float, list[torch.Tensor]]:
    ref = copy.deepcopy(model)
    loss = loss_fn(ref(x), y)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in ref.parameters()]


def _check(spanned: Any, model: nn.Module, ref: tuple[float, list[torch.Tensor]], loss: torch.Tensor) -> None:
    ref_loss, ref_grads = ref
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    for p, g in zip(model.parameters(), ref_grads):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


# 11 samples in 4 micro-batches: sizes 3, 3, 3, 2 (uneven); labels chosen so one chunk is all ignored.
X = torch.randn(11, 6, generator=torch.Generator().manual_seed(1))
Y = torch.tensor([0, 2, 2, -100, -100, -100, 1, 2, 0, 1, 1])
Y_PAD = torch.tensor([0, 2, 2, 7, 7, 7, 1, 2, 0, 1, 1])


LOSSES: dict[str, tuple[Callable[..., Any], torch.Tensor]] = {
    "ce-class-weights": (nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0])), Y.clamp(min=0)),
    "ce-ignore-index": (nn.CrossEntropyLoss(), Y),
    "ce-weights-and-ignore": (
        nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0]), ignore_index=7),
        Y_PAD,
    ),
    "ce-label-smoothing": (
        nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0]), label_smoothing=0.1),
        Y.clamp(min=0),
    ),
    "functional-ce-ignore": (F.cross_entropy, Y),
    "ce-sum": (nn.CrossEntropyLoss(reduction="sum", weight=torch.tensor([0.2, 1.0, 3.0])), Y.clamp(min=0)),
}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_parity_uneven_three_stages(name: str, schedule: str) -> None:
    loss_fn, y = LOSSES[name]
    model = sequential()
    ref = _reference(model, X, y, loss_fn)
    spanned = torchspan.span(
        model, devices=["cpu", "cpu", "cpu"], balance=[3, 2, 2], microbatches=4, schedule=schedule
    )
    _check(spanned, model, ref, spanned.train_step(X, y, loss_fn))


def test_nll_module_with_weights_is_recognised() -> None:
    # NLLLoss used directly as loss_fn (the model ends in log-softmax)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3), nn.LogSoftmax(-1))
    loss_fn = nn.NLLLoss(weight=torch.tensor([1.0, 2.0, 0.5]), ignore_index=-100)
    ref = _reference(model, X, Y, loss_fn)
    spanned = torchspan.span(model, devices=["cpu", "cpu"], balance=[2, 2], microbatches=5)
    _check(spanned, model, ref, spanned.train_step(X, Y, loss_fn))


class Branchy(nn.Module):
    """fx cannot trace it (data-dependent branch), so span places it with hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if h.sum() > 1e6:
            h = h * 0
        return self.b(h)


def test_hook_mode_uses_the_same_weights() -> None:
    torch.manual_seed(0)
    model = Branchy()
    loss_fn = nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0]))
    ref = _reference(model, X, Y, loss_fn)
    spanned = torchspan.span(model, devices=["cpu", "cpu"], balance=[1, 1], microbatches=4)
    _check(spanned, model, ref, spanned.train_step(X, Y, loss_fn))
    assert spanned.mode == "own-forward"  # the model's own forward, one thread per micro-batch


def test_reduction_is_read_from_the_loss_module() -> None:
    model = sequential()
    loss_fn = nn.MSELoss(reduction="sum")
    y = torch.randn(11, 3)
    ref = _reference(model, X, y, loss_fn)
    spanned = torchspan.span(model, devices=["cpu", "cpu"], balance=[4, 3], microbatches=3)
    _check(spanned, model, ref, spanned.train_step(X, y, loss_fn))  # no loss_reduction needed


def test_plain_function_sum_needs_loss_reduction() -> None:
    model = sequential()
    y = torch.randn(11, 3)

    def summed(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((out - t) ** 2).sum()

    ref = _reference(model, X, y, summed)
    spanned = torchspan.span(model, devices=["cpu", "cpu"], balance=[4, 3], microbatches=3)
    _check(spanned, model, ref, spanned.train_step(X, y, summed, loss_reduction="sum"))


def test_contradicting_reduction_is_an_error() -> None:
    spanned = torchspan.span(sequential(), devices=["cpu", "cpu"], balance=[4, 3], microbatches=2)
    with pytest.raises(
        ValueError, match=r"loss_reduction='mean' contradicts loss_fn=MSELoss\(reduction='sum'\)"
    ):
        spanned.train_step(X, torch.randn(11, 3), nn.MSELoss(reduction="sum"), loss_reduction="mean")
    with pytest.raises(ValueError, match="reduction='none'"):
        spanned.train_step(X, torch.randn(11, 3), nn.MSELoss(reduction="none"))
    with pytest.raises(ValueError, match="loss_reduction='avg'"):
        spanned.train_step(X, torch.randn(11, 3), F.mse_loss, loss_reduction="avg")


def test_all_ignored_microbatch_adds_exactly_zero() -> None:
    model = sequential()
    y = torch.tensor([-100] * 6 + [0, 1, 2, 1, 0])  # first two micro-batches (3+3) entirely ignored
    ref = _reference(model, X, y, nn.CrossEntropyLoss())
    spanned = torchspan.span(model, devices=["cpu", "cpu"], balance=[4, 3], microbatches=4)
    loss = spanned.train_step(X, y, nn.CrossEntropyLoss())
    assert torch.isfinite(loss)
    _check(spanned, model, ref, loss)


def test_batchnorm_with_microbatches_warns_once_and_names_the_layer() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    spanned = torchspan.span(model, devices=["cpu", "cpu"], balance=[2, 1], microbatches=2)
    with pytest.warns(UserWarning, match=r"BatchNorm layer\(s\) '1' in training mode .* microbatches=2"):
        spanned.train_step(torch.randn(8, 4), torch.randn(8, 2), nn.MSELoss())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spanned.train_step(torch.randn(8, 4), torch.randn(8, 2), nn.MSELoss())  # only once
        model[1].eval()
        one = torchspan.span(
            nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), devices=["cpu"], microbatches=1
        )
        one.train_step(
            torch.randn(8, 4), torch.randn(8, 8), nn.MSELoss()
        )  # one micro-batch: exact, no warning


def test_a_loss_that_is_not_a_scalar_is_an_error_in_every_mode() -> None:
    def per_sample(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y, reduction="none")

    hooked = torchspan.span(Branchy(), devices=["cpu", "cpu"], balance=[1, 1], microbatches=2)  # threads
    for spanned in (torchspan.span(sequential(), devices=["cpu", "cpu"], microbatches=2), hooked):
        with pytest.raises(
            ValueError, match=r"shape \(4,\); it must return a scalar \(use reduction='mean' or 'sum'\)"
        ):
            spanned.train_step(X[:8], Y[:8], per_sample)

"""torchspan.parity: one comparison of a spanned step's gradients with a plain single-device step."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import torchspan
from torchspan.parity import GradDiff, check_parity, grad_differences


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def test_spanned_step_matches_one_device_per_parameter() -> None:
    model = _model()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, devices=["cpu", "cpu"], balance=[2, 3], microbatches=3)
    x, y = torch.randn(7, 6), torch.randn(7, 3)  # uneven micro-batches: 3, 2, 2
    result = check_parity(spanned, reference, x, y, nn.functional.mse_loss, atol=1e-6, rtol=1e-5)
    assert result.ok, "\n".join(result.failures())
    assert [g.name for g in result.grads] == [n for n, _ in reference.named_parameters()]
    assert all(g.max_abs < 1e-6 for g in result.grads)
    assert [g.name for g in result.under("2")] == ["2.weight", "2.bias"]
    assert math.isclose(result.loss, result.reference_loss, rel_tol=1e-6)


def test_target_may_be_made_from_the_reference_output() -> None:
    model = _model()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, devices=["cpu", "cpu"], microbatches=2)
    shapes = []

    def target(out: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(out.shape))
        return torch.zeros_like(out)

    result = check_parity(spanned, reference, torch.randn(4, 6), target, nn.functional.mse_loss)
    assert shapes == [(4, 3)] and result.ok


def test_a_wrong_gradient_is_caught_with_its_size() -> None:
    model, reference = _model(), _model()
    x = torch.randn(5, 6)
    for m in (model, reference):
        m(x).sum().backward()
    assert all(d.within and d.max_abs == 0 for d in grad_differences(model, reference))
    with torch.no_grad():
        model[2].weight.grad[0, 0] += 0.5
    diffs = {d.name: d for d in grad_differences(model, reference)}
    bad = diffs["2.weight"]
    assert not bad.within and bad.max_abs == pytest.approx(0.5)
    assert bad.max_rel == pytest.approx(0.5 / reference[2].weight.grad.abs().max().item())
    assert all(d.within for n, d in diffs.items() if n != "2.weight")
    model[4].bias.grad = None  # a gradient on one side only is never within
    assert grad_differences(model, reference, names={"4.bias"}) == [
        GradDiff("4.bias", math.inf, math.inf, False)
    ]


def test_bad_arguments_say_what_to_pass() -> None:
    model = _model()
    spanned = torchspan.span(model, devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="copy.deepcopy"):
        check_parity(spanned, model, torch.randn(2, 6), torch.randn(2, 3), nn.functional.mse_loss)
    with pytest.raises(TypeError, match="torchspan.span"):
        check_parity(model, _model(), torch.randn(2, 6), torch.randn(2, 3), nn.functional.mse_loss)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no counterpart"):
        grad_differences(model, nn.Linear(6, 8))
    with pytest.raises(ValueError, match="tolerances must be >= 0"):
        grad_differences(model, _model(), atol=-1.0)

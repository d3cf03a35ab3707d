"""span at the edges (issue 10): a bare module is one layer; a model with nothing to train is refused in
train_step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchspan


@pytest.mark.parametrize("microbatches", [1, 3])
def test_bare_module_spans_as_one_layer_with_exact_gradients(microbatches: int) -> None:
    # seed 004's model: a single nn.Linear, which span refused ("has no child modules")
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    reference = copy.deepcopy(model)
    x, y = torch.randn(7, 3), torch.randn(7, 2)
    spanned = torchspan.span(model, devices=["cpu"], microbatches=microbatches)
    assert spanned.stages == [("cpu", [""])]
    spanned.train_step(x, y, nn.MSELoss())
    nn.MSELoss()(reference(x), y).backward()
    assert model.weight.grad is not None and reference.weight.grad is not None
    torch.testing.assert_close(model.weight.grad, reference.weight.grad)
    torch.testing.assert_close(model.bias.grad, reference.bias.grad)
    assert list(spanned.state_dict()) == ["weight", "bias"]
    with pytest.raises(ValueError, match="only 1 layer"):
        torchspan.span(nn.Linear(3, 2), devices=["cpu", "cpu"])


def test_bare_module_plans_and_runs_its_plan() -> None:
    model, x = nn.Linear(3, 2), torch.randn(4, 3)
    plan = torchspan.plan(model, x, devices="cpu")
    assert plan.layers == [""]
    loss = torchspan.span(model, plan).train_step(x, torch.randn(4, 2), nn.MSELoss())
    assert torch.isfinite(loss)


@pytest.mark.parametrize(
    "model",
    [nn.Sequential(nn.ReLU(), nn.Tanh()), nn.Sequential(nn.Linear(3, 3).requires_grad_(False), nn.ReLU())],
)
def test_train_step_refuses_a_model_with_nothing_to_train(model: nn.Module) -> None:
    spanned = torchspan.span(model, devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        spanned.train_step(torch.randn(4, 3), torch.randn(4, 3), nn.MSELoss())

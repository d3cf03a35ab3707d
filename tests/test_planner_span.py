"""``span(model, plan)`` runs exactly the placement that ``torchspan.plan`` chose (devices ['cpu', 'cpu'])."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchspan
from torchspan.planner import PlanError


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def test_plan_under_a_tight_budget_is_placed_and_trained_exactly_as_planned() -> None:
    net = model()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    roomy = torchspan.plan(net, x, devices=["cpu", "cpu"], memory={"cpu": "1GiB"})
    whole = roomy.stages[0].total_bytes if len(roomy.stages) == 1 else sum(s.total_bytes for s in roomy.stages)
    budget = int(whole * 0.7)  # too small for the whole model: the search must split it
    plan = torchspan.plan(net, x, devices=["cpu", "cpu"], memory={"cpu": budget}, schedule="1f1b")
    assert len(plan.stages) == 2
    assert all(s.total_bytes <= budget for s in plan.stages)

    reference = copy.deepcopy(net)
    spanned = torchspan.span(net, plan)
    assert spanned.stages == [(s.device, s.layers) for s in plan.stages]
    assert (spanned.microbatches, spanned.schedule, spanned.checkpoint) == (plan.microbatches, plan.schedule, plan.checkpoint)
    for s in plan.stages:
        for name in s.layers:
            for p in getattr(net, name).parameters():
                assert str(p.device) == s.device

    loss = spanned.train_step(x, y, nn.functional.mse_loss)
    ref_loss = nn.functional.mse_loss(reference(x), y)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    for (name, p), (_, q) in zip(net.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_budget_too_small_for_any_split_raises_plan_error() -> None:
    net = model()
    with pytest.raises(PlanError, match="no placement"):
        torchspan.plan(net, torch.randn(8, 16), devices=["cpu", "cpu"], memory={"cpu": "4KiB"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_budget_too_small_spills_to_the_cpu_and_trains() -> None:
    torch.manual_seed(0)
    # wide layers, so that the GPU is clearly faster and the planner uses it as far as the budget allows
    net = nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.Tanh()) for _ in range(4)], nn.Linear(2048, 4))
    reference = copy.deepcopy(net)
    x, y = torch.randn(64, 2048), torch.randn(64, 4)
    roomy = torchspan.plan(net, x, devices="cuda:0,cpu")
    whole = sum(s.total_bytes for s in roomy.stages)
    budget = int(whole * 0.6)
    plan = torchspan.plan(net, x, devices="cuda:0,cpu", memory={"cuda:0": budget})
    assert set(plan.devices) == {"cuda:0", "cpu"}
    assert all(s.total_bytes <= budget for s in plan.stages if s.device == "cuda:0")
    spanned = torchspan.span(net, plan)
    assert spanned.stages == [(s.device, s.layers) for s in plan.stages]
    loss = spanned.train_step(x, y, nn.functional.mse_loss)
    ref_loss = nn.functional.mse_loss(reference(x), y)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-4)
    for (name, p), (_, q) in zip(net.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-3, atol=1e-5, msg=name)

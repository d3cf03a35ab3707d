"""``span(model, plan)`` runs exactly the placement that ``torchspan.plan`` chose (devices ['cpu', 'cpu'])."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchspan
from torchspan.planner import PlanError
from torchspan.planner.cost import CostModel
from torchspan.planner.stages import Stage


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64),
        nn.Tanh(),
        nn.Linear(64, 64),
        nn.Tanh(),
        nn.Linear(64, 64),
        nn.Tanh(),
        nn.Linear(64, 4),
    )


def test_cpu_listed_twice_is_planned_as_one_stage_with_one_budget() -> None:
    net = model()
    x = torch.randn(8, 16)
    roomy = torchspan.plan(net, x, devices=["cpu", "cpu"], memory={"cpu": "1GiB"})
    assert roomy.devices == ["cpu"]
    assert any("cpu is listed 2 times" in n for n in roomy.notes)
    # 70% of the one-stage need: two real devices could split it, one CPU listed twice cannot
    budget = int(roomy.stages[0].total_bytes * 0.7)
    with pytest.raises(PlanError, match="listed 2 times: one device, one budget"):
        torchspan.plan(net, x, devices=["cpu", "cpu"], memory={"cpu": budget}, schedule="1f1b")


def test_plan_takes_the_old_checkpoint_keyword_with_a_future_warning() -> None:
    net, x = model(), torch.randn(8, 16)
    with pytest.warns(FutureWarning, match="checkpoint= is now recompute="):
        old = torchspan.plan(
            net, x, devices="a100-40gb*2", microbatches=2, schedule="1f1b", checkpoint="always"
        )
    assert old.recompute == "always"
    assert old == torchspan.plan(
        net, x, devices="a100-40gb*2", microbatches=2, schedule="1f1b", recompute="always"
    )
    with (
        pytest.warns(FutureWarning),
        pytest.raises(ValueError, match="recompute='never' and checkpoint='always' disagree"),
    ):
        torchspan.plan(net, x, devices="a100-40gb*2", recompute="never", checkpoint="always")


def test_a_two_stage_plan_on_one_cpu_is_predicted_serial_and_placed_exactly() -> None:
    net = model()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    prof = torchspan.profile(net, x, torchspan.devices(["cpu", "cpu"]), optimizer="adam", measure=False)
    cm = CostModel(prof, 4, "1f1b", "never")
    ev = cm.evaluate([Stage(0, 0, 3), Stage(1, 3, 7)])
    plan = cm.to_plan(ev, "hand")
    one = cm.evaluate([Stage(0, 0, 7)])
    assert plan.predicted_step_time == pytest.approx(one.step_time, rel=1e-12)  # one CPU: same serial work
    assert plan.peak_memory == {"cpu": sum(s.total_bytes for s in plan.stages)}

    reference = copy.deepcopy(net)
    spanned = torchspan.span(net, plan)
    assert spanned.stages == [(s.device, s.layers) for s in plan.stages]
    assert (spanned.microbatches, spanned.schedule, spanned.recompute) == (
        plan.microbatches,
        plan.schedule,
        plan.recompute,
    )
    loss = spanned.train_step(x, y, nn.functional.mse_loss)
    ref_loss = nn.functional.mse_loss(reference(x), y)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    for (name, p), (_, q) in zip(net.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.filterwarnings("ignore:BatchNorm layer")
def test_predicted_stage_memory_matches_the_runtime_on_a_convnet_split_after_a_relu() -> None:
    """A stage starting at a Conv after a ReLU holds its own copy of the input the ReLU also saved."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, stride=2),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    )
    x, y = torch.randn(8, 3, 16, 16), torch.randn(8, 4)
    prof = torchspan.profile(net, x, torchspan.devices(["cpu", "cpu"]), optimizer="adam", measure=False)
    assert prof.layers[3].shared_activation_bytes > 0  # the Conv's saved input is the ReLU's saved output
    cm = CostModel(prof, 2, "1f1b", "never")
    plan = cm.to_plan(cm.evaluate([Stage(0, 0, 3), Stage(1, 3, 9)]), "hand")
    spanned = torchspan.span(net, plan)
    opt = torch.optim.Adam(net.parameters())
    for _ in range(2):
        opt.zero_grad()
        spanned.train_step(x, y, nn.functional.mse_loss)
        opt.step()
    measured = spanned.memory(opt)
    b = 4  # samples per micro-batch
    for i, (sp, got) in enumerate(zip(plan.stages, measured)):
        assert (sp.param_bytes, sp.grad_bytes, sp.buffer_bytes, sp.optimizer_bytes) == (
            got["params"],
            got["grads"],
            got["buffers"],
            got["optimizer"],
        ), i
    assert plan.stages[0].activation_bytes == measured[0]["activations"]  # two micro-batches in flight, exact
    # the last stage also holds the loss's few saved bytes, which the profile (model only) does not see
    predicted, actual = plan.stages[1].activation_bytes, measured[1]["activations"]
    assert abs(predicted - actual) <= 0.01 * actual
    without_shared = predicted - b * prof.layers[3].shared_activation_bytes
    assert abs(without_shared - actual) > 0.3 * actual  # so the shared copy is what makes it match


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_budget_too_small_spills_to_the_cpu_and_trains() -> None:
    torch.manual_seed(0)
    # wide layers, so that the GPU is clearly faster and the planner uses it as far as the budget allows
    net = nn.Sequential(
        *[nn.Sequential(nn.Linear(2048, 2048), nn.Tanh()) for _ in range(4)], nn.Linear(2048, 4)
    )
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


@pytest.mark.parametrize("schedule, microbatches", [("1f1b", 2), ("gpipe", 4)])
def test_the_last_stage_is_charged_the_loss_saved_input(schedule: str, microbatches: int) -> None:
    """One output-sized tensor per micro-batch in flight: what cross-entropy and MSE save of their input."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 50))
    x = torch.randn(8, 16)
    prof = torchspan.profile(net, x, torchspan.devices(["cpu", "cpu"]), optimizer="adam", measure=False)
    cm = CostModel(prof, microbatches, schedule, "never")
    plan = cm.to_plan(cm.evaluate([Stage(0, 0, 2), Stage(1, 2, 3)]), "hand")
    b, k = 8 // microbatches, cm.in_flight(1, 2)
    out = b * 50 * 4  # one micro-batch of the model's output, float32
    assert cm.loss_saved == out
    model_only = k * (prof.layers[2].activation_bytes * b + b * prof.layers[2].shared_activation_bytes)
    assert plan.stages[1].activation_bytes == pytest.approx(model_only + k * out, abs=1)
    measured = {}
    for name, loss_fn, y in [
        ("ce", nn.CrossEntropyLoss(), torch.randint(0, 50, (8,))),
        ("mse", nn.MSELoss(), torch.randn(8, 50)),
    ]:
        spanned = torchspan.span(net, plan)
        spanned.train_step(x, y, loss_fn)
        measured[name] = spanned.memory()[1]["activations"]
        net.zero_grad()
    predicted = plan.stages[1].activation_bytes
    # cross-entropy: its log-softmax is charged; its class indices (int64) and scalars are not
    assert 0 <= measured["ce"] - predicted <= k * (8 * b + 16)
    # MSE also keeps its target, another output-sized tensor: documented as not charged
    assert measured["mse"] - predicted == k * out

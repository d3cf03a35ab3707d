"""PlanError: needed vs available per device, and checked ways to make the model fit."""

from __future__ import annotations

import re

import pytest
from planner_synth import device, layer

from torchspan.hardware import format_bytes, parse_memory
from torchspan.planner import PlanError, search
from torchspan.planner.cost import CostModel
from torchspan.planner.stages import Stage
from torchspan.profiler.costs import Profile


def tight(gpu_budget: int, cpu_budget: int, n_layers: int = 4) -> Profile:
    gpu = device("cuda", "gpu", gpu_budget, bandwidth=1e9, index=0)
    cpu = device("cpu", "cpu", cpu_budget)
    layers = [layer(f"l{i}", params=1000, act=50.0, out=20.0, speeds=[1.0, 0.1]) for i in range(n_layers)]
    return Profile(layers=layers, devices=[gpu, cpu], batch_size=8, input_bytes=20.0, optimizer="adam")


def test_plan_error_lists_needed_and_available_per_device() -> None:
    prof = tight(6_000, 6_000)  # each layer's state alone is 4,000 bytes
    with pytest.raises(PlanError) as info:
        search(prof)
    err = info.value
    assert isinstance(err, ValueError)
    text = str(err)
    assert "no placement of the 4 layer(s) fits" in text
    assert err.available == {"cuda:0": 6_000, "cpu": 6_000}
    assert set(err.needed) == {"cuda:0", "cpu"} and all(v > 16_000 for v in err.needed.values())
    assert "cuda:0 (gpu): available 5.86 KiB, holds at most 1 of 4 layers" in text
    assert "What would make it fit" in text and err.suggestions


def test_suggested_budgets_really_fit() -> None:
    prof = tight(6_000, 6_000)
    with pytest.raises(PlanError) as info:
        search(prof)
    tips = [t for t in info.value.suggestions if t.startswith("a larger budget on cuda:0")]
    assert tips, info.value.suggestions
    # "a larger budget on cuda:0: 13.09 KiB (now 5.86 KiB) fits" -> re-plan with that budget
    shown = re.search(r"cuda:0: ([0-9.]+) KiB", tips[0])
    assert shown is not None
    budget = int(float(shown.group(1)) * 1024) + 16  # rounding of the printed figure
    prof.devices[0].budget = budget
    plan = search(prof)
    assert all(s.total_bytes <= budget for s in plan.stages if s.device == "cuda:0")
    prof.devices[0].budget = int(budget * 0.97)
    with pytest.raises(PlanError):
        search(prof)


@pytest.mark.parametrize("n_layers", [3, 4, 5, 6])
def test_suggested_budgets_fit_exactly_as_printed(n_layers: int) -> None:
    # the printed figure is rounded up, never down: typing it back (--memory cuda:0=11.93KiB) must fit
    prof = tight(6_000, 6_000, n_layers)
    with pytest.raises(PlanError) as info:
        search(prof)
    tips = [re.match(r"a larger budget on (\S+): ([0-9.]+) (\w+) ", t) for t in info.value.suggestions]
    shown = [(m.group(1), parse_memory(m.group(2) + m.group(3))) for m in tips if m]
    assert shown, info.value.suggestions
    for name, budget in shown:
        index = [str(d.device) for d in prof.devices].index(name)
        prof.devices[index].budget = budget
        search(prof)  # fits
        prof.devices[index].budget = 6_000


def test_another_device_is_suggested_with_numbers() -> None:
    with pytest.raises(PlanError) as info:
        search(tight(6_000, 6_000))
    assert any(t.startswith("another device like cuda:0") for t in info.value.suggestions)


def test_fixed_settings_point_at_the_setting_that_fits() -> None:
    # GPipe keeps all 8 micro-batches' activations on the first stage; 1F1B keeps 2.
    gpu = device("cuda", "gpu", None, bandwidth=1e9, index=0)
    layers = [layer(f"l{i}", params=0, act=1000.0, out=1.0, speeds=[1.0, 1.0]) for i in range(2)]
    prof = Profile(
        layers=layers,
        devices=[gpu, device("cuda", "gpu", None, 1e9, 1)],
        batch_size=8,
        input_bytes=1.0,
        optimizer="sgd",
    )
    one_f = CostModel(prof, 8, "1f1b", "never").evaluate([Stage(0, 0, 1), Stage(1, 1, 2)])
    budget = max(m.total for m in one_f.memory)
    for d in prof.devices:
        d.budget = budget
    with pytest.raises(PlanError) as info:
        search(prof, microbatches=8, schedule="gpipe", recompute="never")
    tips = info.value.suggestions
    assert any(t.startswith("schedule='1f1b' fits") for t in tips), tips
    assert any(t.startswith("recompute='except_last' fits") for t in tips), tips
    assert search(prof, microbatches=8, schedule="1f1b", recompute="never").schedule == "1f1b"


def test_a_layer_larger_than_every_device_is_named() -> None:
    gpu = device("cuda", "gpu", 3_000, bandwidth=1e9, index=0)
    layers = [
        layer("huge", params=10_000, act=1.0, out=1.0, speeds=[1.0]),
        layer("small", 10, 1.0, 1.0, [1.0]),
    ]
    prof = Profile(layers=layers, devices=[gpu], batch_size=4, input_bytes=1.0, optimizer="adam")
    with pytest.raises(PlanError) as info:
        search(prof)
    text = str(info.value)
    assert "largest layer 'huge' alone needs" in text
    assert any("layer 'huge' needs" in t and "split that layer" in t for t in info.value.suggestions)
    assert format_bytes(3_000) in text


def test_a_device_listed_twice_has_one_budget_in_the_diagnosis() -> None:
    # each layer's state is 4,000 bytes: 10,000 bytes would hold half the model on each of two CPUs,
    # but 'cpu' listed twice is one CPU with one 10,000-byte budget
    devs = [device("cpu", "cpu", 10_000), device("cpu", "cpu", 10_000)]
    layers = [layer(f"l{i}", params=1000, act=10.0, out=10.0, speeds=[1.0, 1.0]) for i in range(4)]
    prof = Profile(layers=layers, devices=devs, batch_size=8, input_bytes=10.0, optimizer="adam")
    with pytest.raises(PlanError) as info:
        search(prof)
    err = info.value
    assert err.available == {"cpu": 10_000}
    assert "listed 2 times: one device, one budget for all its entries" in str(err)
    assert not any(
        t.startswith("another device") for t in err.suggestions
    )  # another 'cpu' entry is the same CPU
    tips = [t for t in err.suggestions if t.startswith("a larger budget on cpu: ")]
    assert len(tips) == 1, err.suggestions
    shown = re.search(r"cpu: ([0-9.]+) KiB", tips[0])
    assert shown is not None
    budget = int(float(shown.group(1)) * 1024) + 16
    for d in prof.devices:
        d.budget = budget
    plan = search(prof)
    assert plan.devices == ["cpu"] and plan.stages[0].total_bytes <= budget

"""The planner's price of interleaved-1f1b (``planner.interleaved``), checked by hand, and its choice by
search."""

from __future__ import annotations

import pytest
from planner_synth import device, layer

from torchspan import schedule as sched
from torchspan.planner.cost import CostModel
from torchspan.planner.interleaved import looped, positions
from torchspan.planner.optimize import search
from torchspan.planner.stages import Stage
from torchspan.profiler.costs import Profile


def _profile(n: int = 8, batch: int = 8, capacity: int = 10**9, bandwidth: float | None = None) -> Profile:
    """``n`` equal layers on two equal GPUs (infinite host bandwidth unless given: free links)."""
    gpus = [device("cuda", "gpu", capacity, bandwidth=bandwidth, index=i) for i in range(2)]
    layers = [layer(f"l{i}", params=100, act=10.0, out=4.0, speeds=[1.0, 1.0], fixed=0.0) for i in range(n)]
    return Profile(layers=layers, devices=gpus, batch_size=batch, input_bytes=5.0, optimizer="adam")


def test_interleaved_bubble_is_divided_by_the_stages_per_device() -> None:
    """2 devices, 4 looped stages of 2 layers, 4 micro-batches of 2 samples, free links: a device's work per
    micro-batch is R = 4 layers x 3e-4 s x 2 = 2.4 ms; 1F1B takes (M + P - 1) R, interleaved (M + (P - 1)/v)
    R."""
    prof = _profile()
    r = 4 * 3e-4 * 2
    one = CostModel(prof, 4, "1f1b", "never").evaluate([Stage(0, 0, 4), Stage(1, 4, 8)])
    assert one.step_time == pytest.approx((4 + 1) * r)
    inter = CostModel(prof, 4, "interleaved-1f1b", "never")
    stages = [Stage(0, 0, 2), Stage(1, 2, 4), Stage(0, 4, 6), Stage(1, 6, 8)]
    ev = inter.evaluate(stages)
    assert ev.step_time == pytest.approx((4 + 1 / 2) * r)
    # memory: each stage holds what the schedule keeps in flight on it
    plan = sched.build("interleaved-1f1b", 4, 4, 2)
    one_mb = CostModel(prof, 4, "1f1b", "never").stage_memory(0, 2, 1).activations
    assert [m.activations for m in ev.memory[:3]] == [sched.max_live(a) * one_mb for a in plan[:3]]
    # not looped, or micro-batches the rounds cannot take: refused
    with pytest.raises(ValueError, match="not placed so"):
        inter.evaluate([Stage(0, 0, 2), Stage(0, 2, 4), Stage(1, 4, 6), Stage(1, 6, 8)])
    with pytest.raises(ValueError, match="microbatches=3 is not a multiple of 2"):
        CostModel(prof, 3, "interleaved-1f1b", "never").evaluate(stages)


def test_interleaved_charges_every_boundary_as_a_transfer() -> None:
    """With a finite link, the 3 boundaries of 4 looped stages are 3 transfers on the trip, and the link
    between the two devices carries all of them per micro-batch (against one for 1F1B's 2 stages)."""
    prof = _profile(bandwidth=1e5)
    inter = CostModel(prof, 4, "interleaved-1f1b", "never")
    ev = inter.evaluate([Stage(0, 0, 2), Stage(1, 2, 4), Stage(0, 4, 6), Stage(1, 6, 8)])
    c = 2 * 2 * 4.0 / 1e5  # forward and backward of 2 samples x 4 bytes
    assert ev.links[1:] == pytest.approx((c, c, c))
    assert ev.bottleneck >= 3 * c - 1e-12


def test_looped_placement_and_the_search_choice() -> None:
    prof = _profile()
    cm = CostModel(prof, 4, "1f1b", "never")
    base = cm.evaluate([Stage(0, 0, 4), Stage(1, 4, 8)])
    stages = looped(cm, base)
    assert stages == [Stage(0, 0, 2), Stage(1, 2, 4), Stage(0, 4, 6), Stage(1, 6, 8)]
    assert positions(cm.names, stages) == 2 and positions(cm.names, [Stage(0, 0, 4), Stage(0, 4, 8)]) == 1
    # asked for: the looped plan; auto: chosen because it is predicted faster here (free links, equal devices)
    plan = search(prof, microbatches=4, schedule="interleaved-1f1b", recompute="never")
    assert plan.schedule == "interleaved-1f1b" and [s.device for s in plan.stages] == ["cuda:0", "cuda:1"] * 2
    auto = search(prof, microbatches=4, schedule="auto", recompute="never")
    assert auto.schedule == "interleaved-1f1b" and auto.predicted_step_time == pytest.approx(
        plan.predicted_step_time
    )
    # a slow link makes the extra transfers cost more than the bubble saves: auto keeps one stage per device
    slow = search(
        _profile(bandwidth=2.3e4), microbatches=4, schedule="auto", recompute="never"
    )  # c = 0.70 ms
    assert slow.schedule != "interleaved-1f1b" and len(slow.stages) == 2
    # micro-batches that are not rounds of the devices: asked for, it says why it runs as 1F1B
    odd = search(prof, microbatches=3, schedule="interleaved-1f1b", recompute="never")
    assert len(odd.stages) == 2 and any("runs as 1F1B here: microbatches=3" in n for n in odd.notes)

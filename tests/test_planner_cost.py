"""The cost model's formulas, checked by hand on tiny profiles (no model, no devices)."""

from __future__ import annotations

import math

import pytest
from planner_synth import device, layer

from torchspan.planner.cost import CostModel
from torchspan.planner.physical import link_bandwidth, physical_names
from torchspan.planner.plans import Plan, StagePlan
from torchspan.planner.stages import Stage
from torchspan.profiler.costs import Profile


def two_layer_profile(batch: int = 8) -> Profile:
    gpu = device("cuda", "gpu", 10**6, bandwidth=1e6, index=0)
    cpu = device("cpu", "cpu", 10**7)
    layers = [
        layer("a", params=100, act=10.0, out=4.0, speeds=[1.0, 0.1], fixed=0.0),
        layer("b", params=300, act=20.0, out=2.0, speeds=[1.0, 0.1], fixed=0.0),
    ]
    return Profile(layers=layers, devices=[gpu, cpu], batch_size=batch, input_bytes=5.0, optimizer="adam")


def test_step_time_formula_by_hand() -> None:
    prof = two_layer_profile()
    cm = CostModel(prof, microbatches=4, schedule="1f1b", recompute="never")
    ev = cm.evaluate([Stage(0, 0, 1), Stage(1, 1, 2)])
    b = 2  # 8 samples / 4 micro-batches
    f0, bw0 = b * 1e-4, b * 2e-4  # gpu, speed 1
    f1, bw1 = b * 1e-3, b * 2e-3  # cpu, speed 0.1
    c_in = b * 5.0 / 1e6  # host -> gpu
    c_01 = 2 * b * 4.0 / 1e6  # gpu -> cpu at the gpu's host bandwidth, forward + backward
    latency = f0 + bw0 + f1 + bw1 + c_in + c_01
    bottleneck = max(f0 + bw0, f1 + bw1, c_in, c_01)
    assert ev.latency_sum == pytest.approx(latency)
    assert ev.bottleneck == pytest.approx(bottleneck)
    assert ev.step_time == pytest.approx(latency + 3 * bottleneck)
    assert ev.links == pytest.approx((c_in, c_01))


def test_recompute_modes_trade_memory_for_time() -> None:
    prof = two_layer_profile()
    stages = [Stage(0, 0, 2)]
    never = CostModel(prof, 4, "gpipe", "never").evaluate(stages)
    last = CostModel(prof, 4, "gpipe", "except_last").evaluate(stages)
    always = CostModel(prof, 4, "gpipe", "always").evaluate(stages)
    f = 2 * 2e-4  # forward of both layers per micro-batch of 2
    assert last.latency_sum == pytest.approx(never.latency_sum)
    assert last.bottleneck == pytest.approx(never.bottleneck + f)
    assert always.latency_sum == pytest.approx(never.latency_sum + f)
    b, inp = 2, 5.0
    A = 30.0 + 2.0  # both layers' saved bytes plus the loss's saved input (the last layer's output)
    assert never.memory[0].activations == math.ceil(4 * b * A)
    assert last.memory[0].activations == math.ceil(3 * b * inp + b * A)
    assert always.memory[0].activations == math.ceil(4 * b * inp + b * A)


def test_memory_by_kind_and_in_flight_per_schedule() -> None:
    prof = two_layer_profile()
    stages = [Stage(0, 0, 1), Stage(1, 1, 2)]
    gpipe = CostModel(prof, 4, "gpipe", "never").evaluate(stages)
    ofob = CostModel(prof, 4, "1f1b", "never").evaluate(stages)
    m = gpipe.memory[0]
    assert (m.params, m.grads, m.optimizer, m.buffers) == (100, 100, 200, 0)
    assert m.workspace == math.ceil(2 * 5.0 + 2 * 2 * 4.0)  # input + largest output and its gradient
    assert gpipe.memory[0].activations == 4 * 2 * 10  # all 4 micro-batches in flight
    assert ofob.memory[0].activations == 2 * 2 * 10  # first of 2 stages: 2 in flight
    loss = 2 * 2.0  # the last stage also holds the loss's saved input: one model output per micro-batch
    assert ofob.memory[1].activations == 1 * (2 * 20 + loss)  # last stage: 1 in flight
    assert gpipe.memory[1].activations == 4 * (2 * 20 + loss)


def test_fits_compares_each_stage_with_its_device_budget() -> None:
    prof = two_layer_profile()
    prof.devices[0].budget = 500
    cm = CostModel(prof, 1, "gpipe", "never")
    assert not cm.evaluate([Stage(0, 0, 2)]).fits  # 1600 bytes of state alone
    assert cm.evaluate([Stage(1, 0, 2)]).fits


def test_link_bandwidth_rules() -> None:
    fast = device("cuda", "fast", None, bandwidth=32e9, index=0)
    slow = device("cuda", "slow", None, bandwidth=8e9, index=1)
    cpu = device("cpu", "cpu", None)
    devs = [fast, slow, cpu, cpu]
    assert link_bandwidth(devs, 0, 1) == 8e9  # through the host, at the slower link
    assert link_bandwidth(devs, 0, 2) == 32e9  # the CPU is the host
    assert link_bandwidth(devs, 2, 3) == math.inf  # the same device listed twice


@pytest.mark.parametrize(
    "stages, needle",
    [
        ([Stage(0, 0, 1)], "contiguously"),
        ([Stage(0, 0, 1), Stage(5, 1, 2)], "outside"),
        ([Stage(0, 1, 2)], "contiguously"),
    ],
)
def test_evaluate_rejects_bad_placements(stages: list[Stage], needle: str) -> None:
    cm = CostModel(two_layer_profile(), 1, "gpipe", "never")
    with pytest.raises(ValueError, match=needle):
        cm.evaluate(stages)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(microbatches=0, schedule="gpipe", recompute="never"), "microbatches=0"),
        (dict(microbatches=9, schedule="gpipe", recompute="never"), "batch size 8"),
        (dict(microbatches=1, schedule="zigzag", recompute="never"), "schedule='zigzag'"),
        (dict(microbatches=1, schedule="gpipe", recompute="sometimes"), "recompute='sometimes'"),
    ],
)
def test_cost_model_rejects_bad_settings(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        CostModel(two_layer_profile(), **kwargs)


def test_missing_device_times_are_named() -> None:
    prof = two_layer_profile()
    prof.layers[1].forward_fixed = [0.0]
    with pytest.raises(ValueError, match="'b' has 1 forward_fixed entries for 2 devices"):
        CostModel(prof, 1, "gpipe", "never")


def test_uneven_microbatches_use_the_largest_chunk() -> None:
    prof = two_layer_profile(batch=7)
    cm = CostModel(prof, 2, "gpipe", "never")
    assert cm.b == 4


def test_a_stage_starting_mid_model_holds_its_copy_of_shared_saved_tensors() -> None:
    prof = two_layer_profile()
    prof.layers[1].shared_activation_bytes = 3.0  # per sample, also saved by layer 'a'
    prof.layers[1].activation_fixed_bytes = 7.0  # per call
    cm = CostModel(prof, 4, "gpipe", "never")
    split = cm.evaluate([Stage(0, 0, 1), Stage(1, 1, 2)])
    whole = cm.evaluate([Stage(0, 0, 2)])
    b, loss = 2, 2 * 2.0  # loss: its saved input, one model output per micro-batch
    assert split.memory[1].activations == 4 * (7.0 + b * 20.0 + b * 3.0 + loss)
    assert whole.memory[0].activations == 4 * (b * 10.0 + 7.0 + b * 20.0 + loss)  # shared bytes counted once


# ---------------------------------------------------------------- one physical device listed twice


def shared_profile(cpu_budget: int | None = None, batch: int = 8) -> Profile:
    """'cpu' listed twice (two entries, one CPU; the second entry slower on paper): three layers."""
    layers = [
        layer("a", params=100, act=10.0, out=4.0, speeds=[1.0, 0.5], fixed=1e-5),
        layer("b", params=300, act=20.0, out=2.0, speeds=[0.5, 0.25], fixed=2e-5),
        layer("c", params=200, act=5.0, out=1.0, speeds=[2.0, 1.0], fixed=0.0),
    ]
    devs = [device("cpu", "cpu", cpu_budget), device("cpu", "cpu", cpu_budget)]
    return Profile(layers=layers, devices=devs, batch_size=batch, input_bytes=5.0, optimizer="adam")


@pytest.mark.parametrize("recompute", ["never", "except_last", "always"])
def test_stages_sharing_a_device_run_one_after_another(recompute: str) -> None:
    prof = shared_profile()
    M = 4
    cm = CostModel(prof, M, "1f1b", recompute)
    split = cm.evaluate([Stage(0, 0, 1), Stage(1, 1, 3)])
    whole = cm.evaluate([Stage(0, 0, 3)])
    b = 2
    # the first entry's times for both entries: one CPU, one speed
    f = sum(lay.forward_seconds(0, b) for lay in prof.layers)
    bw = sum(lay.backward_seconds(0, b) for lay in prof.layers)
    serial = {"never": M * (f + bw), "except_last": M * (f + bw) + (M - 1) * f, "always": M * (2 * f + bw)}[
        recompute
    ]
    assert split.step_time == pytest.approx(serial, rel=1e-12)
    assert whole.step_time == pytest.approx(serial, rel=1e-12)
    assert split.devices == ("cpu",) and split.device_busy[0] == pytest.approx(split.bottleneck)
    assert split.links == (0.0, 0.0)  # the CPU is the host; the hand-over is in place


def test_stages_sharing_a_device_share_its_budget() -> None:
    prof = shared_profile()
    cm = CostModel(prof, 4, "1f1b", "never")
    split = cm.evaluate([Stage(0, 0, 1), Stage(1, 1, 3)])
    whole = cm.evaluate([Stage(0, 0, 3)])
    total = sum(m.total for m in split.memory)
    assert split.device_memory == (total,)
    assert whole.memory[0].total < total  # one stage holds less: one workspace, fewer micro-batches in flight
    largest = max(m.total for m in split.memory)
    prof.devices[0].budget = prof.devices[1].budget = (largest + total) // 2  # each stage alone would fit
    cm = CostModel(prof, 4, "1f1b", "never")
    ev = cm.evaluate([Stage(0, 0, 1), Stage(1, 1, 3)])
    assert not ev.fits and ev.over_budget() == [("cpu", total, (largest + total) // 2)]
    prof.devices[1].budget = 10**9  # two budgets for one device: the smaller one holds
    assert CostModel(prof, 4, "1f1b", "never").capacity == [(largest + total) // 2] * 2


def test_a_device_visited_twice_adds_both_stages_to_its_busy_time() -> None:
    gpu = device("cuda", "gpu", None, bandwidth=1e6, index=0)
    cpu = device("cpu", "cpu", None)
    layers = [layer(k, params=0, act=1.0, out=1.0, speeds=[1.0, 0.1, 0.5], fixed=0.0) for k in "abc"]
    prof = Profile(layers=layers, devices=[cpu, gpu, cpu], batch_size=8, input_bytes=1.0, optimizer="sgd")
    M, b = 8, 1
    cm = CostModel(prof, M, "1f1b", "never")
    ev = cm.evaluate([Stage(0, 0, 1), Stage(1, 1, 2), Stage(2, 2, 3)])
    cpu_layer = b * 1e-4 + b * 2e-4  # speed 1.0 entry: the first 'cpu' entry's times
    gpu_layer = (b * 1e-4 + b * 2e-4) / 0.1
    link = 2 * b * 1.0 / 1e6
    assert ev.devices == ("cpu", "cuda:0")
    assert ev.device_busy == pytest.approx((2 * cpu_layer, gpu_layer))
    assert ev.bottleneck == pytest.approx(max(2 * cpu_layer, gpu_layer, link))
    assert ev.step_time == pytest.approx(2 * cpu_layer + gpu_layer + 2 * link + (M - 1) * ev.bottleneck)
    # the same placement naming entry 0 twice is the same prediction
    again = cm.evaluate([Stage(0, 0, 1), Stage(1, 1, 2), Stage(0, 2, 3)])
    assert again.step_time == ev.step_time and again.device_memory == ev.device_memory


def test_stages_for_maps_a_hand_made_plan() -> None:
    prof = shared_profile()
    cm = CostModel(prof, 2, "gpipe", "never")
    ev = cm.evaluate([Stage(0, 0, 2), Stage(1, 2, 3)])
    plan = cm.to_plan(ev, "hand")
    assert plan.peak_memory == {"cpu": sum(m.total for m in ev.memory)}
    again = cm.evaluate(cm.stages_for(plan))
    assert again.step_time == ev.step_time and again.device_memory == ev.device_memory
    hand = Plan([StagePlan("cpu", ["a"]), StagePlan("cpu", ["b"]), StagePlan("cpu", ["c"])], microbatches=2)
    three = cm.evaluate(cm.stages_for(hand))
    assert len(three.stages) == 3 and three.step_time == pytest.approx(ev.step_time)
    with pytest.raises(ValueError, match="'cuda:3', which is not among"):
        cm.stages_for(Plan([StagePlan("cuda:3", ["a", "b", "c"])]))
    with pytest.raises(ValueError, match="profile the same model"):
        cm.stages_for(Plan([StagePlan("cpu", ["a", "c", "b"])]))


def test_physical_names() -> None:
    cpu = device("cpu", "cpu", None)
    found = device("cuda", "gpu", None, index=0, present=True)
    described = device("cuda", "gpu", None, index=0)
    assert physical_names([cpu, cpu, found, found]) == ["cpu", "cpu", "cuda:0", "cuda:0"]
    assert physical_names([described, described]) == [
        "cuda:0",
        "cuda:0#1",
    ]  # two described GPUs are two devices


def test_gradient_accumulation_is_paid_by_every_micro_batch_after_the_first() -> None:
    prof = two_layer_profile()
    prof.devices[0].extra = {"memory_bandwidth": 2e9, "memory_efficiency": 0.5}  # 1e9 bytes/s effective
    stages = [Stage(0, 0, 2)]
    plain = CostModel(two_layer_profile(), 4, "1f1b", "never").evaluate(
        stages
    )  # no bandwidth figure: no term
    ev = CostModel(prof, 4, "1f1b", "never").evaluate(stages)
    g = 3 * (100 + 300) / 1e9  # read both gradients, write one, for both layers' 400 gradient bytes
    assert ev.latency_sum == pytest.approx(plain.latency_sum)  # the first micro-batch sets .grad
    assert ev.bottleneck == pytest.approx(plain.bottleneck + g)
    assert ev.step_time == pytest.approx(plain.step_time + 3 * g)
    one = CostModel(prof, 1, "1f1b", "never").evaluate(stages)
    assert one.step_time == pytest.approx(
        CostModel(two_layer_profile(), 1, "1f1b", "never").evaluate(stages).step_time
    )

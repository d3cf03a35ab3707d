"""The planner's price of the merged-weights schedule, and when ``schedule="auto"`` picks it (no model, no
devices)."""

from __future__ import annotations

import random

import pytest
from planner_synth import device, layer, random_profile
from test_planner_search import _assert_search_matches_brute_force

from torchspan.planner import PlanError, search
from torchspan.planner.cost import CostModel
from torchspan.planner.plans import RECOMPUTE_MODES, Plan
from torchspan.planner.settings import settings_grid
from torchspan.planner.solver import in_flight_counts
from torchspan.planner.stages import Stage
from torchspan.profiler.costs import Profile


def gpus_profile(
    capacity: int | None, n_gpus: int = 2, layers: int = 4, membw: float | None = None, params: int = 100
) -> Profile:
    """``layers`` equal layers with large activations on ``n_gpus`` distinct described GPUs."""
    gpus = [device("cuda", "gpu", capacity, 1e10, index=i, memory_bandwidth=membw) for i in range(n_gpus)]
    lays = [layer(f"l{k}", params=params, act=1000.0, out=10.0, speeds=[1.0] * n_gpus) for k in range(layers)]
    return Profile(layers=lays, devices=gpus, batch_size=8, input_bytes=10.0, optimizer="adam")


def test_memory_is_gpipes_with_every_micro_batch_in_flight() -> None:
    prof = random_profile(random.Random(5), 6, [device("cuda", "gpu", None, 1e9, index=i) for i in range(3)])
    three = [Stage(0, 0, 2), Stage(1, 2, 4), Stage(2, 4, 6)]
    for rc in RECOMPUTE_MODES:
        mw, gp = CostModel(prof, 4, "merged-weights", rc), CostModel(prof, 4, "gpipe", rc)
        assert [mw.in_flight(i, 3) for i in range(3)] == [4, 4, 4]
        assert in_flight_counts(mw) == [4] == in_flight_counts(gp)
        assert mw.evaluate(three).memory == gp.evaluate(three).memory
        assert mw.evaluate(three).device_memory == gp.evaluate(three).device_memory
    # 1F1B keeps fewer: stage s holds min(M, S - s)
    assert CostModel(prof, 4, "1f1b", "never").evaluate(three).memory[1].activations < (
        CostModel(prof, 4, "merged-weights", "never").evaluate(three).memory[1].activations
    )


def test_priced_as_1f1b_trip_plus_one_stage_weight_pass_of_every_micro_batch() -> None:
    """No bubble credit, and the step ends in a stage's weight pass of all M micro-batches (charged to the
    last stage, no merging gain assumed): without a memory bandwidth figure (no ``G`` to save) merged-weights
    costs more than 1F1B, so the search keeps 1F1B. A single stage pays no tail (nothing waits for it)."""
    prof = random_profile(random.Random(7), 6, [device("cuda", "gpu", None, 1e9, index=i) for i in range(3)])
    three = [Stage(0, 0, 2), Stage(1, 2, 4), Stage(2, 4, 6)]
    M = 4
    for rc in RECOMPUTE_MODES:
        mw = CostModel(prof, M, "merged-weights", rc).evaluate(three)
        base = CostModel(prof, M, "1f1b", rc).evaluate(three)
        assert mw.step_time == pytest.approx(base.step_time + (M - 1) * 0.5 * base.backward[-1])
        assert mw.bottleneck == pytest.approx(base.bottleneck)
    assert search(prof, recompute="never").schedule == "1f1b"
    cpu = [device("cpu", "cpu", None), device("cpu", "cpu", None)]
    prof = random_profile(random.Random(4), 4, cpu)
    two = [Stage(0, 0, 2), Stage(1, 2, 4)]
    mw, base = (
        CostModel(prof, M, "merged-weights", "never").evaluate(two),
        CostModel(prof, M, "1f1b", "never").evaluate(two),
    )
    # one physical device (cpu, cpu): its stages' threads overlap on its cores, so the tail is charged there
    # too (the demo's char transformer on cpu, cpu measured 72 ms merged against 58 ms 1F1B)
    tail = (M - 1) * 0.5 * base.backward[-1]
    assert mw.latency_sum == pytest.approx(base.latency_sum + tail)
    assert mw.step_time == pytest.approx(base.step_time + tail - (M - 1) * (base.bottleneck - mw.bottleneck))


def test_no_per_micro_batch_gradient_accumulation() -> None:
    """Large gradients and a memory bandwidth figure: 1F1B pays ``G`` per micro-batch after the first,
    merged-weights not. One stage pays no tail (nothing waits); across two devices the last stage pays it, so
    merged-weights is faster exactly when ``G`` outweighs the weight pass (``Bw / 2`` per micro-batch)."""
    M = 4
    for params, faster in (
        (10**6, True),
        (10**4, False),
    ):  # G = 3 ms or 30 us per layer against Bw / 2 = 0.2 ms
        prof = gpus_profile(None, n_gpus=2, membw=1e9, params=params)
        mw, base = CostModel(prof, M, "merged-weights", "never"), CostModel(prof, M, "1f1b", "never")
        G = float(base.accumulate.sum(axis=1)[0])
        assert G == pytest.approx(3 * 4 * params / 1e9) and float(
            mw.accumulate.sum(axis=1)[0]
        ) == pytest.approx(G)
        one = [Stage(0, 0, 4)]
        a, b = mw.evaluate(one), base.evaluate(one)
        assert a.latency_sum == pytest.approx(b.latency_sum)
        assert a.bottleneck == pytest.approx(b.bottleneck - G)
        assert a.step_time == pytest.approx(b.step_time - (M - 1) * G)
        two = [Stage(0, 0, 2), Stage(1, 2, 4)]
        a, b = mw.evaluate(two), base.evaluate(two)
        tail = (M - 1) * 0.5 * b.backward[-1]
        assert a.latency_sum == pytest.approx(b.latency_sum + tail)
        assert a.step_time == pytest.approx(
            b.step_time - (M - 1) * G / 2 + tail
        )  # each device accumulates half
        assert (a.step_time < b.step_time) == faster
        gp = CostModel(prof, M, "gpipe", "never").evaluate(two)
        assert gp.step_time == pytest.approx(b.step_time)  # GPipe accumulates per micro-batch too
    # one micro-batch: nothing to accumulate, no tail
    assert CostModel(prof, 1, "merged-weights", "never").evaluate(two).step_time == pytest.approx(
        CostModel(prof, 1, "1f1b", "never").evaluate(two).step_time
    )


def test_auto_considers_1f1b_first_then_merged_weights() -> None:
    grid = settings_grid(4, "auto", "auto", "auto")
    assert {s for _, s, _ in grid} == {"1f1b", "merged-weights"}
    assert grid.index((4, "1f1b", "never")) < grid.index((1, "merged-weights", "never"))
    assert settings_grid(4, 2, "merged-weights", "never") == [(2, "merged-weights", "never")]


def test_auto_picks_merged_weights_with_ample_memory() -> None:
    prof = gpus_profile(None, n_gpus=2, membw=1e9, params=10**6)
    plan = search(prof)
    # the best one-stage-per-device plan is merged-weights; 'auto' returns its looped form, predicted faster
    # still
    assert (
        plan.schedule == "interleaved-1f1b" and len(plan.stages) == 4 and _looped_from(plan, "merged-weights")
    )
    fixed = search(prof, schedule="1f1b")
    assert plan.predicted_step_time is not None and fixed.predicted_step_time is not None
    assert plan.predicted_step_time < fixed.predicted_step_time


def test_auto_picks_1f1b_when_only_it_fits() -> None:
    """Merged-weights holds the whole batch's activations on every stage; 1F1B with many micro-batches holds
    few."""
    cap = 12_000
    prof = gpus_profile(cap, n_gpus=2)
    with pytest.raises(PlanError):
        search(prof, schedule="merged-weights", recompute="never")
    plan = search(prof, recompute="never")
    assert plan.schedule == "1f1b" or _looped_from(
        plan, "1f1b"
    )  # 1F1B, or its looped form when predicted faster
    assert all(v <= cap for v in plan.peak_memory.values())
    # the same layers with room for every micro-batch (and gradients to accumulate): merged-weights (looped)
    assert _looped_from(
        search(gpus_profile(None, n_gpus=2, membw=1e9, params=10**6), recompute="never"), "merged-weights"
    )


def _looped_from(plan: Plan, schedule: str) -> bool:
    """Whether ``plan`` is the interleaved form 'auto' made of the best ``schedule`` plan (its note says
    so)."""
    return plan.schedule == "interleaved-1f1b" and any(n.endswith(f"ms for {schedule}") for n in plan.notes)


@pytest.mark.parametrize("seed", range(12))
def test_search_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    devs = [
        device("cuda", "x", rng.choice([None, 20_000, 60_000]), 1e8, index=1, memory_bandwidth=1e9),
        device("cuda", "y", rng.choice([None, 20_000, 60_000]), 1e6, index=2),
        device("cpu", "cpu", rng.choice([None, 60_000]), memory_bandwidth=1e7),
    ]
    prof = random_profile(rng, rng.randint(2, 5), devs, batch=8)
    for m in (1, 2, 8):
        for rc in RECOMPUTE_MODES:
            _assert_search_matches_brute_force(CostModel(prof, m, "merged-weights", rc))

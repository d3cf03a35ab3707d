"""The search: optimal against brute force, within budgets, spills to the CPU, fast (no model needed)."""

from __future__ import annotations

import itertools
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_synth import brute_force, close, device, layer, random_profile

from torchspan.planner import PlanError, search
from torchspan.planner.cost import CostModel
from torchspan.planner.optimize import solve
from torchspan.planner.plans import RECOMPUTE_MODES, SCHEDULES
from torchspan.planner.settings import microbatch_candidates
from torchspan.planner.solver import device_groups
from torchspan.planner.stages import Stage
from torchspan.profiler.costs import Profile

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def small_profiles(draw: st.DrawFn) -> Profile:
    seed = draw(st.integers(0, 2**31))
    rng = random.Random(seed)
    n_dev = draw(st.integers(1, 3))
    devs = []
    # 'cpu' and the found 'cuda:0' listed twice are one device each (one budget, one speed)
    cpu_cap = draw(st.one_of(st.none(), st.integers(3_000, 60_000)))
    gpu0_cap = draw(st.one_of(st.none(), st.integers(3_000, 60_000)))
    gpu0_bw = draw(st.sampled_from([None, 1e6, 1e8]))
    for k in range(n_dev):
        kind = draw(st.sampled_from(["cuda", "cuda", "cpu", "found cuda:0"]))
        if kind == "found cuda:0":
            devs.append(device("cuda", "gpu0", gpu0_cap, gpu0_bw, index=0, present=True))
            continue
        cap = cpu_cap if kind == "cpu" else draw(st.one_of(st.none(), st.integers(3_000, 60_000)))
        bw = draw(st.sampled_from([None, 1e6, 1e8]))
        membw = draw(st.sampled_from([None, 1e7, 1e9]))  # gradient accumulation: 3 * grad bytes / membw
        devs.append(
            device(kind, draw(st.sampled_from(["x", "y"])), cap, bw, index=k + 1, memory_bandwidth=membw)
        )
    return random_profile(rng, draw(st.integers(1, 6)), devs, batch=draw(st.sampled_from([1, 2, 6, 8])))


def _assert_search_matches_brute_force(cm: CostModel) -> None:
    """Same answer as trying every placement: both find none, or the same step time and it fits."""
    ref = brute_force(cm)
    got, _ = solve(cm)
    assert (ref is None) == (got is None)
    if ref is not None and got is not None:
        assert close(got.step_time, ref.step_time, 1e-7), (got.stages, ref.stages)
        assert got.fits


# the schedules the solver searches; interleaved-1f1b prices looped placements, made after the search from its
# best one-stage-per-device placement (planner.interleaved, tests/test_planner_interleaved.py)
SOLVED = [s for s in SCHEDULES if s != "interleaved-1f1b"]


@SETTINGS
@given(small_profiles(), st.data())
def test_search_matches_brute_force(prof: Profile, data: st.DataObject) -> None:
    m = data.draw(st.sampled_from(microbatch_candidates(prof.batch_size)))
    cm = CostModel(prof, m, data.draw(st.sampled_from(SOLVED)), data.draw(st.sampled_from(RECOMPUTE_MODES)))
    _assert_search_matches_brute_force(cm)


@SETTINGS
@given(small_profiles())
def test_auto_settings_match_brute_force_over_every_setting(prof: Profile) -> None:
    """Skipping GPipe and 'always' under 'auto' loses nothing (they are dominated: 1F1B has GPipe's time with
    no more memory, merged-weights its memory with no more time). Zero-bubble is not dominated but 'auto' does
    not try it (settings.py: chosen only when asked for). Interleaved-1F1B prices looped placements (not the
    contiguous ones brute_force tries): 'auto' takes the best one's looped form only when predicted faster, so
    never slower."""
    best = None
    asked_only = ("zero-bubble", "interleaved-1f1b")
    for m, s, c in itertools.product(
        microbatch_candidates(prof.batch_size), [s for s in SCHEDULES if s not in asked_only], RECOMPUTE_MODES
    ):
        ev = brute_force(CostModel(prof, m, s, c))
        if ev is not None and (best is None or ev.step_time < best):
            best = ev.step_time
    if best is None:
        with pytest.raises(PlanError):
            search(prof)
        return
    plan = search(prof)
    assert plan.predicted_step_time is not None
    if plan.schedule == "interleaved-1f1b":
        assert plan.predicted_step_time < best
    else:
        assert close(plan.predicted_step_time, best, 1e-7)


@SETTINGS
@given(small_profiles())
def test_returned_plans_never_exceed_a_budget(prof: Profile) -> None:
    try:
        plan = search(prof)
    except PlanError:
        return
    capacity = {str(d.device): d.capacity for d in prof.devices}
    held: dict[str, int] = {}
    for stage in plan.stages:
        held[stage.device] = (
            held.get(stage.device, 0) + stage.total_bytes
        )  # stages sharing a device share its budget
    for dev, total in held.items():
        cap = capacity[dev]
        assert cap is None or total <= cap
        assert plan.peak_memory[dev] == total
    assert plan.layers == [x.name for x in prof.layers]


def spill_profile() -> Profile:
    """Three 4 KB layers; the GPU holds about one and a half: the rest must go to the CPU."""
    gpu = device("cuda", "gpu", 24_000, bandwidth=1e9, index=0)
    cpu = device("cpu", "cpu", 10**9)
    layers = [layer(f"l{i}", params=4000, act=10.0, out=10.0, speeds=[1.0, 0.05]) for i in range(3)]
    return Profile(layers=layers, devices=[gpu, cpu], batch_size=8, input_bytes=10.0, optimizer="adam")


def test_layers_spill_to_the_cpu_when_the_accelerator_is_full() -> None:
    plan = search(spill_profile())
    placed = {s.device: s for s in plan.stages}
    assert sorted(placed) == ["cpu", "cuda:0"]
    assert len(placed["cuda:0"].layers) == 1 and len(placed["cpu"].layers) == 2
    assert placed["cuda:0"].total_bytes <= 24_000
    assert any("CPU" in n and "budgets are full" in n for n in plan.notes)


def test_a_cpu_stage_is_chosen_when_pipelining_hides_its_time() -> None:
    # a big GPU layer and a small tail: the CPU takes the tail in parallel with the GPU
    gpu = device("cuda", "gpu", None, bandwidth=1e12, index=0)
    cpu = device("cpu", "cpu", None)
    layers = [layer(f"big{i}", 0, 1.0, 1.0, [1.0, 0.1], fixed=0.0) for i in range(8)]
    layers.append(layer("tail", 0, 1.0, 1.0, [1.0, 0.5], fixed=0.0))
    prof = Profile(layers=layers, devices=[gpu, cpu], batch_size=64, input_bytes=1.0, optimizer="sgd")
    plan = search(prof, microbatches=16)
    assert (
        plan.devices == ["cuda:0", "cpu"] and plan.layers[-1] == "tail" and plan.stages[1].layers == ["tail"]
    )
    alone = CostModel(prof, 16, plan.schedule, plan.recompute).evaluate([Stage(0, 0, 9)])
    assert plan.predicted_step_time < alone.step_time


def test_identical_devices_are_interchangeable_and_all_used_when_it_pays() -> None:
    devs = [device("cuda", "gpu", None, bandwidth=1e12, index=i) for i in range(4)]
    layers = [layer(f"l{i}", 0, 1.0, 1.0, [1.0] * 4, fixed=0.0) for i in range(12)]
    prof = Profile(layers=layers, devices=devs, batch_size=32, input_bytes=1.0, optimizer="sgd")
    plan = search(prof, microbatches=32)
    assert plan.balance == [3, 3, 3, 3]
    assert sorted(plan.devices) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_fixed_settings_are_respected() -> None:
    plan = search(spill_profile(), microbatches=2, schedule="gpipe", recompute="always")
    assert (plan.microbatches, plan.schedule, plan.recompute) == (2, "gpipe", "always")


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(microbatches=0), "microbatches=0"),
        (dict(microbatches=99), "more than the batch size 8"),
        (dict(schedule="zigzag"), "schedule='zigzag'"),
        (dict(recompute="maybe"), "recompute='maybe'"),
    ],
)
def test_bad_settings_name_the_argument(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        search(spill_profile(), **kwargs)


def test_microbatch_candidates() -> None:
    assert microbatch_candidates(12) == [1, 2, 3, 4, 6, 8, 12]
    assert microbatch_candidates(1) == [1]


def _cpu_seconds(fn) -> float:  # type: ignore[no-untyped-def]
    """Process CPU time of ``fn()``: unlike the wall clock it does not grow when other jobs share the
    cores."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def test_thousand_layers_on_eight_devices_is_fast() -> None:
    """README: "plans 1,000 layers on 8 devices in well under a second" (benchmarks/plan_quality.py's search
    speed, benchmarks/RESULTS.md). Bounds in CPU seconds, about 2.4x over what this 2-core VM measured at load
    5, so that a 3x slower search fails (checked by running each search three times); the wall-clock bound of
    10 s let it through (the wall time doubles at load 5 on 2 cores; CPU time grew ~1.35x at load 10)."""
    import torchspan
    from torchspan.profiler.costs import LayerCost

    # the README's case, plan_quality.synthetic_profile: 4 x A100, 3 x V100, CPU (3 device types), settings on
    # auto
    rng = random.Random(0)
    speeds = [1.0] * 4 + [0.6] * 3 + [0.02]
    layers = []
    for k in range(1000):
        j, params = rng.uniform(0.5, 2.0), rng.randint(0, 8 * 2**20)
        layers.append(
            LayerCost(
                name=f"l{k}",
                kind="Linear",
                param_bytes=params,
                grad_bytes=params,
                optimizer_bytes=2 * params,
                buffer_bytes=0,
                activation_bytes=rng.uniform(1e4, 1e5),
                output_bytes=rng.uniform(1e3, 5e4),
                flops=1e9,
                forward_fixed=[2e-5] * 8,
                forward_per_sample=[1e-5 * j / s for s in speeds],
                backward_fixed=[4e-5] * 8,
                backward_per_sample=[2e-5 * j / s for s in speeds],
                time_source=["synthetic"] * 8,
            )
        )
    prof = Profile(
        layers=layers,
        devices=torchspan.devices("a100-40gb*4,v100-16gb*3,cpu"),
        batch_size=64,
        input_bytes=1e4,
        optimizer="adam",
    )
    plans = []
    took = min(_cpu_seconds(lambda: plans.append(search(prof))) for _ in range(2))
    assert len(plans[0].layers) == 1000
    assert took < 0.75, (
        f"search on auto took {took:.2f} CPU s for 1,000 layers on 8 devices of 3 types (measured "
        "0.29-0.32 s; 0.31-0.45 at load 10)"
    )

    # the hardest case: every layer's speed jittered on every device (8 device types), settings fixed
    rng = random.Random(0)
    devs = [device("cuda", "a100", 40 * 2**30, 25e9, i) for i in range(4)]
    devs += [device("cuda", "v100", 16 * 2**30, 12e9, i + 4) for i in range(3)] + [
        device("cpu", "cpu", 64 * 2**30)
    ]
    speeds = [1.0] * 4 + [0.4] * 3 + [0.05]
    layers = [
        layer(
            f"l{k}",
            rng.randint(0, 2 * 10**6),
            5e4,
            rng.uniform(1e3, 5e4),
            [s * rng.uniform(0.5, 2) for s in speeds],
        )
        for k in range(1000)
    ]
    prof = Profile(layers=layers, devices=devs, batch_size=64, input_bytes=1e4, optimizer="adam")
    plans = []
    took = _cpu_seconds(
        lambda: plans.append(search(prof, microbatches=8, schedule="1f1b", recompute="never"))
    )
    assert len(plans[0].layers) == 1000
    assert took < 4.5, (
        f"search took {took:.2f} CPU s for 1,000 layers on 8 devices of 8 types (measured 1.77-1.94 s; "
        "2.2-2.6 at load 10)"
    )


# ---------------------------------------------------------------- one physical device listed twice


def twice_listed(cpu_budget: int | None) -> Profile:
    devs = [device("cpu", "cpu", cpu_budget), device("cpu", "cpu", cpu_budget)]
    layers = [layer(f"l{i}", params=1000, act=40.0, out=8.0, speeds=[1.0, 1.0], fixed=1e-5) for i in range(4)]
    return Profile(layers=layers, devices=devs, batch_size=8, input_bytes=8.0, optimizer="adam")


def test_a_device_listed_twice_is_planned_as_one_device() -> None:
    prof = twice_listed(None)
    plan = search(prof)
    assert plan.devices == ["cpu"] and plan.balance == [4]
    assert any("cpu is listed 2 times" in n and "planned as one device" in n for n in plan.notes), plan.notes
    # brute force over every placement on both entries, two-stage splits included, and every setting
    best = min(
        ev.step_time
        for m, s, c in itertools.product(microbatch_candidates(8), SCHEDULES, RECOMPUTE_MODES)
        if (ev := brute_force(CostModel(prof, m, s, c))) is not None
    )
    assert plan.predicted_step_time is not None and close(plan.predicted_step_time, best, 1e-9)


def test_splitting_over_entries_of_one_device_never_helps() -> None:
    """Every split over the two entries costs at least the one-stage plan, in time and in memory."""
    prof = twice_listed(None)
    for m, s, c in itertools.product([1, 2, 8], SCHEDULES, RECOMPUTE_MODES):
        cm = CostModel(prof, m, s, c)
        one = cm.evaluate([Stage(0, 0, 4)])
        for cut in range(1, 4):
            two = cm.evaluate([Stage(0, 0, cut), Stage(1, cut, 4)])
            assert two.step_time >= one.step_time * (1 - 1e-12)
            assert two.device_memory[0] >= one.device_memory[0]


def test_device_groups_hold_each_physical_device_once() -> None:
    found = [device("cuda", "gpu", None, 1e9, index=0, present=True) for _ in range(2)]
    other = device("cuda", "gpu", None, 1e9, index=1)
    prof = random_profile(
        random.Random(0),
        3,
        [found[0], device("cpu", "cpu", None), found[1], other, device("cpu", "cpu", None)],
    )
    cm = CostModel(prof, 1, "1f1b", "never")
    groups = device_groups(cm)
    assert sorted(d for g in groups for d in g) == [0, 1, 3]


# ---------------------------------------------------------------- all-distinct devices


@st.composite
def distinct_devices(draw: st.DrawFn) -> Profile:
    """Up to 4 devices, every one distinct: same speed but each its own budget (some binding, some
    not: those whose budgets admit the same stages are grouped), or each its own speed too."""
    rng = random.Random(draw(st.integers(0, 2**31)))
    n_dev = draw(st.integers(2, 4))
    same_speed = draw(st.booleans())
    devs = [
        device(
            "cuda",
            f"g{k}",
            draw(st.one_of(st.integers(3_000, 40_000), st.integers(10**6, 10**7))),
            1e7,
            index=k,
        )
        for k in range(n_dev)
    ]
    if draw(st.booleans()):
        devs[-1] = device("cpu", "cpu", draw(st.integers(3_000, 10**7)))
    n_layers = draw(st.integers(1, 6))
    base = [1.0 if d.kind != "cpu" else 0.1 for d in devs]
    layers = []
    for k in range(n_layers):
        speeds = base if same_speed else [s * rng.uniform(0.5, 2.0) for s in base]
        lay = layer(
            f"l{k}", rng.randint(0, 4000), rng.uniform(0, 400), rng.uniform(1, 200), speeds, fixed=1e-5
        )
        layers.append(lay)
    return Profile(layers=layers, devices=devs, batch_size=8, input_bytes=10.0, optimizer="adam")


@SETTINGS
@given(distinct_devices(), st.data())
def test_search_matches_brute_force_on_all_distinct_devices(prof: Profile, data: st.DataObject) -> None:
    m = data.draw(st.sampled_from([1, 2, 4, 8]))
    cm = CostModel(prof, m, data.draw(st.sampled_from(SOLVED)), data.draw(st.sampled_from(RECOMPUTE_MODES)))
    _assert_search_matches_brute_force(cm)


def test_budgets_that_admit_the_same_stages_make_one_type() -> None:
    """Two roomy budgets that differ are one type; a budget that binds is a type of its own."""
    devs = [device("cuda", "g", cap, 1e9, index=k) for k, cap in enumerate([10**9, 2 * 10**9, 9_000])]
    layers = [layer(f"l{i}", 1000, 10.0, 10.0, [1.0] * 3) for i in range(4)]
    prof = Profile(layers=layers, devices=devs, batch_size=8, input_bytes=10.0, optimizer="adam")
    cm = CostModel(prof, 2, "1f1b", "never")
    assert device_groups(cm) == [[0, 1], [2]]
    ref = brute_force(cm)
    got, _ = solve(cm)
    assert ref is not None and got is not None and close(got.step_time, ref.step_time, 1e-9)

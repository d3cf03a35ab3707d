"""Plan data: JSON round trip of searched plans, the text table, and the baselines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from planner_synth import device, layer

from torchspan.planner import Plan, search
from torchspan.planner.baselines import STRATEGIES, baseline, greedy_split, parameter_split, uniform_split
from torchspan.planner.cost import CostModel
from torchspan.planner.stages import Stage
from torchspan.profiler.costs import Profile


def mixed_profile() -> Profile:
    devs = [
        device("cuda", "fast", 60_000, 1e9, 0),
        device("cuda", "slow", 30_000, 1e9, 1),
        device("cpu", "cpu", 10**6),
    ]
    sizes = [500, 4000, 500, 3000, 200, 2500]
    layers = [layer(f"l{i}", p, 40.0, 10.0, [1.0 + i % 2, 0.3, 0.05]) for i, p in enumerate(sizes)]
    return Profile(layers=layers, devices=devs, batch_size=16, input_bytes=10.0, optimizer="adam")


def test_searched_plan_round_trips_through_json(tmp_path: Path) -> None:
    plan = search(mixed_profile())
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.stages[0].workspace_bytes == plan.stages[0].workspace_bytes > 0
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert json.loads(path.read_text())["format"] == "torchspan.plan/1"


def test_plans_written_before_workspace_bytes_still_load() -> None:
    data = search(mixed_profile()).to_dict()
    for s in data["stages"]:
        del s["workspace_bytes"]
    assert Plan.from_dict(data).stages[0].workspace_bytes == 0


def test_plans_written_with_the_old_checkpoint_key_still_load() -> None:
    data = search(mixed_profile()).to_dict()
    data["checkpoint"] = data.pop("recompute")
    assert Plan.from_dict(data) == Plan.from_dict(search(mixed_profile()).to_dict())
    data["recompute"] = data["checkpoint"]
    with pytest.raises(ValueError, match="both 'recompute' and its old name 'checkpoint'"):
        Plan.from_dict(data)


def _edited(change) -> dict:  # type: ignore[no-untyped-def]
    data = search(mixed_profile()).to_dict()
    change(data)
    return data


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda d: d["stages"][0].update(layers="l0l1"),
            r"layers='l0l1'\) on .* must be a list of layer names",
        ),
        (lambda d: d["stages"][0].update(device=0), r"device=0\) must be a device string"),
        (lambda d: d["stages"][0].pop("device"), "plan stage 0 lacks device"),
        (lambda d: d["stages"][0].update(colour="red"), r"plan stage 0 has unknown fields \['colour'\]"),
        (
            lambda d: d["stages"][0].update(param_bytes="1 GiB"),
            r"param_bytes='1 GiB'\) on .* must be a number",
        ),
        (lambda d: d.update(stages={"0": []}), "'stages' must be a list"),
        (lambda d: d.update(peak_memory=[1]), "'peak_memory' must be a JSON object"),
    ],
)
def test_hand_edited_json_is_rejected_at_load_with_the_field(change, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        Plan.from_json(json.dumps(_edited(change)))


def test_json_that_is_not_a_plan_object_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="plan is not valid JSON"):
        Plan.from_json("{stages: []")
    with pytest.raises(ValueError, match="a plan is a JSON object"):
        Plan.from_json("[1, 2]")


def test_str_is_a_table_with_every_stage_and_peaks() -> None:
    plan = search(mixed_profile())
    text = str(plan)
    for s in plan.stages:
        assert s.device in text
    assert "peak memory per device" in text and "predicted step" in text and "work" in text


def test_plan_figures_agree_with_the_cost_model() -> None:
    prof = mixed_profile()
    plan = search(prof)
    names = [x.name for x in prof.layers]
    index = {str(d.device): i for i, d in enumerate(prof.devices)}
    stages, pos = [], 0
    for s in plan.stages:
        assert s.layers == names[pos : pos + len(s.layers)]
        stages.append(Stage(index[s.device], pos, pos + len(s.layers)))
        pos += len(s.layers)
    ev = CostModel(prof, plan.microbatches, plan.schedule, plan.recompute).evaluate(stages)
    assert ev.step_time == pytest.approx(plan.predicted_step_time)
    assert [m.total for m in ev.memory] == [s.total_bytes for s in plan.stages]
    assert sum(plan.peak_memory.values()) == sum(s.total_bytes for s in plan.stages)


def test_split_rules() -> None:
    assert [(s.device, s.start, s.end) for s in uniform_split(7, [0, 1, 2])] == [
        (0, 0, 3),
        (1, 3, 5),
        (2, 5, 7),
    ]
    assert [(s.start, s.end) for s in parameter_split([1, 1, 1, 9, 1, 1], [0, 1])] == [(0, 3), (3, 6)]
    assert [(s.start, s.end) for s in parameter_split([5, 5], [0, 1, 2])] == [(0, 1), (1, 2)]
    assert [(s.device, s.start, s.end) for s in greedy_split([4, 4, 4, 4], [8, 4, 100], [0, 1, 2])] == [
        (0, 0, 2),
        (1, 2, 3),
        (2, 3, 4),
    ]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_baselines_are_scored_by_the_same_model_and_never_beat_the_search(strategy: str) -> None:
    prof = mixed_profile()
    best = search(prof)
    plan, ev = baseline(prof, strategy)
    assert plan.strategy == strategy and plan.predicted_step_time == ev.step_time
    if ev.fits:
        assert best.predicted_step_time <= ev.step_time * (1 + 1e-9)
    else:
        assert any(n.startswith("does not fit") for n in plan.notes)


def test_greedy_fill_counts_only_parameters_so_it_can_overflow() -> None:
    """accelerate's rule ignores gradients, optimizer state and activations: the cost model says OOM."""
    prof = mixed_profile()
    prof.devices[0].budget = 30_000  # holds every parameter (10,700 bytes) but not grads + Adam state
    plan, ev = baseline(prof, "greedy")
    assert plan.balance == [6] and not ev.fits
    assert search(prof).predicted_step_time is not None  # the planner finds a placement that fits


def test_unknown_strategy_is_named() -> None:
    with pytest.raises(ValueError, match="strategy='best'"):
        baseline(mixed_profile(), "best")


def test_save_is_atomic_and_leaves_an_ordinary_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os
    import stat

    from torchspan.planner.plans import Plan as _Plan
    from torchspan.planner.plans import StagePlan as _StagePlan

    plan = _Plan([_StagePlan("cpu", ["a"])])
    target = tmp_path / "plan.json"
    plan.save(target)
    mode = stat.S_IMODE(os.stat(target).st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary file left behind
    assert _Plan.load(target) == plan


def test_compare_reports_every_memory_kind_from_its_stage_plan_field() -> None:
    """One MEMORY_KINDS (profiler.costs) drives the comparison; each kind maps to a real StagePlan field."""
    import dataclasses

    from torchspan.planner.measured import PLAN_FIELDS, compare
    from torchspan.planner.plans import StagePlan
    from torchspan.profiler.costs import MEMORY_KINDS

    assert tuple(PLAN_FIELDS) == MEMORY_KINDS
    assert set(PLAN_FIELDS.values()) <= {f.name for f in dataclasses.fields(StagePlan)}
    stage = StagePlan(
        "cpu", ["a"], param_bytes=10, grad_bytes=20, optimizer_bytes=30, activation_bytes=40, buffer_bytes=50
    )
    plan = Plan(stages=[stage], microbatches=1, schedule="1f1b", predicted_step_time=0.5)
    measured = {"device": "cpu", "params": 10, "grads": 20, "optimizer": 60, "activations": 20, "buffers": 50}
    result = compare(plan, [measured], [0.9, 1.0])
    row = result["stages"][0]
    assert [k for k in row if k in MEMORY_KINDS] == list(MEMORY_KINDS)
    assert (
        row["optimizer"]["ratio"] == 2.0
        and row["activations"]["ratio"] == 0.5
        and row["buffers"]["ratio"] == 1.0
    )
    assert row["total"] == {"predicted": 150, "measured": 160, "ratio": 160 / 150}
    assert result["step_time"]["ratio"] == 2.0

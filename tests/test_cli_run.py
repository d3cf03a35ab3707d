"""``torchspan run TARGET --input-shape ...``: training with span, predicted vs measured, files, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from torchspan.cli import main
from torchspan.planner import Plan, StagePlan
from torchspan.planner.measured import compare, ratio, typical_step_time

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

FACTORY = """
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))

def tokens():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 100))

def broken():
    raise RuntimeError("weights file not found")
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("run") / "models.py"
    path.write_text(FACTORY)
    return str(path)


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["run", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def layer_bytes(layers: list[str]) -> int:
    """Parameter bytes of ``build()``'s layers, counted here independently of torchspan."""
    sizes = {"0": 32 * 64 + 64, "2": 64 * 64 + 64, "4": 64 * 8 + 8}
    return 4 * sum(sizes.get(name, 0) for name in layers)


# --------------------------------------------------------------------------- runs


def test_run_on_two_cpu_entries_prints_predicted_vs_measured(
    models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", f"{models}:build", "--input-shape", "16,32", "--devices", "cpu,cpu", "--steps", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "predicted vs measured" in out and "3/3" in out
    for row in ("step time", "optimizer step", "params", "grads", "optimizer", "activations", "total"):
        assert row in out, row
    assert "samples/s" in out and "loss " in out


def test_spread_json_and_out_files(models: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "out"
    argv = [
        f"{models}:build",
        "--input-shape",
        "16,32",
        "--devices",
        "cpu,cpu",
        "--spread",
        "--steps",
        "3",
        "--out",
        str(out_dir),
    ]
    result = run_json(argv, capsys)
    assert len(result["stages"]) == 2 and result["plan"]["microbatches"] >= 2
    step = result["step_time"]
    assert (
        step["measured"] > 0
        and step["predicted"] > 0
        and step["ratio"] == pytest.approx(step["measured"] / step["predicted"])
    )
    assert step["steps_measured"] == 2
    assert len(result["losses"]) == 3 and all(math.isfinite(v) for v in result["losses"])
    assert result["samples_per_second"] > 0 and result["optimizer_step_time"] > 0
    for st in result["stages"]:
        expected = layer_bytes(st["layers"])
        assert st["params"]["measured"] == st["grads"]["measured"] == expected
        assert st["params"]["predicted"] == expected and st["params"]["ratio"] == 1.0
        assert st["optimizer"]["measured"] >= 2 * expected  # Adam: exp_avg and exp_avg_sq per parameter
        assert st["activations"]["measured"] > 0 and st["activations"]["predicted"] > 0
        kinds = ("params", "grads", "optimizer", "activations", "buffers")
        assert st["total"]["measured"] == sum(st[k]["measured"] for k in kinds)
    for name in ("timeline.png", "memory.png", "loss.png"):
        assert (out_dir / name).read_bytes()[:8] == PNG_MAGIC, name
    saved = Plan.load(out_dir / "plan.json")
    assert saved == Plan.from_dict(result["plan"])
    on_disk = json.loads((out_dir / "run.json").read_text())
    assert on_disk["losses"] == result["losses"] and on_disk["files"]["plan"] == str(out_dir / "plan.json")

    # the saved two-stage plan runs again as is
    again = run_json(
        [f"{models}:build", "--input-shape", "16,32", "--plan", str(out_dir / "plan.json"), "--steps", "2"],
        capsys,
    )
    assert [s["layers"] for s in again["stages"]] == [s.layers for s in saved.stages]
    assert again["plan"] == result["plan"]


def test_run_a_plan_written_by_torchspan_plan(
    models: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_file = tmp_path / "plan.json"
    argv = [
        "plan",
        f"{models}:build",
        "--input-shape",
        "16,32",
        "--devices",
        "cpu",
        "--microbatches",
        "2",
        "--schedule",
        "gpipe",
    ]
    assert main([*argv, "--out", str(plan_file)]) == 0
    capsys.readouterr()
    result = run_json(
        [
            f"{models}:build",
            "--input-shape",
            "16,32",
            "--plan",
            str(plan_file),
            "--steps",
            "3",
            "--optimizer",
            "sgd",
        ],
        capsys,
    )
    assert (result["plan"]["microbatches"], result["plan"]["schedule"]) == (2, "gpipe")
    assert result["plan"] == Plan.load(plan_file).to_dict()
    (stage,) = result["stages"]
    assert stage["optimizer"]["measured"] == 0  # plain SGD keeps no state
    assert result["step_time"]["measured"] > 0 and result["step_time"]["predicted"] > 0
    assert result["losses"][-1] < result["losses"][0]  # the same batch every step: the loss falls


def test_token_ids_and_cross_entropy_over_the_last_dim(
    models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        f"{models}:tokens",
        "--input-shape",
        "4,12",
        "--dtype",
        "int64",
        "--vocab",
        "100",
        "--loss",
        "ce",
        "--devices",
        "cpu",
    ]
    result = run_json([*argv, "--steps", "3", "--lr", "1e-2"], capsys)
    # random classes over 100 outputs: a fresh model's loss is about ln(100)
    assert abs(result["losses"][0] - math.log(100)) < 1.0
    assert result["losses"][-1] < result["losses"][0]


# --------------------------------------------------------------------------- errors


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["run", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "Traceback" not in captured.err + captured.out
    assert err.startswith("torchspan run: error: ") and "\n" not in err, err
    return err


def test_bad_targets_exit_2_with_one_line(
    models: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _error([str(tmp_path / "nope.py") + ":build", "--input-shape", "16,32"], capsys)
    assert "does not exist" in err
    err = _error([f"{models}:missing", "--input-shape", "16,32"], capsys)
    assert "has no attribute 'missing'" in err
    err = _error([f"{models}:broken", "--input-shape", "16,32"], capsys)
    assert "RuntimeError: weights file not found" in err
    err = _error([f"{models}:build", "--input-shape", "16,31", "--devices", "cpu"], capsys)
    assert "16,31" in err and "--input-shape" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without cuda:0")
def test_plan_for_absent_devices(models: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_file = tmp_path / "a100.json"
    assert (
        main(
            [
                "plan",
                f"{models}:build",
                "--input-shape",
                "16,32",
                "--devices",
                "a100-40gb",
                "--out",
                str(plan_file),
            ]
        )
        == 0
    )
    capsys.readouterr()
    err = _error([f"{models}:build", "--input-shape", "16,32", "--plan", str(plan_file)], capsys)
    assert "cuda:0" in err and "A100" in err and "does not have" in err
    assert f"torchspan plan {models}:build --input-shape 16,32 --devices auto --out {plan_file}" in err


def test_plan_for_another_model_and_conflicting_options(
    models: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_file = tmp_path / "plan.json"
    Plan(stages=[StagePlan("cpu", ["0", "1", "2"]), StagePlan("cpu", ["3", "4"])], microbatches=2).save(
        plan_file
    )
    err = _error(
        [f"{models}:tokens", "--input-shape", "4,12", "--dtype", "int64", "--plan", str(plan_file)], capsys
    )
    assert "made for another model" in err and "'2'" not in err and "2, 3, 4" in err
    assert f"torchspan plan {models}:tokens --input-shape 4,12 --dtype int64 --out {plan_file}" in err
    err = _error(
        [f"{models}:build", "--input-shape", "16,32", "--plan", str(plan_file), "--devices", "cpu"], capsys
    )
    assert "drop --devices" in err
    err = _error([f"{models}:build", "--input-shape", "1,32", "--plan", str(plan_file)], capsys)
    assert "2 micro-batches" in err
    err = _error([f"{models}:build", "--input-shape", "16,32", "--out", str(plan_file)], capsys)
    assert "is a file" in err
    plan_file.write_text("not json")
    err = _error([f"{models}:build", "--input-shape", "16,32", "--plan", str(plan_file)], capsys)
    assert "is not a torchspan plan" in err


# --------------------------------------------------------------------------- figures


def test_compare_ratios_and_step_time() -> None:
    assert typical_step_time([9.0, 1.0, 3.0, 2.0]) == 2.0  # the first step is left out
    assert typical_step_time([5.0]) == 5.0
    assert ratio(3.0, 2.0) == 1.5 and ratio(3.0, 0) is None and ratio(None, 2.0) is None
    plan = Plan(
        stages=[StagePlan("cpu", ["a"], param_bytes=100, activation_bytes=50, workspace_bytes=7)],
        predicted_step_time=0.5,
    )
    memory = [
        {
            "stage": 0,
            "device": "cpu",
            "params": 100,
            "grads": 100,
            "optimizer": 0,
            "activations": 75,
            "buffers": 0,
        }
    ]
    result = compare(plan, memory, [2.0, 1.0, 1.0])
    assert result["step_time"] == {"predicted": 0.5, "measured": 1.0, "ratio": 2.0, "steps_measured": 2}
    (st,) = result["stages"]
    assert st["activations"] == {"predicted": 50, "measured": 75, "ratio": 1.5}
    assert st["grads"]["ratio"] is None and st["total"] == {
        "predicted": 150,
        "measured": 275,
        "ratio": 275 / 150,
    }
    assert st["workspace_predicted"] == 7
    with pytest.raises(ValueError, match="memory has 2 stage"):
        compare(plan, memory * 2, [1.0])
    with pytest.raises(ValueError, match="times is empty"):
        typical_step_time([])


def test_out_budgets_use_the_device_names_of_the_plan(
    models: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # regression: --memory CPU=... was passed to memory.png under the raw key 'CPU', so no budget line was
    # drawn
    from torchspan.commands import run as run_command

    seen: dict[str, int] = {}
    real = run_command._write_outputs

    def spy(out, plan, spanned, memory, losses, budgets, result):  # type: ignore[no-untyped-def]
        seen.update(budgets)
        return real(out, plan, spanned, memory, losses, budgets, result)

    monkeypatch.setattr(run_command, "_write_outputs", spy)
    argv = [
        f"{models}:build",
        "--input-shape",
        "16,32",
        "--devices",
        "cpu",
        "--memory",
        "CPU=1GiB",
        "--steps",
        "1",
        "--out",
        str(tmp_path / "o"),
    ]
    run_json(argv, capsys)
    assert seen == {"cpu": 2**30}


def test_fp16_weights_under_adam_get_the_real_cause_and_precision_trains(
    models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # issue 10: "lower --lr" was wrong advice; fp16 parameters with Adam are NaN at any learning rate
    argv = ["run", f"{models}:build", "--input-shape", "16,32", "--devices", "cpu", "--steps", "3"]
    assert main([*argv, "--dtype", "float16", "--lr", "1e-6"]) == 2
    err = capsys.readouterr().err
    assert (
        "the loss became nan" in err
        and "--precision fp16" in err
        and "--optimizer sgd" in err
        and "lower --lr" not in err
    )
    # what the advice says works: fp32 master weights with autocast, through the fp16 gradient scaler
    result = run_json([*argv[1:], "--precision", "fp16"], capsys)
    assert result["precision"] == "fp16" and all(math.isfinite(v) for v in result["losses"])

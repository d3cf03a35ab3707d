"""``torchspan demo --json``: the report's figures and the files written, live output on stderr."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

import torchspan.demo.run as demo_run
from torchspan.cli import main

SMALL = dict(batch_size=8, seq_len=16, dim=32, depth=2, heads=2, sample_chars=20, lr=1e-2)


def test_demo_json_gives_the_figures_and_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        demo_run, "run_demo", functools.partial(demo_run.run_demo, config=demo_run.DemoConfig(**SMALL))
    )
    out_dir = tmp_path / "demo"
    assert main(["demo", "--devices", "cpu,cpu", "--steps", "2", "--out", str(out_dir), "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)  # nothing but the JSON on stdout
    assert (
        result["strategy"] == "pipeline"
        and result["out"] == str(out_dir)
        and result["devices"] == ["cpu", "cpu"]
    )
    assert result["loss"]["steps"] == 2 and len(result["losses"]) == 2 and result["tokens_per_second"] > 0
    assert len(result["plan"]["stages"]) == 2 and result["sample"].startswith("def ")
    assert set(result["files"]) >= {"plan", "report", "losses"} and all(
        Path(p).exists() for p in result["files"].values()
    )
    assert "loss" in captured.err  # the live output went to stderr


def test_demo_json_says_what_ran_why_and_the_gradient_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # issue 19: the default demo on a machine without a GPU ran one stage and said nothing about it
    monkeypatch.setattr(
        demo_run, "run_demo", functools.partial(demo_run.run_demo, config=demo_run.DemoConfig(**SMALL))
    )
    assert main(["demo", "--steps", "2", "--out", str(tmp_path / "demo"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    check = result["gradient_check"]
    assert (
        check["ok"] is True
        and check["max_abs"] < 1e-5
        and check["max_rel"] < 1e-3
        and check["parameters"] > 0
    )
    assert result["one_device"]["steps"] == 2 and len(result["one_device"]["losses"]) == 2
    assert (
        len(result["plan"]["stages"]) >= 2
        and result["why"]
        and "torchspan demo --nproc-per-node 2" in result["next"]
    )
    if result["found_devices"] == [
        "cpu"
    ]:  # no GPU: two CPU stages, the planner's own one-stage choice, a GPU machine's plan
        assert result["devices"] == ["cpu", "cpu"] and len(result["planner_choice"]["stages"]) == 1
        assert "cuda:0" in result["gpu_machine"]


def test_demo_nproc_per_node_refuses_pipeline_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--nproc-per-node", "1", "--out", str(tmp_path / "d")]) == 2
    assert "--nproc-per-node 1 must be >= 2" in capsys.readouterr().err
    assert main(["demo", "--nproc", "2", "--schedule", "1f1b", "--out", str(tmp_path / "d")]) == 2
    assert "--schedule do not apply" in capsys.readouterr().err

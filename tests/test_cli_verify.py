"""``torchspan verify``: PASS for a correct run, FAIL (exit 1) when gradients differ, usage errors."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from torchspan.cli import main

MODELS = textwrap.dedent(
    """
    import torch
    from torch import nn

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    class Drift(nn.Module):
        # a buggy model: its forward depends on how many samples it sees, so micro-batching changes gradients
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 2)

        def forward(self, x):
            h = self.a(x)
            return self.b(h - h.mean(0, keepdim=True))

    def drift():
        torch.manual_seed(0)
        return Drift()

    def dropped():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 4), nn.Dropout(0.1))
    """
)


@pytest.fixture()
def models(tmp_path: Path) -> str:
    path = tmp_path / "models.py"
    path.write_text(MODELS)
    return str(path)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_verify_passes(models: str, schedule: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "verify",
            f"{models}:mlp",
            "--input-shape",
            "10,8",
            "--devices",
            "cpu,cpu",
            "--balance",
            "2,3",
            "--microbatches",
            "3",
            "--schedule",
            schedule,
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "mode=sequential" in out and "PASS" in out and "max abs diff" in out


def test_verify_fails_when_gradients_differ(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", f"{models}:drift", "--input-shape", "8,8", "--microbatches", "4"])
    out = capsys.readouterr().out
    assert code == 1 and "FAIL" in out and "DIFFERENT" in out


def test_verify_usage_errors(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", f"{models}:mlp", "--input-shape", "ten,8"]) == 2
    assert "--input-shape 'ten,8'" in capsys.readouterr().err
    assert main(["verify", f"{models}:mlp", "--input-shape", "8,8", "--balance", "1,1"]) == 2
    assert "balance=[1, 1]" in capsys.readouterr().err


def test_verify_json_gives_layers_parameters_and_the_verdict(
    models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "verify",
        f"{models}:mlp",
        "--input-shape",
        "10,8",
        "--balance",
        "2,3",
        "--microbatches",
        "3",
        "--json",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["verdict"] == "PASS" and result["mode"] == "sequential" and result["recompute"] == "never"
    assert [s["layers"] for s in result["stages"]] == [["0", "1"], ["2", "3", "4"]]
    assert [r["layer"] for r in result["layers"]] == ["0", "1", "2", "3", "4"]
    assert {p["name"] for p in result["parameters"]} == {
        f"{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias")
    }
    assert all(p["within"] for p in result["parameters"]) and result["loss"] == pytest.approx(
        result["reference_loss"]
    )
    assert main(["verify", f"{models}:drift", "--input-shape", "8,8", "--microbatches", "4", "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["verdict"] == "FAIL" and any(r["result"] == "DIFFERENT" for r in result["layers"])


def test_verify_strategies_json_gives_each_strategy(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "verify",
        f"{models}:mlp",
        "--input-shape",
        "6,8",
        "--microbatches",
        "2",
        "--strategies",
        "single,local-pipeline",
        "--json",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["verdict"] == "PASS" and [s["name"] for s in result["strategies"]] == [
        "single",
        "local-pipeline",
    ]
    assert all(
        s["processes"] == 0 and s["verdict"] == "PASS" and s["error"] is None for s in result["strategies"]
    )
    assert len(result["strategies"][1]["parameters"]) == 6


def test_verify_refuses_an_empty_vocab_as_plan_and_run_do(
    models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", f"{models}:mlp", "--input-shape", "8,8", "--vocab", "0"]) == 2
    assert "--vocab 0 must be >= 1" in capsys.readouterr().err


def test_verify_compares_a_model_with_dropout_without_it(
    models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Dropout's masks differ between a split batch and the whole one (every default transformers config has
    it), so verify switches it off for the comparison and says so: PASS with a note, in both modes (it was
    FAIL for every strategy, ``single`` included)."""
    argv = ["verify", f"{models}:dropped", "--input-shape", "8,8", "--microbatches", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "note: dropout off in 2 module(s) (1 p=0.3, 4 p=0.1)" in out
    assert main([*argv, "--strategies", "single,local-pipeline", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["verdict"] == "PASS" and "dropout off in 2 module(s)" in result["notes"][0]

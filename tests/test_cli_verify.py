"""``torchspan verify``: PASS for a correct run, FAIL (exit 1) when gradients differ, usage errors."""

from __future__ import annotations

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
    """
)


@pytest.fixture()
def models(tmp_path: Path) -> str:
    path = tmp_path / "models.py"
    path.write_text(MODELS)
    return str(path)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_verify_passes(models: str, schedule: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", f"{models}:mlp", "--input-shape", "10,8", "--devices", "cpu,cpu", "--balance", "2,3", "--microbatches", "3", "--schedule", schedule])
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

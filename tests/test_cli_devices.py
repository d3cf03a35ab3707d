"""`torchspan devices`, `--json`, `--version`, and error exits through `main(argv)`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from torchspan.cli import main


def test_devices_table_lists_cpu_with_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "cpu" in out and "GiB" in out
    for col in ("device", "total", "free", "budget", "physical"):
        assert col in out


def test_devices_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices", "cpu,cpu", "--memory", "cpu=2GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["device"] for d in data] == ["cpu", "cpu"]
    assert all(d["budget"] == 2 * 2**30 for d in data)
    assert data[0]["total_memory"] > 0 and data[0]["free_memory"] > 0 and data[0]["kind"] == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_missing_device_exits_2_with_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices", "cuda:1"]) == 2
    err = capsys.readouterr().err
    assert "Visible devices: cpu" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["devices", "cpu", "--memory", "cpu"], "is not DEV=SIZE"),
        (["devices", "cpu", "--memory", "cuda:0=1GB"], "not in the device list"),
        (["devices", "cpu", "--memory", "cpu=-2GB"], "negative"),
    ],
)
def test_bad_memory_options(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_version_and_module_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "torchspan", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().startswith("torchspan ")
    out = subprocess.run(
        [sys.executable, "-m", "torchspan", "devices", "--json"], capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout)[-1]["kind"] == "cpu"


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "devices" in capsys.readouterr().out


def test_budget_above_capacity_is_a_one_line_warning(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices", "cpu", "--memory", "cpu=1000TiB", "--json"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("torchspan: warning: memory['cpu']='1000TiB'") and "capacity" in err

"""``torchspan demo --nproc-per-node 2 --tp 2``: the demo model tensor-parallel over 2 gloo processes, parity
reported.

Each block's MLP is split over the 2 processes (``demo.tensorparallel.TP_PLAN``); the run sets one step's
gradients (gathered whole) and the first steps' losses against the same model on one device, and says so in
the JSON, on the console and in ``report.md``. ``--tp`` without ``--nproc-per-node``, or not dividing it, is
refused.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

import torchspan.demo.ranks as demo_ranks
from torchspan.cli import main
from torchspan.demo.run import DemoConfig

SMALL = dict(batch_size=8, seq_len=16, dim=32, depth=2, heads=2, sample_chars=20, lr=1e-2)


@pytest.mark.slow
def test_demo_tp_trains_tensor_parallel_and_reports_parity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        demo_ranks, "run_demo_ranks", functools.partial(demo_ranks.run_demo_ranks, config=DemoConfig(**SMALL))
    )
    out_dir = tmp_path / "demo"
    assert (
        main(["demo", "--nproc-per-node", "2", "--tp", "2", "--steps", "4", "--out", str(out_dir), "--json"])
        == 0
    )
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["strategy"] == "tensor-parallel" and result["tp"] == 2 and result["nproc_per_node"] == 2
    rank0 = result["ranks"][0]
    check, one = rank0["gradient_check"], rank0["one_device"]
    assert check["ok"] is True and check["parameters"] > 0 and check["max_rel"] < 1e-5, check
    assert abs(check["loss"] - check["reference_loss"]) < 1e-6
    assert one["steps"] == 4 and one["largest_difference"] < 1e-5 and len(result["losses"]) == 4, one
    assert result["sample"].startswith("def ") and result["parity"][0].startswith("exact gradients: PASS")
    report = Path(result["files"]["report"]).read_text(encoding="utf-8")
    for text in (
        "tensor parallel over 2 processes",
        "each block's MLP split over tp 2",
        "## Against one device",
        "exact gradients: PASS",
        "largest loss difference",
        "tensor-parallel section",
    ):
        assert text in report, text
    assert "exact gradients: PASS" in captured.err  # the live output went to stderr


@pytest.mark.slow
def test_demo_without_tp_stays_data_parallel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same runner without ``--tp``: one replica per process on its rows (4 + 4), no parity section."""
    monkeypatch.setattr(
        demo_ranks, "run_demo_ranks", functools.partial(demo_ranks.run_demo_ranks, config=DemoConfig(**SMALL))
    )
    assert (
        main(["demo", "--nproc-per-node", "2", "--steps", "3", "--out", str(tmp_path / "dp"), "--json"]) == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["strategy"] == "data-parallel" and result["tp"] is None and result["parity"] == []
    assert [r["samples"] for r in result["ranks"]] == [12, 12] and "gradient_check" not in result["ranks"][0]
    report = Path(result["files"]["report"]).read_text(encoding="utf-8")
    assert "data parallel over 2 processes" in report and "Against one device" not in report


def test_demo_tp_needs_processes_it_divides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--tp", "2", "--out", str(tmp_path / "d")]) == 2
    assert "pass --nproc-per-node N too" in capsys.readouterr().err
    assert main(["demo", "--nproc", "2", "--tp", "3", "--out", str(tmp_path / "d")]) == 2
    assert "--tp 3 must be >= 2 and divide --nproc-per-node 2" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tp=3 must be an int >= 2 dividing nproc=4"):
        demo_ranks.run_demo_ranks(4, tp=3, out=tmp_path / "d")

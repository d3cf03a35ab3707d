"""``torchspan verify --strategies ... --nproc N`` and ``torchspan demo --nproc 2``: gloo processes on
127.0.0.1.

The strategies sharing a process count share one forkserver spawn, and the forkserver outlives a
test, so only the first spawn pays for importing torch. Test-only strategies (a wrong loss weight,
a rank that raises, a rank that hangs) live at module level: the spawned ranks import this module.
"""

from __future__ import annotations

import functools
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchspan import parity_ranks
from torchspan.cli import main
from torchspan.parity_ranks import RankStrategy, StepOptions, compare_strategies
from torchspan.runtime.ranks import DataParallelReplica, shard_batch

MODELS = textwrap.dedent(
    """
    import torch
    from torch import nn

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    """
)
STRATEGIES = ("single", "local-pipeline", "dp", "rank-pipeline")


@pytest.fixture()
def models(tmp_path: Path) -> str:
    path = tmp_path / "models.py"
    path.write_text(MODELS)
    return str(path)


def _verify(models: str, *extra: str) -> list[str]:
    return ["verify", f"{models}:mlp", "--input-shape", "7,16", "--microbatches", "3", *extra]


def _summary(out: str, name: str) -> str:
    """The summary line of one strategy (rich may wrap it: joined back)."""
    flat = " ".join(out.split())
    start = flat.rindex(f" {name} (") + 1  # the summary lines come last
    return flat[start : start + 160]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


# ----------------------------------------------------------------------------- test-only strategies
def _sum_weighted_dp(
    model: nn.Module, inputs: Any, target: Any, loss_fn: Any, opts: StepOptions, rank: int, world: int
) -> torch.Tensor:
    """Broken on purpose: each rank's *mean* loss declared a sum, so shards are not weighed by their rows."""
    xs, ts = shard_batch((inputs, target), rank, world)
    return DataParallelReplica(model).train_step(xs, ts, loss_fn, loss_reduction="sum")


def _raises_on_rank_1(
    model: nn.Module, inputs: Any, target: Any, loss_fn: Any, opts: StepOptions, rank: int, world: int
) -> torch.Tensor:
    if rank == 1:
        raise RuntimeError("deliberate failure in the test strategy")
    return torch.zeros(())


def _hangs_on_rank_1(
    model: nn.Module, inputs: Any, target: Any, loss_fn: Any, opts: StepOptions, rank: int, world: int
) -> torch.Tensor:
    if rank == 1:
        time.sleep(120)
    loss = loss_fn(model(inputs), target)
    loss.backward()
    return loss.detach()


def _every(nproc: int, opts: StepOptions) -> int:
    return nproc


# ---------------------------------------------------------------------------------------- verify
def test_verify_strategies_on_two_processes_pass_and_print_each(
    models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(_verify(models, "--strategies", ",".join(STRATEGIES), "--nproc", "2"))
    out = capsys.readouterr().out
    assert code == 0, out
    for name in STRATEGIES:
        assert f"{name}: gradient difference vs one device" in " ".join(out.split()), name
        line = _summary(out, name)
        assert "PASS" in line and "0 of 6 parameter(s) out of tolerance" in line, line
    assert "dp (2 processes)" in _summary(out, "dp") and "rank-pipeline (2 processes)" in _summary(
        out, "rank-pipeline"
    )
    assert "4.weight" in out and "max rel diff" in out
    assert "PASS: 4 of 4 strategies match one device" in " ".join(out.split())


@pytest.mark.slow
def test_verify_hybrid_on_four_processes(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(_verify(models, "--strategies", "single,hybrid", "--nproc", "4", "--microbatches", "2"))
    out = capsys.readouterr().out
    assert code == 0, out
    line = _summary(out, "hybrid")
    assert "hybrid (4 processes): PASS" in line, line


def test_hybrid_on_two_processes_is_a_one_line_usage_error(
    models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_verify(models, "--strategies", "single,hybrid", "--nproc-per-node", "2")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dp(2) * pp(2) != nproc(2)" in err and "--nproc-per-node 4" in err, err
    assert main(_verify(models, "--strategies", "dp,zero3")) == 2
    assert "strategy 'zero3' is unknown" in capsys.readouterr().err
    assert main(_verify(models, "--strategies", "rank-pipeline", "--nproc", "2", "--balance", "1,1,3")) == 2
    assert "pp(3) != nproc(2)" in capsys.readouterr().err


def test_a_broken_strategy_fails_verify_and_a_raising_rank_is_named(
    models: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(parity_ranks.RANKED, "sum-weighted-dp", RankStrategy(_every, _sum_weighted_dp))
    monkeypatch.setitem(parity_ranks.RANKED, "raises", RankStrategy(_every, _raises_on_rank_1))
    code = main(_verify(models, "--strategies", "single,sum-weighted-dp,raises", "--nproc", "2"))
    out = capsys.readouterr().out
    assert code == 1, out
    assert "PASS" in _summary(out, "single")
    broken = _summary(out, "sum-weighted-dp")
    assert "FAIL" in broken and "DIFFERENT" in out, broken
    raised = _summary(out, "raises")
    assert "FAIL, did not run: rank 1 of 2 failed: RuntimeError: deliberate failure" in raised, raised
    assert "FAIL: 1 of 3 strategies" in " ".join(out.split())


def test_a_hanging_rank_ends_at_the_timeout_naming_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(parity_ranks.RANKED, "hangs", RankStrategy(_every, _hangs_on_rank_1))
    x, y = torch.randn(7, 16), torch.randn(7, 4)
    start = time.monotonic()
    [result] = compare_strategies(
        _mlp(), x, y, nn.functional.mse_loss, ["hangs"], build=_mlp, nproc=2, timeout=6
    )
    assert time.monotonic() - start < 30
    assert (
        result.error is not None
        and "still running after 6 s (killed)" in result.error
        and "1" in result.error
    ), result.error
    assert not result.ok


def test_compare_strategies_refuses_before_running() -> None:
    x, y = torch.randn(7, 16), torch.randn(7, 4)
    with pytest.raises(ValueError, match="pass build="):
        compare_strategies(_mlp(), x, y, nn.functional.mse_loss, ["dp"])
    with pytest.raises(ValueError, match=r"dp\(2\) \* pp\(2\) != nproc\(3\)"):
        compare_strategies(_mlp(), x, y, nn.functional.mse_loss, ["hybrid"], build=_mlp, nproc=3)
    [single] = compare_strategies(_mlp(), x, y, nn.functional.mse_loss, ["single"])
    assert single.ok and single.processes == 0 and all(g.max_abs == 0 for g in single.parity.grads)  # type: ignore[union-attr]
    bad = functools.partial(compare_strategies, _mlp(), x, y, nn.functional.mse_loss, ["single"])
    with pytest.raises(ValueError, match="nproc=0"):
        bad(nproc=0)


# ---------------------------------------------------------------------------------------- demo
def test_demo_data_parallel_over_two_processes_reports_per_rank_throughput(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "demo"
    assert main(["demo", "--nproc", "2", "--steps", "2", "--out", str(out_dir)]) == 0
    printed = capsys.readouterr().out
    assert "rank 0:" in printed and "rank 1:" in printed
    report = (out_dir / "report.md").read_text()
    assert "data parallel over 2 processes" in report and "data-parallel over 2 processes" in report
    assert "torchspan.span(model) in each" in report  # the user's path, not the bare replica
    assert "## Per-rank throughput" in report and "| 1 | 32 |" in report  # 2 steps x 16 rows on rank 1
    assert "rank 0:" in report and "samples/s" in report
    assert (out_dir / "loss.png").exists()
    assert main(["demo", "--nproc", "1", "--out", str(out_dir)]) == 2
    assert main(["demo", "--nproc", "2", "--devices", "cpu,cpu", "--out", str(out_dir)]) == 2
    assert "--devices do not apply" in capsys.readouterr().err


@pytest.mark.slow
def test_verify_tensor_parallel_by_a_plan(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        _verify(models, "--strategies", "single,tp", "--nproc", "2", "--tp-plan", "0=colwise,2=rowwise")
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "tp (2 processes): PASS" in _summary(out, "tp"), out
    assert main(_verify(models, "--strategies", "tp", "--tp-plan", "0:colwise")) == 2
    assert "'0:colwise' is not MODULE=STYLE" in capsys.readouterr().err
    assert main(_verify(models, "--strategies", "tp-fsdp", "--nproc", "2")) == 2
    assert "tp-fsdp is dp_shard(nproc / 2) x tp(2)" in capsys.readouterr().err

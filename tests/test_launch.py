"""``torchspan launch``: argument checks, process layout, and real gloo jobs on 127.0.0.1.

The jobs run ``examples/train_dp.py`` (float64, uneven shards, class-weighted padded
cross-entropy) and compare the final weights with the same script run as one plain process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torchspan.cli import main
from torchspan.launch import LaunchConfig, cpu_layout, torchrun_argv
from torchspan.runtime.ranks import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_dp.py"
TRAIN = ["--dtype", "float64", "--steps", "6"]
LAUNCH = [sys.executable, "-m", "torchspan", "launch"]
FAILING = """
import os, signal
import torch.distributed as dist
from torchspan.runtime.ranks import init_distributed
info = init_distributed(timeout=120)
if info.rank == 1:
    if os.environ.get("HOW") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError("rank one fails on purpose")
dist.barrier()  # rank 0 waits for rank 1, which never comes
"""


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {
        **_env(),
        "TMPDIR": str(cwd),
        **extra,
    }  # a failed launch keeps its job folder (tracebacks): under cwd
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _same_weights(a: Path, b: Path) -> None:
    one, other = torch.load(a), torch.load(b)
    assert list(one["model"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]  # no "module." prefix
    for key, value in one["model"].items():
        torch.testing.assert_close(
            other["model"][key], value, rtol=1e-9, atol=1e-12, msg=lambda m: f"{key}: {m}"
        )
    torch.testing.assert_close(
        torch.tensor(other["losses"]), torch.tensor(one["losses"]), rtol=1e-9, atol=1e-12
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The script as one plain process (a world of one): what every layout must reproduce."""
    out = tmp_path_factory.mktemp("reference") / "one.pt"
    done = _run([sys.executable, str(SCRIPT), *TRAIN, "--out", str(out)], out.parent)
    assert done.returncode == 0, done.stderr
    assert torch.load(out)["world_size"] == 1
    return out


# ---------------------------------------------------------------------------------- fast checks
@pytest.mark.parametrize(
    "argv, words",
    [
        (["--nproc-per-node", "0"], "--nproc-per-node '0' must be 'auto' or an integer >= 1"),
        (["--nproc-per-node", "two"], "--nproc-per-node 'two' must be 'auto' or an integer >= 1"),
        (["--nnodes", "2"], "--nnodes 2 needs --master-addr and --master-port"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "1"],
            "--node-rank 2 must be in [0, --nnodes 2)",
        ),
        (["--master-port", "70000"], "--master-port 70000 is not a TCP port"),
        (["--rdzv-endpoint", "h:1", "--master-port", "5"], "either --rdzv-endpoint"),
        (["--max-restarts", "-1"], "--max-restarts '-1' must be an integer >= 0"),
    ],
)
def test_bad_arguments_are_one_line_errors(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", *argv, str(SCRIPT)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("torchspan launch: error: ") and words in err and "\n" not in err, err


def test_missing_script_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--nproc-per-node", "2", "no_such_train.py"]) == 2
    assert "SCRIPT 'no_such_train.py' does not exist" in capsys.readouterr().err


def test_auto_layout_divides_cores_among_processes() -> None:
    assert cpu_layout("auto", cores=2, gpus=0) == (2, 1)
    assert cpu_layout("auto", cores=16, gpus=0) == (8, 2)
    assert cpu_layout("auto", cores=1, gpus=0) == (1, 1)
    assert cpu_layout("auto", cores=32, gpus=4) == (4, 8)  # one process per GPU
    assert cpu_layout(3, cores=12, gpus=0) == (3, 4)


def test_torchrun_arguments() -> None:
    one = torchrun_argv(LaunchConfig(str(SCRIPT), ("--steps", "2"), nproc_per_node=2), 2)
    assert one[one.index("--rdzv-endpoint") + 1] == "localhost:0"  # a port the OS picks: jobs never collide
    assert one[-4:] == ["torchspan.launch", str(SCRIPT), "--steps", "2"]
    two = torchrun_argv(
        LaunchConfig(str(SCRIPT), nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400), 1
    )
    assert two[two.index("--node-rank") + 1] == "1" and two[two.index("--master-port") + 1] == "29400"


# ---------------------------------------------------------------------------------- real jobs
@pytest.mark.slow
def test_plain_torchrun_restarts_and_resumes_from_the_checkpoint(reference: Path, tmp_path: Path) -> None:
    """The same script under plain torchrun; its c10d store outlives the restart (init_distributed keys it by
    attempt)."""
    out, ckpt = tmp_path / "dp.pt", tmp_path / "ckpt.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
    ]
    done = _run(
        [*cmd, str(SCRIPT), *TRAIN, "--checkpoint", str(ckpt), "--crash-after", "3", "--out", str(out)],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "simulated failure on rank 1 after step 3" in done.stderr
    assert "resumed from" in done.stdout and "at step 3" in done.stdout
    assert torch.load(out)["world_size"] == 2
    _same_weights(reference, out)
    assert torch.load(ckpt)["step"] == 6 and not list(tmp_path.glob(".ckpt.pt.*"))  # no temporary left behind


@pytest.mark.slow
def test_two_node_job_on_loopback(reference: Path, tmp_path: Path) -> None:
    """Two `torchspan launch --nnodes 2` invocations on 127.0.0.1 train one replica each: one process's
    result."""
    port = str(free_port())
    out = tmp_path / "two_nodes.pt"
    nodes = [
        subprocess.Popen(
            [
                *LAUNCH,
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                str(SCRIPT),
                *TRAIN,
                "--out",
                str(out),
            ],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=120) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    assert torch.load(out)["world_size"] == 2
    _same_weights(reference, out)


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, shown", [("raise", "ValueError: rank one fails on purpose"), ("kill", "SIGKILL")]
)
def test_a_failed_rank_ends_the_job(how: str, shown: str, tmp_path: Path) -> None:
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    start = time.monotonic()
    done = _run([*LAUNCH, "--nproc-per-node", "2", str(script)], tmp_path, timeout=90, HOW=how)
    took = time.monotonic() - start
    assert done.returncode == 1, done.stderr[-3000:]
    assert took < 60, f"the job took {took:.0f} s to end after a rank failed"
    report = done.stderr[done.stderr.index("torchspan launch: rank 1 (local rank 1") :]
    assert (
        f"of failing.py failed with {'SIGKILL' if how == 'kill' else 'exit code 1'}" in report.splitlines()[0]
    )
    assert shown in report
    if how == "raise":  # the script's own frames, not the launcher's wrapper
        assert 'failing.py", line 9, in <module>' in report and "<frozen runpy>" not in report, report


@pytest.mark.slow
def test_a_launched_transformers_pipeline_trains_like_one_process(tmp_path: Path) -> None:
    """examples/train_pipeline_hf.py: a tied Llama as a 2-stage pipeline under torchspan launch, Adam over
    three padded batches, ends with plain PyTorch's weights on every rank (the tied embedding on both)."""
    script = ROOT / "examples" / "train_pipeline_hf.py"
    common = ["--dtype", "float64", "--steps", "3"]
    done = _run(
        [sys.executable, str(script), *common, "--reference", "--out", str(tmp_path / "one")], tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    done = _run(
        [*LAUNCH, "--nproc-per-node", "2", str(script), *common, "--out", str(tmp_path / "pp")],
        tmp_path,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    one = torch.load(tmp_path / "one.rank0")
    stages = [torch.load(tmp_path / f"pp.rank{r}") for r in range(2)]
    assert (
        "model.embed_tokens.weight" in stages[0]["params"]
        and "model.embed_tokens.weight" in stages[1]["params"]
    )
    seen = set()
    for r, stage in enumerate(stages):
        torch.testing.assert_close(
            torch.tensor(stage["losses"]), torch.tensor(one["losses"]), rtol=1e-6, atol=1e-7
        )
        for name, value in stage["params"].items():
            torch.testing.assert_close(
                value, one["params"][name], rtol=1e-7, atol=1e-9, msg=lambda m: f"rank {r}: {name}: {m}"
            )
            seen.add(name)
    assert seen == set(one["params"])  # between them the two ranks hold every parameter

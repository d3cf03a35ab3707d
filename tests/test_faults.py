"""Faults of a launched job (issue 19, item 2): a stuck rank is named, a killed launcher leaves no
worker, a failure's summary comes first, and a clean exit stays clean.

Real jobs are 2 gloo ranks on 127.0.0.1 with a tiny model; a rank "stops answering" by sleeping inside
its loss function, so it is alive (its heartbeat thread runs) but never reaches the next collective.
The heartbeat's reading of a stack and the launcher's choice of the rank to name are also checked in
process, on made-up beats and failures.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from torchspan.runtime.ranks import heartbeat
from torchspan.runtime.ranks.faults import failure_report

LAUNCH = [sys.executable, "-m", "torchspan", "launch", "--nproc-per-node"]
TIMEOUT_S = 10
STUCK = """
import os, signal, sys, time
import torch
from torch import nn
import torchspan

strategy, how = sys.argv[1], sys.argv[2]
info = torchspan.init_distributed()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
spanned = torchspan.span(model) if strategy == "dp" else torchspan.span(model, balance=[3, 2], microbatches=2)
opt = torch.optim.SGD(spanned.parameters(), lr=0.1)
x, y = torch.randn(8, 4), torch.randn(8, 2)


def loss_fn(out, target):
    if step == 3 and info.rank == 1:
        time.sleep(3600 if how == "sleep" else 2)
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: its heartbeat stops too
    return nn.functional.mse_loss(out, target)


for step in range(1, 6):
    opt.zero_grad()
    spanned.train_step(*(torchspan.shard_batch((x, y)) if strategy == "dp" else (x, y)), loss_fn)
    opt.step()
"""
FOREVER = """
import os, time
import torch
from torch import nn
import torchspan

torchspan.init_distributed()
spanned = torchspan.span(nn.Linear(4, 2))
opt = torch.optim.SGD(spanned.parameters(), lr=0.01)
os.write(1, f"worker pid {os.getpid()}\\n".encode())  # one write: the two workers share the pipe
while True:
    opt.zero_grad()
    spanned.train_step(*torchspan.shard_batch((torch.randn(8, 4), torch.randn(8, 2))), nn.MSELoss())
    opt.step()
    time.sleep(0.05)
"""
RAISING = """
import torch.distributed as dist
from torchspan.runtime.ranks import init_distributed


def check(rank):
    if rank == 1:
        raise ValueError("rank one fails on purpose")


info = init_distributed(timeout=120)
check(info.rank)
dist.barrier()
"""
# A gloo worker thread still busy with the script's objects when the script returns, as after a last
# barrier: without waiting for it at exit the interpreter's teardown aborts the process (SIGABRT).
EXIT_RACE = """
import time
import torch
import torch.distributed as dist
from torchspan.runtime.ranks import init_distributed

init_distributed()
group = dist.group.WORLD  # held until the teardown, as a DDP model in a global holds its group
tensor = torch.ones(4)
work = dist.all_reduce(tensor, async_op=True)
work.get_future().then(lambda fut: time.sleep(0.3))


class Teardown:
    def __del__(self):
        time.sleep(1.0)  # a teardown that takes a while (a big model being freed)


teardown = Teardown()
del tensor, work
print("script done", flush=True)
"""


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    """A clean environment; the launcher's job folder (kept after a failure) goes under ``tmp``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp))
    for key in (
        "RANK",
        "WORLD_SIZE",
        "TORCHSPAN_VERBOSE",
        "TORCHSPAN_JOB_DIR",
        "TORCHSPAN_LAUNCHER_PID",
        "TORCHSPAN_TIMEOUT",
    ):
        env.pop(key, None)
    env.update(extra)
    return env


def _summary(stderr: str) -> list[str]:
    return stderr[stderr.index("torchspan launch: ") :].splitlines()


# ---------------------------------------------------------------------------------- real jobs
@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, how, waiting",
    [
        ("dp", "sleep", "timeout"),  # gloo says "Application timeout ..." or "Timed out waiting ..."
        ("pipeline", "sleep", "could not receive gradients from rank 1"),
        ("dp", "stop", "timeout"),  # SIGSTOP: frozen, its heartbeat stops, SIGTERM waits for SIGCONT
    ],
)
def test_a_rank_that_stops_answering_is_named(strategy: str, how: str, waiting: str, tmp_path: Path) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    start = time.monotonic()
    done = subprocess.run(
        [*LAUNCH, "2", str(script), strategy, how],
        cwd=tmp_path,
        env=_env(tmp_path, TORCHSPAN_TIMEOUT=str(TIMEOUT_S)),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S + 90,
    )
    took = time.monotonic() - start
    assert done.returncode == 1, done.stderr[-3000:]
    assert took < TIMEOUT_S + 30, f"{strategy}: the stuck rank was named after {took:.0f} s"
    lines = _summary(done.stderr)
    assert done.stderr.lstrip().startswith("torchspan launch: "), done.stderr[
        :2000
    ]  # the summary comes first
    assert (
        lines[0].startswith("torchspan launch: rank 1 (local rank 1, pid ")
        and "of stuck.py stopped answering" in lines[0]
    ), lines
    assert f"rank 0 gave up waiting for it after {TIMEOUT_S} s" in lines[0], lines
    where = (
        'in torchspan\'s Spanned.train_step, at stuck.py:18 in loss_fn: time.sleep(3600 if how == "sleep" '
        "else 2)"
    )
    if how == "sleep":
        assert lines[1].startswith(f"  it was {where} (for "), lines
    else:
        assert (
            lines[1].startswith("  its last heartbeat was ")
            and "the process was frozen" in lines[1]
            and where in lines[1]
        ), lines
    assert lines[2].startswith("  rank 0 (waiting): ") and waiting in lines[2].replace(
        "Timed out", "timeout"
    ), lines
    assert "probably failed" not in "\n".join(lines) and "[rank0]" not in done.stderr


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_worker(tmp_path: Path) -> None:
    """SIGKILL of `torchspan launch` (a scheduler, the OOM killer): its workers end within 15 s."""
    script = tmp_path / "forever.py"
    script.write_text(FOREVER)
    launcher = subprocess.Popen(
        [*LAUNCH, "2", str(script)], cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, text=True
    )
    pids: list[int] = []
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:
            pids += [int(pid) for pid in re.findall(r"worker pid (\d+)", line)]
            if len(pids) == 2:
                break
        assert len(pids) == 2, f"the workers did not start: {pids}"
        time.sleep(1.0)  # both train
        assert all(_alive(pid) for pid in pids)
        launcher.kill()
        launcher.wait(timeout=30)
        killed = time.monotonic()
        while any(_alive(pid) for pid in pids) and time.monotonic() - killed < 15:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids), (
            f"workers {pids} still running 15 s after the launcher was killed"
        )
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # pragma: no cover - no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, True])
def test_a_failure_summary_comes_first_with_the_script_frames(verbose: bool, tmp_path: Path) -> None:
    script = tmp_path / "raising.py"
    script.write_text(RAISING)
    extra = {"TORCHSPAN_VERBOSE": "1"} if verbose else {}
    done = subprocess.run(
        [*LAUNCH, "2", str(script)],
        cwd=tmp_path,
        env=_env(tmp_path, **extra),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    lines = _summary(done.stderr)
    assert lines[0].startswith("torchspan launch: rank 1 (local rank 1, pid ") and lines[0].endswith(
        "of raising.py failed with exit code 1"
    )
    summary = "\n".join(lines)
    assert f'"{script}", line 8, in check' in summary and f'"{script}", line 12, in <module>' in summary, (
        summary
    )
    assert "ValueError: rank one fails on purpose" in summary
    for wrapper in ("<frozen runpy>", "torch/distributed/elastic", "launch.py", "[rank1]", "[rank0]"):
        assert wrapper not in summary, summary
    assert lines[-1].startswith("full traceback"), lines
    full = Path(lines[-1].split(": ", 1)[1].split(" (")[0]).parent / "rank1.traceback.txt"
    text = full.read_text()
    assert (
        "<frozen runpy>" in text and "ValueError: rank one fails on purpose" in text
    )  # the full traceback is kept
    if verbose:  # as before: every worker's traceback and torchrun's log as they happen, then the summary
        assert "[rank1]: Traceback" in done.stderr and "<frozen runpy>" in done.stderr
    else:
        assert done.stderr.lstrip().startswith("torchspan launch: rank 1"), done.stderr[:2000]


def test_a_clean_exit_waits_for_gloo_threads(tmp_path: Path) -> None:
    """A gloo thread that still holds the script's objects as it returns: exit 0, not SIGABRT."""
    script = tmp_path / "exit_race.py"
    script.write_text(EXIT_RACE)
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0 and "terminate called" not in done.stderr, (
            done.returncode,
            done.stderr[-2000:],
        )
        assert "script done" in done.stdout


@pytest.mark.slow
def test_the_restart_job_exits_cleanly_again_and_again(tmp_path: Path) -> None:
    """test_launch's restart job five times in a row, both ranks on one core where taskset exists (the
    crowded machine on which rank 1 of the restarted attempt used to abort at exit)."""
    root = Path(__file__).resolve().parents[1]
    pin = (
        ["taskset", "-c", str(min(os.sched_getaffinity(0)))]
        if hasattr(os, "sched_getaffinity") and _has("taskset")
        else []
    )
    cmd = [
        *pin,
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
    ]
    for attempt in range(5):
        ckpt = tmp_path / f"ckpt{attempt}.pt"
        args = [
            str(root / "examples" / "train_dp.py"),
            "--dtype",
            "float64",
            "--steps",
            "6",
            "--checkpoint",
            str(ckpt),
            "--crash-after",
            "3",
        ]
        done = subprocess.run(
            [*cmd, *args], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0 and "terminate called" not in done.stderr, (
            f"run {attempt + 1}: {done.stderr[-3000:]}"
        )
        assert "resumed from" in done.stdout


def _has(program: str) -> bool:
    return any(
        os.access(os.path.join(d, program), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep)
    )


# ---------------------------------------------------------------------------------- in process
def _sleeper(ready: threading.Event, stop: threading.Event) -> None:
    ready.set()
    stop.wait(30)


def test_a_beat_says_where_the_script_is() -> None:
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=_sleeper, args=(ready, stop), daemon=True)
    thread.start()
    ready.wait(10)
    try:
        text, waiting = heartbeat.doing(sys._current_frames()[thread.ident])  # type: ignore[index]
    finally:
        stop.set()
        thread.join()
    assert (
        text.startswith("at test_faults.py:")
        and "in _sleeper: stop.wait(30)" in text
        and "inside Condition.wait (threading.py:" in text
    ), text
    assert not waiting


def test_heartbeats_are_written_and_read_back(tmp_path: Path) -> None:
    beat = heartbeat.Heartbeat(tmp_path, rank=3, parent=None).beat()
    assert heartbeat.read_beats(tmp_path) == {3: beat}
    assert beat["pid"] == os.getpid() and beat["waiting"] is False and "test_faults.py" in beat["doing"]
    try:
        raise RuntimeError("Timed out waiting 10000ms for recv operation to complete")
    except RuntimeError as exc:
        trace = heartbeat.record_error(tmp_path, 3, exc)
    errors = heartbeat.read_errors(tmp_path)
    assert set(errors) == {3} and errors[3]["waited"] and trace.read_text().startswith("Traceback")
    assert set(heartbeat.read_beats(tmp_path)) == {3}  # an error record is not a beat


def _failure(rank: int, exitcode: int, message: str = "") -> SimpleNamespace:
    name = {-9: "SIGKILL", -15: "SIGTERM"}.get(exitcode, "")
    return SimpleNamespace(
        local_rank=rank,
        pid=1000 + rank,
        exitcode=exitcode,
        message=message,
        timestamp=100,
        signal_name=lambda: name,
    )


def _job(tmp_path: Path, beats: dict[int, dict], errors: dict[int, dict]) -> Path:
    folder = tmp_path / "attempt0"
    folder.mkdir(parents=True)
    for rank, beat in beats.items():
        (folder / f"rank{rank}.json").write_text(
            json.dumps({"rank": rank, "pid": 1000 + rank, "seq": 5, "waiting": False, **beat})
        )
    for rank, error in errors.items():
        (folder / f"rank{rank}.error.json").write_text(json.dumps({"rank": rank, "time": 100.0, **error}))
    return tmp_path


def test_the_rank_the_others_waited_for_is_named_frozen_or_not(tmp_path: Path) -> None:
    waited = {"type": "RuntimeError", "message": "Timed out waiting 10000ms", "waited": True}
    beats = {
        0: {"time": 99.5, "since": 90.0, "doing": "in torchspan's Spanned.train_step, backward", "seq": 9},
        1: {
            "time": 80.0,
            "since": 70.0,
            "doing": "at train.py:12 in loss_fn: compute()",
            "seq": 8,
        },  # frozen at 80
        2: {
            "time": 99.8,
            "since": 89.0,
            "doing": "waiting in torch.distributed all_reduce()",
            "waiting": True,
            "seq": 9,
        },
    }
    failures = {0: _failure(0, 1), 1: _failure(1, -15), 2: _failure(2, -15)}
    lines = failure_report(failures, _job(tmp_path, beats, {0: waited}), "train.py").splitlines()
    assert (
        lines[0]
        == "torchspan launch: rank 1 (local rank 1, pid 1001) of train.py stopped answering: rank 0 gave "
        "up waiting for it and the job was stopped"
    )
    assert "its last heartbeat was 20 s before the job ended: the process was frozen" in lines[1]
    assert "at train.py:12 in loss_fn: compute() (for 10 s)" in lines[1]
    assert (
        lines[2] == "  rank 0 (waiting): RuntimeError: Timed out waiting 10000ms"
        and lines[-1] == "rank 2 was stopped by the launcher after rank 1 stopped answering"
    )


def test_an_error_of_its_own_comes_before_a_peer_s_timeout(tmp_path: Path) -> None:
    own = {
        "type": "ValueError",
        "message": "bad",
        "waited": False,
        "script_frames": "Traceback ...\nValueError: bad",
        "time": 101.0,
    }
    lost = {"type": "RuntimeError", "message": "Connection closed by peer", "waited": True}
    failures = {0: _failure(0, 1), 1: _failure(1, 1)}
    report = failure_report(failures, _job(tmp_path, {}, {0: lost, 1: own}), "train.py")
    assert report.startswith(
        "torchspan launch: rank 1 (local rank 1, pid 1001) of train.py failed with exit code 1\nTraceback "
        "...\nValueError: bad"
    )
    killed = failure_report(
        {0: _failure(0, 1), 1: _failure(1, -9, "Signal 9 (SIGKILL) received by PID 1001")},
        _job(tmp_path / "k", {}, {0: lost}),
        "t.py",
    )
    assert killed.startswith("torchspan launch: rank 1 (local rank 1, pid 1001) of t.py failed with SIGKILL")


def test_a_rank_that_finished_while_another_waited_is_named(tmp_path: Path) -> None:
    lost = {"type": "RuntimeError", "message": "Connection closed by peer [127.0.0.1]:4242", "waited": True}
    beats = {
        0: {"time": 90.0, "since": 90.0, "doing": "finished its script", "finished": True, "local_rank": 0},
        1: {"time": 99.0, "since": 95.0, "doing": "x"},
    }
    report = failure_report({1: _failure(1, 1)}, _job(tmp_path, beats, {1: lost}), "train.py")
    assert report.splitlines()[0] == (
        "torchspan launch: rank 0 (local rank 0, pid 1000) of train.py finished its script while rank 1 "
        "still waited for it: the ranks ran different collectives (a step, barrier or checkpoint that only "
        "some ranks run)"
    )
    assert (
        report.splitlines()[1]
        == "  rank 1 (waiting): RuntimeError: Connection closed by peer [127.0.0.1]:4242"
    )


def test_the_agent_s_late_sigkill_is_not_a_root_cause(tmp_path: Path) -> None:
    """torchrun's agent SIGKILLs a rank 30 s after a SIGTERM it did not end on (a SIGTERM handler stuck
    in C code): that rank stopped answering, it was not killed from outside."""
    waited = {"type": "RuntimeError", "message": "Timed out waiting 10000ms", "waited": True}
    late = _failure(1, -9, "Signal 9 (SIGKILL) received by PID 1001")
    late.timestamp = 131
    beats = {1: {"time": 99.0, "since": 90.0, "doing": "at train.py:12 in loss_fn: spin()"}}
    report = failure_report({0: _failure(0, 1), 1: late}, _job(tmp_path, beats, {0: waited}), "train.py")
    assert report.startswith(
        "torchspan launch: rank 1 (local rank 1, pid 1001) of train.py stopped answering: rank 0 gave up"
    ), report

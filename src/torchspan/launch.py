"""``torchspan launch``: run a training script once per process, on ``torch.distributed.run``.

The launcher *is* torchrun (its argument parser and ``run``), so the environment a script sees
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``), rendezvous, multi-node and
restarts are torchrun's: a script runs the same under plain ``torchrun``. What torchspan adds:

- ``--nproc-per-node auto``: one process per visible GPU; on a CPU-only machine up to 8 processes,
  with the cores divided among them (``OMP_NUM_THREADS``, unless already set).
- one node without ``--master-port``: torchrun's c10d rendezvous on a port the OS picks, so two
  jobs on one machine never collide; several nodes must name the same port (or an endpoint).
- arguments checked before anything starts (``ValueError`` naming the option, value and fix).
- a failed rank (an exception, or a signal such as SIGKILL) ends the job: torchrun stops the
  other ranks, and ``launch`` returns 1 after printing a summary first: which rank failed and the
  script's own frames of its traceback (the full one stays in a file the summary names, and
  ``TORCHSPAN_VERBOSE=1`` prints it and torchrun's own log as they happen).
- a rank that stops answering is named: every worker writes a heartbeat (``runtime.ranks.heartbeat``)
  into the job's folder, so when the others time out waiting (``TORCHSPAN_TIMEOUT``) the summary
  names the rank they waited for and what it was doing, not the rank that gave up waiting.
- a launcher that dies (SIGKILL from a scheduler or the OOM killer) takes its workers with it: each
  worker asks the kernel for SIGKILL when its parent dies (Linux), and its heartbeat thread checks.

Usage::

    torchspan launch --nproc-per-node 2 train.py --epochs 3
    exit_code = launch("train.py", ["--epochs", "3"], nproc_per_node=2)
"""

from __future__ import annotations

import logging
import os
import runpy
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .files import require_regular_file

__all__ = ["LaunchConfig", "cpu_layout", "torchrun_argv", "launch"]

MAX_CPU_PROCESSES = 8


@dataclass(frozen=True)
class LaunchConfig:
    """A checked launcher configuration (``ValueError`` from the constructor when inconsistent)."""

    script: str
    script_args: tuple[str, ...] = ()
    nproc_per_node: int | str = "auto"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "torchspan"
    max_restarts: int = 0

    def __post_init__(self) -> None:
        require_regular_file(
            self.script,
            name="SCRIPT",
            what="a Python file",
            fix="give the path of a Python training script, e.g. train.py",
        )
        n = self.nproc_per_node
        if not (n == "auto" or (isinstance(n, int) and not isinstance(n, bool) and n >= 1)):
            raise ValueError(f"--nproc-per-node {n!r} must be 'auto' or an integer >= 1")
        if isinstance(self.nnodes, bool) or not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise ValueError(f"--nnodes {self.nnodes!r} must be an integer >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes})")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts {self.max_restarts} must be >= 0")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port {self.master_port} is not a TCP port (1..65535)")
        if self.rdzv_endpoint is not None:
            if self.master_addr is not None or self.master_port is not None:
                raise ValueError(
                    "give either --rdzv-endpoint HOST:PORT or --master-addr/--master-port, not both"
                )
            if ":" not in self.rdzv_endpoint:
                raise ValueError(
                    f"--rdzv-endpoint {self.rdzv_endpoint!r} must be HOST:PORT, e.g. node0:29400"
                )
        elif self.nnodes > 1 and (self.master_addr is None or self.master_port is None):
            raise ValueError(
                f"--nnodes {self.nnodes} needs --master-addr and --master-port (node 0's address and a "
                "port, the same on every node), or --rdzv-endpoint HOST:PORT"
            )


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cpu_layout(
    nproc_per_node: int | str, cores: int | None = None, gpus: int | None = None
) -> tuple[int, int]:
    """(processes on this node, threads per process) for ``nproc_per_node`` (``"auto"`` or a count).

    ``auto``: one process per GPU when there are GPUs, else ``min(cores, 8)`` processes; threads
    are the cores divided among the processes (at least 1).
    """
    cores = _cores() if cores is None else cores
    gpus = _gpus() if gpus is None else gpus
    if nproc_per_node == "auto":
        nproc = gpus if gpus > 0 else max(1, min(cores, MAX_CPU_PROCESSES))
    else:
        nproc = int(nproc_per_node)
    return nproc, max(1, cores // nproc)


def torchrun_argv(config: LaunchConfig, nproc: int) -> list[str]:
    """The ``torch.distributed.run`` argument list for ``config`` with ``nproc`` processes on this node."""
    argv = [
        "--nproc-per-node",
        str(nproc),
        "--nnodes",
        str(config.nnodes),
        "--max-restarts",
        str(config.max_restarts),
    ]
    if config.rdzv_endpoint is not None:
        argv += [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            config.rdzv_endpoint,
            "--rdzv-id",
            config.rdzv_id,
        ]
    elif config.master_port is None:  # one node: the OS picks a free port for the store
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-id", config.rdzv_id]
    else:
        argv += ["--node-rank", str(config.node_rank), "--master-addr", config.master_addr or "127.0.0.1"]
        argv += ["--master-port", str(config.master_port)]
    # each worker runs the script under @record (see _run_worker), as `python -u -m torchspan.launch SCRIPT
    # ...`
    return [*argv, "--module", __name__, config.script, *config.script_args]


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch(script: str, script_args: Sequence[str] = (), **options: Any) -> int:
    """Run ``script`` on every process of the job; returns the exit status (0, or 1 when a rank failed).

    ``options`` are ``LaunchConfig``'s fields (``nproc_per_node``, ``nnodes``, ``node_rank``,
    ``master_addr``, ``master_port``, ``rdzv_endpoint``, ``max_restarts``). A failure is reported
    on stderr, before anything else about it: the failing rank (or the rank the others waited for),
    its exit code or signal, the script's frames of its traceback, and the file with the full one.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .runtime.ranks.faults import failure_report

    config = LaunchConfig(script, tuple(script_args), **options)
    nproc, threads = cpu_layout(config.nproc_per_node)
    job = Path(tempfile.mkdtemp(prefix="torchspan-launch-"))
    env = {
        "PYTHONUNBUFFERED": "1",
        "TORCHSPAN_LAUNCHED": "1",
        "TORCHSPAN_JOB_DIR": str(job),
        "TORCHSPAN_LAUNCHER_PID": str(os.getpid()),
    }
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    args = torchrun.parse_args(torchrun_argv(config, nproc))
    keep = False  # a job that failed keeps its folder: the summary names the files in it
    with _environment(env), _agent_log(), _thawing(job):
        try:
            torchrun.run(args)
        except ChildFailedError as exc:
            print(
                failure_report(exc.failures, job, Path(config.script).name, config.max_restarts),
                file=sys.stderr,
            )
            keep = True
            return 1
        finally:
            if not keep:
                shutil.rmtree(job, ignore_errors=True)
    return 0


def _verbose() -> bool:
    return os.environ.get("TORCHSPAN_VERBOSE", "") not in ("", "0")


@contextmanager
def _agent_log() -> Iterator[None]:
    """torchrun's agent logs each failed and stopped worker before ``launch`` can summarise: quiet
    unless ``TORCHSPAN_VERBOSE=1``, so the summary is the first thing a failure prints."""
    log = logging.getLogger("torch.distributed.elastic")
    level = log.level
    if not _verbose():
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


@contextmanager
def _thawing(job: Path, every: float = 0.5) -> Iterator[None]:
    """While the job runs, resume (SIGCONT) any worker that is stopped (SIGSTOP, a debugger's stop)
    with the agent's SIGTERM already pending: the agent waits 30 s before its SIGKILL, so a frozen rank
    would hold the failure summary back that long."""
    done = threading.Event()

    def watch() -> None:
        from .runtime.ranks.faults import last_attempt
        from .runtime.ranks.heartbeat import read_beats

        while not done.wait(every):
            for beat in read_beats(last_attempt(job)).values():
                if _stopped_with_sigterm(int(beat.get("pid", 0))):
                    os.kill(int(beat["pid"]), signal.SIGCONT)

    thread = threading.Thread(target=watch, name="torchspan-thaw", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)


def _stopped_with_sigterm(pid: int) -> bool:
    """Linux: ``pid`` is stopped and has SIGTERM pending (elsewhere, or for a pid gone: False)."""
    try:
        fields = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
        )
        pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
        return fields["State"].strip()[:1] in ("T", "t") and bool(pending & (1 << (int(signal.SIGTERM) - 1)))
    except (OSError, KeyError, ValueError):
        return False


def _run_worker(argv: Sequence[str]) -> None:
    """One worker: run ``argv[0]`` as ``__main__`` with ``argv[1:]``, as ``python SCRIPT ...`` would.

    Under ``torchspan launch`` (``TORCHSPAN_JOB_DIR``) it dies with the launcher, beats into the job's
    folder, and an exception is recorded there (and in torchrun's error file) instead of printed, so the
    launcher's summary comes first; ``TORCHSPAN_VERBOSE=1`` prints it too."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    from .runtime.ranks import heartbeat

    if not argv:
        raise SystemExit(
            "usage: python -m torchspan.launch SCRIPT [args]  (run by torchspan launch on each rank)"
        )
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(script))
    job, rank = os.environ.get("TORCHSPAN_JOB_DIR"), int(os.environ.get("RANK", "0"))
    parent = int(os.environ["TORCHSPAN_LAUNCHER_PID"]) if os.environ.get("TORCHSPAN_LAUNCHER_PID") else None
    if parent is not None:
        heartbeat.die_with_parent(parent)
    folder = heartbeat.attempt_folder(job) if job else None
    try:
        beats = heartbeat.start(folder, rank, parent) if folder is not None else None
    except OSError:  # the job's folder is gone or unwritable: train anyway, unobserved
        folder = beats = None
    errors = get_error_handler()
    errors.initialize()
    try:
        runpy.run_path(script, run_name="__main__")
        if beats is not None:
            beats.finish()
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _record(folder, rank, exc)  # where the script called sys.exit(code), for the summary
            raise
        if beats is not None:
            beats.finish()
    except BaseException as exc:
        recorded = _record(folder, rank, exc)
        errors.record_exception(exc)  # torchrun's error file: plain torchrun tools read it
        if not recorded or _verbose():
            raise
        raise SystemExit(1) from None


def _record(folder: Path | None, rank: int, exc: BaseException) -> bool:
    """Record what ended this worker in the job's folder for the launcher's summary; False where it could
    not."""
    from .runtime.ranks import heartbeat

    if folder is None:
        return False
    try:
        heartbeat.record_error(folder, rank, exc)
    except Exception:  # a full disk: the exception is printed as Python would instead
        return False
    return True


if __name__ == "__main__":
    _run_worker(sys.argv[1:])

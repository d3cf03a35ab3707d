"""Joining a job's process group: torchrun / ``torchspan launch``, SLURM, or one someone else opened.

The contract is torchrun's ``env://``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``. Under ``srun`` without torchrun the SLURM
variables stand in (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NTASKS_PER_NODE``,
the first host of ``SLURM_JOB_NODELIST``, a port derived from ``SLURM_JOB_ID``). A process group
that is already initialised (Ray Train, the user's own ``init_process_group``) is left alone. Run
under plain ``python``, ``init_distributed`` opens a world of one on a free local port, so the same
script runs with and without a launcher.

A launched script that forgets ``init_distributed()`` is not left to train unsynchronised: the
first torchspan call that needs the job (``span``, ``shard_batch``/``rank_batches`` without an
explicit rank) calls ``join_launched_job``, which joins it as ``init_distributed()`` would (every
rank runs the same script, so every rank reaches that call; what Accelerate's ``Accelerator()`` and
Lightning Fabric's ``launch()`` do), or refuses where joining cannot be right (a DataLoader worker).

Usage::

    info = init_distributed()                # gloo on CPU, nccl with CUDA; idempotent
    info.rank, info.world_size, info.device  # RankInfo
"""

from __future__ import annotations

import atexit
import os
import platform
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = [
    "RankInfo",
    "DEFAULT_TIMEOUT_S",
    "launch_env",
    "is_launched",
    "rank_info",
    "init_distributed",
    "join_launched_job",
    "free_port",
]

# How long a collective waits for a missing peer before raising: five minutes, not torch's ten. Long
# enough for the waits a training job has on purpose (rank 0 writing a checkpoint of tens of GB while
# the others wait at its barrier, a first step that compiles or loads data), short enough that a rank
# that stopped answering is named while someone is still watching (TORCHSPAN_TIMEOUT to change it).
DEFAULT_TIMEOUT_S = 300.0

_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands in its job; ``device`` is where its replica lives."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str | None
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on rank 0 (the rank that writes checkpoints and reports)."""
        return self.rank == 0


def _int(env: Mapping[str, str], name: str) -> int:
    text = env[name]
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={text!r} is not an integer; unset it or fix the launcher that "
            "sets it"
        ) from None


def _first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[03-05,9],gpu1`` -> ``node03``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(
            f"SLURM_JOB_NODELIST={nodelist!r} is not a node list; set MASTER_ADDR to rank 0's host"
        )
    prefix, ranges = m.group(1), m.group(2)
    return prefix if ranges is None else prefix + ranges.split(",")[0].split("-")[0]


def _from_slurm(env: Mapping[str, str]) -> dict[str, str] | None:
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env or _int(env, "SLURM_NTASKS") < 2:
        return None
    per_node = re.match(r"\d+", env.get("SLURM_NTASKS_PER_NODE", "")) or re.match(
        r"\d+", env.get("SLURM_TASKS_PER_NODE", "")
    )
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    addr = env.get("MASTER_ADDR") or (_first_host(nodelist) if nodelist else None)
    if addr is None:
        raise ValueError(
            "SLURM job without SLURM_JOB_NODELIST or MASTER_ADDR: set MASTER_ADDR to rank 0's host name"
        )
    port = env.get("MASTER_PORT") or str(
        20000 + _int(env, "SLURM_JOB_ID") % 20000 if "SLURM_JOB_ID" in env else 29500
    )
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": per_node.group(0) if per_node else "1",
        "MASTER_ADDR": addr,
        "MASTER_PORT": port,
    }


def launch_env(environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The launcher's variables (torchrun's names), or ``None`` when this process was not launched.

    torchrun's variables win over SLURM's. Inconsistent values are a ``ValueError`` naming the
    variables and their values.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in env]
        if missing:
            raise ValueError(
                f"{', '.join(missing)} not set but {'WORLD_SIZE' if 'RANK' in missing else 'RANK'} is: a "
                "launcher sets both; start the script with `torchspan launch` or `torchrun`, or unset the "
                "stray variable"
            )
        out = {k: env[k] for k in _TORCHRUN if k in env}
        out.setdefault("LOCAL_RANK", env["RANK"])  # no local variables: one node
        out.setdefault("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])
    else:
        slurm = _from_slurm(env)
        if slurm is None:
            return None
        out = slurm
    _check(out)
    return out


def _check(env: Mapping[str, str]) -> None:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local, local_world = _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE")
    if world < 1:
        raise ValueError(f"WORLD_SIZE={world} must be >= 1")
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world}); the launcher's variables disagree")
    if not 0 <= local < local_world or local_world > world:
        raise ValueError(
            f"LOCAL_RANK={local} must be in [0, LOCAL_WORLD_SIZE={local_world}) and LOCAL_WORLD_SIZE <= "
            f"WORLD_SIZE={world}"
        )
    if world > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise ValueError(
                f"WORLD_SIZE={world} but {' and '.join(missing)} not set: the ranks cannot find rank 0"
            )
        port = _int(env, "MASTER_PORT")
        if not 0 < port < 65536:
            raise ValueError(f"MASTER_PORT={port} is not a TCP port (1..65535)")


def is_launched(environ: Mapping[str, str] | None = None) -> bool:
    """True where this process is one of several: a process group of size > 1, or launcher variables saying
    so."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    env = launch_env(environ)
    return env is not None and int(env["WORLD_SIZE"]) > 1


def _device_for(backend: str | None, local_rank: int) -> torch.device:
    if backend is not None and "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def rank_info(environ: Mapping[str, str] | None = None) -> RankInfo:
    """This process's ``RankInfo`` from the live process group, else from the launcher's variables, else a
    world of one."""
    env = launch_env(environ) or {}
    local = int(env.get("LOCAL_RANK", 0))
    if dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend())
        world = dist.get_world_size()
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return RankInfo(dist.get_rank(), world, local, local_world, backend, _device_for(backend, local))
    return RankInfo(
        int(env.get("RANK", 0)),
        int(env.get("WORLD_SIZE", 1)),
        local,
        int(env.get("LOCAL_WORLD_SIZE", 1)),
        None,
        torch.device("cpu"),
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _timeout(timeout: float | timedelta | None) -> timedelta:
    if timeout is None:
        text = os.environ.get("TORCHSPAN_TIMEOUT")
        if text is None:
            return timedelta(seconds=DEFAULT_TIMEOUT_S)
        try:
            timeout = float(text)
        except ValueError:
            raise ValueError(
                f"TORCHSPAN_TIMEOUT={text!r} is not a number of seconds; write e.g. TORCHSPAN_TIMEOUT=300"
            ) from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, timedelta)):
        raise TypeError(f"timeout={timeout!r} must be seconds (a number) or a datetime.timedelta")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"timeout={timeout!r} must be > 0 seconds; e.g. timeout=300")
    return timedelta(seconds=seconds)


def _pick_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if not isinstance(backend, str):
        raise TypeError(
            f"backend={backend!r} must be a string such as 'gloo' or 'nccl' (or None to choose from the "
            "devices)"
        )
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    for part in backend.split(","):
        name = part.split(":")[-1].strip().lower()
        if name not in known:
            raise ValueError(
                f"backend={backend!r}: {name!r} is not a torch.distributed backend; use one of "
                f"{', '.join(known)} (e.g. 'gloo' on CPU, 'nccl' on GPUs, 'cpu:gloo,cuda:nccl'), or None "
                "to choose from the devices"
            )
    if "nccl" in backend and not torch.cuda.is_available():
        raise ValueError(
            f"backend={backend!r} needs CUDA GPUs, and none is visible here; use backend='gloo' (or None)"
        )
    return backend


def _close_gloo_group() -> None:
    """Destroy the gloo process group ``init_distributed`` opened, at exit, and let gloo's worker threads
    finish first. A gloo thread drops its last collective's tensors after the script saw the collective
    complete, and dropping a tensor the script made takes the GIL: a script that returns right after its
    last collective (a checkpoint barrier) can reach the interpreter's teardown first, and a thread that
    asks for the GIL then is ended inside a C++ destructor ("terminate called without an active
    exception", SIGABRT), which a launcher counts as a failed rank. Local, no communication."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # pragma: no cover - exiting anyway
            pass
    _await_gloo_threads()


_GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives each gloo worker thread
_FUTEX = {"x86_64": "202", "aarch64": "98"}


def _await_gloo_threads(limit: float = 2.0) -> None:
    """Release the GIL until every gloo worker thread of this process waits for new work (at most
    ``limit`` seconds). Linux: a waiting worker sleeps in futex() without a timeout, where one that
    waits for the GIL (a timed futex) or still runs does not; elsewhere there is nothing to read."""
    futex = _FUTEX.get(platform.machine())
    tasks = Path("/proc/self/task")
    if futex is None or not tasks.is_dir():
        return
    deadline, quiet = time.monotonic() + limit, 0
    while time.monotonic() < deadline and quiet < 3:  # idle three times in a row: not a wake-up in flight
        try:
            busy = any(_gloo_worker(t) and not _waits_for_work(t, futex) for t in tasks.iterdir())
        except OSError:  # pragma: no cover - /proc unreadable
            return
        quiet = 0 if busy else quiet + 1
        time.sleep(0.005)  # the GIL is free: a worker that needs it takes it now


def _gloo_worker(task: Path) -> bool:
    try:
        return (task / "comm").read_text().strip() == _GLOO_WORKER
    except OSError:  # the thread ended
        return False


def _waits_for_work(task: Path, futex: str) -> bool:
    try:
        fields = (task / "syscall").read_text().split()
    except OSError:  # the thread ended
        return True
    return len(fields) > 4 and fields[0] == futex and fields[4] == "0x0"  # futex(addr, op, val, timeout=NULL)


_timeout_s: float | None = None  # the timeout init_distributed gave the group it opened


def current_timeout() -> float | None:
    """Seconds a collective of the group ``init_distributed`` opened waits for a peer (``None``: none opened
    here)."""
    return _timeout_s


def init_distributed(backend: str | None = None, timeout: float | timedelta | None = None) -> RankInfo:
    """Join the job's process group (idempotent) and return this process's ``RankInfo``.

    ``backend``: ``None`` picks nccl when CUDA GPUs are visible, gloo otherwise. ``timeout``:
    seconds (or a ``timedelta``) a collective waits for a missing peer before raising; default
    ``TORCHSPAN_TIMEOUT`` from the environment, else 300 s (``DEFAULT_TIMEOUT_S``). A group that is
    already initialised is kept as it is. Without launcher variables a world of one is opened on a free
    local port.
    """
    global _timeout_s
    wait = _timeout(timeout)
    if not dist.is_available():
        raise RuntimeError(
            "this PyTorch build has no torch.distributed; install a build with distributed support"
        )
    if dist.is_initialized():
        return rank_info()
    env = launch_env()
    chosen = _pick_backend(backend)
    _timeout_s = wait.total_seconds()
    if "nccl" not in chosen:  # ours to close: before the interpreter tears gloo's threads down
        atexit.register(_close_gloo_group)
    if env is None:
        dist.init_process_group(
            chosen, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=wait
        )
        return rank_info()
    rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    if "nccl" in chosen:
        torch.cuda.set_device(local % torch.cuda.device_count())
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent hosts the store. Its c10d rendezvous keeps one store across restarts, so
        # a restarted job would read the previous attempt's gloo addresses: key them by attempt.
        agent = dist.TCPStore(
            env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=wait
        )
        store = dist.PrefixStore(
            f"torchspan/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent
        )
        dist.init_process_group(chosen, store=store, rank=rank, world_size=world, timeout=wait)
    elif "RANK" in os.environ:  # torchrun's variables without an agent store: env://
        dist.init_process_group(chosen, init_method="env://", rank=rank, world_size=world, timeout=wait)
    else:  # SLURM: the variables were mapped, not exported
        url = f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        dist.init_process_group(chosen, init_method=url, rank=rank, world_size=world, timeout=wait)
    return rank_info()


def join_launched_job(caller: str, *, explicit: bool = False) -> RankInfo | None:
    """Join the job where the launcher's variables say this process is one rank of several and no
    process group exists yet (``init_distributed()`` with its defaults); returns the ``RankInfo``
    then, ``None`` where there is nothing to join (a group exists, or no launcher / a world of one).

    ``caller`` names the torchspan call that needs the job, for the refusal: inside a DataLoader
    worker process joining would open a second member for the same rank, so it raises
    ``RuntimeError`` naming ``torchspan.init_distributed()`` (call it in the main process first), and, where
    the caller takes them (``explicit``: ``shard_batch``, ``rank_batches``), its ``rank=`` and
    ``world_size=``.
    """
    if dist.is_available() and dist.is_initialized():
        return None
    env = launch_env()
    if env is None or int(env["WORLD_SIZE"]) < 2:
        return None
    from torch.utils.data import get_worker_info

    if get_worker_info() is not None:
        raise RuntimeError(
            f"{caller} ran in a DataLoader worker of rank {env['RANK']} (WORLD_SIZE={env['WORLD_SIZE']}) "
            "before the job's process group exists, and a worker cannot join the job for its rank: call "
            "torchspan.init_distributed() in the main process before creating the DataLoader"
            + (", or pass rank= and world_size= explicitly" if explicit else "")
        )
    return init_distributed()

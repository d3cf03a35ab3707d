"""Heartbeats: what each rank of a launched job is doing, so a rank that stops answering can be named.

``torchspan launch`` gives its workers a folder (``TORCHSPAN_JOB_DIR``). In each worker a daemon thread
rewrites ``attempt<N>/rank<R>.json`` there every second: the time, the pid, how many collectives the
rank has issued on its default process group (``seq``), and what its threads are doing, read from their
stacks (the script's innermost frame and source line, the torchspan call it is inside, backward, or a
wait inside ``torch.distributed``). A rank stuck in its own code keeps beating and shows where it is; a
frozen process (stopped, swapping, a C call holding the GIL) stops beating, which shows too. When the
job fails, the launcher reads them (``read_beats``) with the errors the workers recorded
(``record_error``) and names the rank the others were waiting for.

The same thread ends the worker when the launcher is gone (its parent pid changes); on Linux
``die_with_parent`` also asks the kernel to kill the worker when the launcher dies (``PR_SET_PDEATHSIG``),
so a launcher killed by a scheduler or the OOM killer leaves no worker training on.

Usage (the worker entry of ``torchspan launch`` does this)::

    die_with_parent(launcher_pid)
    start(folder, rank)                       # daemon thread, stopped at exit
    record_error(folder, rank, exc)           # in the worker's ``except``
    beats, errors = read_beats(folder), read_errors(folder)   # in the launcher
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from ...files import write_text

__all__ = [
    "INTERVAL_S",
    "Heartbeat",
    "start",
    "doing",
    "die_with_parent",
    "attempt_folder",
    "record_error",
    "read_beats",
    "read_errors",
    "waited_for_peer",
    "script_frames",
]

INTERVAL_S = 1.0
_TORCHSPAN = str(Path(__file__).resolve().parents[2]) + os.sep
_LIBRARY = tuple(
    {
        str(Path(p).resolve()) + os.sep
        for k in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(k))
    }
)
_DISTRIBUTED = (f"torch{os.sep}distributed{os.sep}", f"torch{os.sep}nn{os.sep}parallel{os.sep}distributed.py")
# What an error says when its rank was waiting for a peer that died or stopped answering: not a root cause.
_PEER_WAIT = (
    "timed out",
    "timeout caused",
    "operation timeout",
    "socket timeout",
    "wait timeout",
    "connection closed by peer",
    "connection reset by peer",
    "remote worker crashing",
    "broken pipe",
    "could not receive",
    "could not finish sending",
    "communicator was aborted",
)
_PEER_TYPES = ("PeerError", "DistBackendError", "DistNetworkError", "DistStoreError")
_RUNTIME_TYPES = (
    "",
    "RuntimeError",
    "DistError",
    "TimeoutError",
    "ConnectionError",
    "ConnectionResetError",
    "BrokenPipeError",
)


def attempt_folder(job: str | os.PathLike[str]) -> Path:
    """This worker's folder in the job folder: one per restart attempt (``TORCHELASTIC_RESTART_COUNT``)."""
    return Path(job) / f"attempt{int(os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') or 0)}"


# --------------------------------------------------------------------------- what a thread is doing
def _kind(filename: str) -> str:
    """``torchspan``, ``distributed`` (torch.distributed, DDP), ``library`` (stdlib, site-packages), or
    ``script``."""
    if filename.startswith("<"):
        return "library"
    path = os.path.abspath(filename)
    if path.startswith(_TORCHSPAN):
        return "torchspan"
    if any(marker in path for marker in _DISTRIBUTED):
        return "distributed"
    if path.startswith(_LIBRARY) or f"{os.sep}site-packages{os.sep}" in path:
        return "library"
    return "script"


def _stack(frame: FrameType | None) -> list[FrameType]:
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]  # outermost first


def _name(frame: FrameType) -> str:
    return getattr(frame.f_code, "co_qualname", frame.f_code.co_name)


def _line(frame: FrameType) -> str:
    import linecache

    text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).split("  #")[0].strip()
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} in {frame.f_code.co_name}" + (
        f": {text}" if text else ""
    )


def doing(frame: FrameType | None, main: bool = True) -> tuple[str, bool]:
    """What a thread whose innermost frame is ``frame`` is doing, and whether it waits for other ranks
    (``main``: the thread that runs the script, outside the script only while starting or exiting)."""
    frames = _stack(frame)
    if not frames:
        return "nothing (no Python frame)", False
    kinds = [_kind(f.f_code.co_filename) for f in frames]
    if main and "script" not in kinds:
        return f"not in the script (starting or exiting), at {_line(frames[-1])}", kinds[-1] == "distributed"
    parts = []
    first = (
        kinds.index("script") if "script" in kinds else 0
    )  # the frames before it run the script (runpy, the launcher)
    api = next((f for f, k in zip(frames[first:], kinds[first:]) if k == "torchspan"), None)
    if api is not None:
        parts.append(f"in torchspan's {_name(api)}")
    if any(
        f.f_code.co_name == "backward" and k == "library" and "torch" in f.f_code.co_filename
        for f, k in zip(frames, kinds)
    ):
        parts.append("backward")
    waiting = kinds[-1] == "distributed"
    mine = [f for f, k in zip(frames, kinds) if k == "script"] or frames[-1:]
    if waiting:
        parts.append(f"waiting for other ranks in torch.distributed {frames[-1].f_code.co_name}()")
        if mine[-1] is not frames[-1]:
            parts.append(f"called from {_line(mine[-1])}")
    else:
        parts.append(f"at {_line(mine[-1])}")
        if mine[-1] is not frames[-1]:
            parts.append(
                f"inside {_name(frames[-1])} "
                f"({Path(frames[-1].f_code.co_filename).name}:{frames[-1].f_lineno})"
            )
    return ", ".join(parts), waiting


def _threads_doing(skip: int | None) -> tuple[str, bool]:
    """What the main thread does; where it only waits for its own threads (a pipeline's stages), theirs."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    text, waiting = doing(frames.get(main))
    top = frames.get(main)
    if (
        top is not None
        and _kind(top.f_code.co_filename) == "library"
        and top.f_code.co_filename.endswith("threading.py")
    ):
        others = [
            (names.get(i, str(i)), doing(f, main=False))
            for i, f in frames.items()
            if i not in (main, skip) and _involved(f)
        ]
        if others:
            text = "; ".join(f"thread {n}: {d[0]}" for n, d in others)
            waiting = all(d[1] for _, d in others)
    return text, waiting


def _involved(frame: FrameType | None) -> bool:
    """True for a thread running the script's code or torchspan's (not an idle helper thread)."""
    return any(_kind(f.f_code.co_filename) in ("script", "torchspan") for f in _stack(frame))


def _collectives() -> int | None:
    """How many collectives this rank issued on its default process group (gloo and nccl count them)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.group.WORLD._get_sequence_number_for_group())  # type: ignore[union-attr]
    except Exception:  # pragma: no cover - best effort
        pass
    return None


# --------------------------------------------------------------------------- the beating thread
class Heartbeat:
    """A daemon thread writing this rank's beat every ``interval`` seconds until ``stop``."""

    def __init__(self, folder: Path, rank: int, parent: int | None, interval: float = INTERVAL_S) -> None:
        self.path = folder / f"rank{rank}.json"
        self.rank, self.parent, self.interval = rank, parent, interval
        self.local_rank = int(os.environ.get("LOCAL_RANK", rank))
        self.started = time.time()
        self._since: tuple[str, float] = ("", self.started)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchspan-heartbeat", daemon=True)

    def beat(self) -> dict[str, Any]:
        """Write one beat now (what the threads do); returns it."""
        text, waiting = _threads_doing(self._thread.ident)
        now = time.time()
        if text != self._since[0]:
            self._since = (text, now)
        return self._write(now, doing=text, waiting=waiting, since=self._since[1])

    def _write(self, now: float, **what: Any) -> dict[str, Any]:
        from .env import current_timeout

        beat = {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": now,
            "started": self.started,
            "seq": _collectives(),
            "timeout": current_timeout(),
            **what,
        }
        write_text(self.path, json.dumps(beat), name="heartbeat")
        return beat

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.parent is not None and os.getppid() != self.parent:  # the launcher is gone
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                self.beat()
            except Exception:  # pragma: no cover - a full disk must not stop the training
                pass
            self._stop.wait(self.interval)

    def start(self) -> Heartbeat:
        self._thread.start()
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Stop beating (at exit: the thread ends before the interpreter's teardown)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval)

    def finish(self) -> None:
        """The script returned: stop, and leave a last beat saying so (a peer still waiting for this rank
        waits for a collective it will never run)."""
        self.stop()
        now = time.time()
        try:
            self._write(now, doing="finished its script", waiting=False, since=now, finished=True)
        except OSError:  # pragma: no cover - best effort
            pass


def start(
    folder: str | os.PathLike[str], rank: int, parent: int | None = None, interval: float = INTERVAL_S
) -> Heartbeat:
    """Start this rank's heartbeat into ``folder`` (created); ``parent``: end this process when its parent pid
    changes."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Heartbeat(Path(folder), rank, parent, interval).start()


def die_with_parent(parent: int) -> None:
    """End this process with SIGKILL when its parent (the launcher, pid ``parent``) dies, or now if it already
    has.

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, done by the kernel even when the process is frozen;
    elsewhere the heartbeat thread polls the parent pid."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - no prctl: the heartbeat thread polls
            pass
    if os.getppid() != parent:  # it died before the call above
        os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------- errors
def waited_for_peer(kind: str, message: str) -> bool:
    """True where an error only says this rank lost a peer or timed out waiting for one."""
    text = message.lower()
    return kind in _PEER_TYPES or (kind in _RUNTIME_TYPES and any(marker in text for marker in _PEER_WAIT))


def script_frames(tb: TracebackType | None, exc: BaseException) -> str:
    """A traceback of the script's own frames (runs of torchspan, torch and library frames shown as one
    line)."""
    lines = ["Traceback (most recent call last):"]
    hidden: list[str] = []
    for frame, lineno in traceback.walk_tb(tb):
        kind = _kind(frame.f_code.co_filename)
        if kind == "script":
            if hidden:
                lines.append(f"  [{len(hidden)} frame(s) in {', '.join(dict.fromkeys(hidden))}]")
                hidden = []
            summary = traceback.FrameSummary(frame.f_code.co_filename, lineno, frame.f_code.co_name)
            lines.extend(traceback.format_list([summary])[0].rstrip("\n").splitlines())
        elif len(lines) > 1:  # frames before the script's first one run it (runpy, the launcher): not shown
            hidden.append(
                "torchspan"
                if kind == "torchspan"
                else "torch"
                if "torch" in frame.f_code.co_filename
                else "python"
            )
    if hidden and len(lines) > 1:
        lines.append(f"  [{len(hidden)} frame(s) in {', '.join(dict.fromkeys(hidden))}]")
    lines.extend(line.rstrip("\n") for line in traceback.format_exception_only(type(exc), exc))
    return "\n".join(lines)


def record_error(folder: str | os.PathLike[str], rank: int, exc: BaseException) -> Path:
    """Write what ended this rank: ``rank<R>.traceback.txt`` (the full traceback) and ``rank<R>.error.json``
    (type, message, the script's frames, whether it only waited for a peer); returns the traceback's path."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    full = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    trace = write_text(path / f"rank{rank}.traceback.txt", full, name="traceback")
    kind, message = type(exc).__name__, str(exc)
    record = {
        "rank": rank,
        "pid": os.getpid(),
        "time": time.time(),
        "type": kind,
        "message": message,
        "script_frames": script_frames(exc.__traceback__, exc),
        "waited": waited_for_peer(kind, message),
        "traceback": str(trace),
    }
    write_text(path / f"rank{rank}.error.json", json.dumps(record), name="error record")
    return trace


def _read(paths: Iterable[Path]) -> dict[int, dict[str, Any]]:
    out = {}
    for p in paths:
        try:
            record = json.loads(p.read_text())
            out[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):  # half a file from a killed writer: skip it
            continue
    return out


def read_beats(folder: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """The last beat of each rank that wrote one in ``folder``, by rank."""
    folder = Path(folder)
    return _read(p for p in folder.glob("rank*.json") if p.stem[4:].isdigit()) if folder.is_dir() else {}


def read_errors(folder: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """The errors ranks recorded in ``folder`` (``record_error``), by rank."""
    return _read(Path(folder).glob("rank*.error.json")) if Path(folder).is_dir() else {}

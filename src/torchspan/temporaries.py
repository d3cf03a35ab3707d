"""The names torchspan gives its temporary files and folders, and whether a temporary's writer is gone.

A temporary of ``NAME`` is ``.NAME.torchspan.PID.TOKEN.HOST.tmp`` (``.old`` for a folder renamed aside): the
pid and host say whose it is, so :func:`torchspan.files.clean_temporaries` removes only those whose writer on
this machine is dead (or, another machine's, older than this process). Temporaries this process is writing now
are in ``ACTIVE`` (under ``ACTIVE_LOCK``) and are never stale.

Usage::

    tmp = temporary(target)                      # a fresh name beside target
    with ACTIVE_LOCK:
        ACTIVE.add(str(tmp))
    stale(Path(entry), entry_name[len(prefix(target)):], process_started())
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import threading
import time
from pathlib import Path

_MARK = "torchspan"  # .NAME.torchspan.PID.TOKEN.HOST.tmp
_NAME_MAX = 150  # characters of the target's name kept in a temporary's name (NAME_MAX is 255)
ACTIVE: set[str] = set()  # temporaries this process is writing now (threads included)
ACTIVE_LOCK = threading.Lock()
_IMPORTED = time.time()


def host() -> str:
    """This machine's name as it goes into a temporary's name (letters, digits and '-', at most 32)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:32] or "host"


def prefix(target: Path) -> str:
    """What every temporary of ``target`` starts with: ``.NAME.torchspan.``."""
    return f".{target.name[:_NAME_MAX]}.{_MARK}."


def temporary(target: Path, suffix: str = "tmp") -> Path:
    """A fresh temporary name beside ``target``: ``.NAME.torchspan.PID.TOKEN.HOST.<suffix>``."""
    return target.with_name(f"{prefix(target)}{os.getpid()}.{secrets.token_hex(4)}.{host()}.{suffix}")


def _started(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), from ``/proc``; ``None`` where unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            ticks = int(fh.read().rpartition(")")[2].split()[19])
        with open("/proc/stat", encoding="ascii") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def process_started() -> float:
    """When this process started (from ``/proc``; the import time where that is unknown)."""
    started = _started(os.getpid())
    return started if started is not None else _IMPORTED


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def stale(entry: Path, rest: str, since: float) -> bool:
    """Whether the temporary ``entry`` (``rest``: its name after ``.NAME.torchspan.``) has no live writer."""
    try:
        changed = entry.lstat().st_mtime
    except FileNotFoundError:
        return False
    if str(entry) in ACTIVE:
        return False
    match = re.fullmatch(r"(\d+)\.[0-9a-f]+\.([A-Za-z0-9-]+)\.(?:tmp|old)", rest)
    if match is None or match.group(2) != host():  # another machine's pid means nothing here: go by age
        return changed < since
    pid = int(match.group(1))
    if pid == os.getpid():
        return True  # ours, and not being written: a write of ours that failed to clean up
    if not _alive(pid):
        return True
    started = _started(pid)
    return started is not None and started > changed + 1.0  # the pid was reused after the writer died

"""Writing files safely: every file torchspan writes (plans, reports, pictures, JSON, checkpoints) goes
through here.

- **Atomic**: the bytes go to a temporary file beside the target, then ``os.replace`` puts it in place,
  so a reader sees the old file or the new one, never half of one; ``durable=True`` (checkpoints) also
  fsyncs the file and its folder, so a crash right after the save keeps it.
- **Into the real target**: a symbolic link is followed, and the file it points to is replaced (the
  link stays a link); the temporary is made in the real target's folder.
- **Regular files only**: a folder, a device, a FIFO or a socket at the path is refused with a
  ``ValueError`` naming the argument and what is there, before anything is written.
- **Checked first**: :func:`output_file` and :func:`output_folder` check a location (its folder
  exists and is writable, nothing but a regular file is in the way) so that commands refuse a bad
  ``--out`` before they train or profile, not after.
- **Recognisable temporaries**: ``.NAME.torchspan.PID.TOKEN.HOST.tmp``. A write killed midway leaves
  one; :func:`clean_temporaries` (run by every atomic write and by ``load_checkpoint``) removes the
  ones whose writer is dead (same host, pid gone or reused) or, for another host's and unnamed ones,
  whose last change is older than this process. A live writer's temporary is never touched.
- **Folders too** (sharded checkpoints): :func:`temporary_folder` makes an empty temporary folder
  beside the target, the writers fill it, :func:`replace_folder` swaps it in whole: one
  ``renameat2(RENAME_EXCHANGE)`` where the filesystem has it (a reader sees the old folder or the new
  one, never neither), else the old folder is renamed aside (``.NAME.torchspan.PID.TOKEN.HOST.old``)
  and the new one renamed in; a writer killed between those two renames leaves no target, and
  :func:`clean_temporaries` renames that ``.old`` folder back. Stale temporary folders are removed. What is
  not the writer's (``keep``: a user's notes in a checkpoint folder) is linked into the new folder before the
  swap.

Usage::

    target = output_file(args.out, name="--out")              # before the slow work
    write_text(target, plan.to_json() + "\\n", name="--out")
    with atomic_open("ckpt.pt", "wb", durable=True) as f:
        torch.save(state, f)
    tmp = temporary_folder("ckpt")                             # fill it (every rank of a job), then
    replace_folder(tmp, "ckpt")                                # the previous "ckpt" folder or this one, whole
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from .temporaries import ACTIVE as _ACTIVE
from .temporaries import ACTIVE_LOCK as _ACTIVE_LOCK
from .temporaries import prefix as _prefix
from .temporaries import process_started as _this_process_started
from .temporaries import stale as _stale
from .temporaries import temporary as _temporary

__all__ = [
    "atomic_open",
    "clean_temporaries",
    "describe",
    "output_file",
    "output_folder",
    "real_target",
    "replace_folder",
    "require_regular_file",
    "temporary_folder",
    "write_bytes",
    "write_text",
]


def _shown(name: str, value: Any) -> str:
    """``--out 'x'`` for a command-line option, ``path='x'`` for an API argument."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else value
    return f"{name} {text!r}" if name.startswith("-") or name.isupper() else f"{name}={text!r}"


def describe(path: str | os.PathLike[str]) -> str:
    """What is at ``path`` in a few words: ``"a regular file"``, ``"a folder"``, ``"a character device"``,
    ``"a FIFO (named pipe)"``, ``"a socket"``, ``"a block device"``, ``"missing"`` (symbolic links
    followed)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except NotADirectoryError:
        return "missing (a part of its path is a file, not a folder)"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    for test, words in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return words
    return "not a regular file"  # pragma: no cover - doors, whiteouts


def require_regular_file(
    path: str | os.PathLike[str], *, name: str = "path", what: str = "a file", fix: str = ""
) -> Path:
    """``path`` when a regular file is there (a link to one counts); else a one-line ``ValueError`` that names
    ``name``, the value, what is there instead and ``fix`` (e.g. ``"give the path of a Python file, e.g.
    train.py"``)."""
    found = describe(path)
    if found == "a regular file":
        return Path(path)
    there = "does not exist" if found.startswith("missing") else f"is {found}, not {what}"
    raise ValueError(f"{_shown(name, path)} {there}" + (f"; {fix}" if fix else ""))


def real_target(path: str | os.PathLike[str]) -> Path:
    """The file a write to ``path`` changes: ``path`` with every symbolic link resolved (a dangling link: the
    file it names)."""
    return Path(os.path.realpath(os.fspath(path)))


def output_file(
    path: str | os.PathLike[str], *, name: str = "path", make_parent: bool = False, example: str = "out.json"
) -> Path:
    """Check that a file can be written at ``path`` before any work; returns its real target.

    Refused with a one-line ``ValueError`` naming ``name`` and ``path`` (``example``: a file name for the
    advice): a folder, device, FIFO or socket at the path (or at the end of its links), a folder that does
    not exist (``make_parent=True`` creates it), a part of the path that is a file, a folder this process
    cannot write to.
    """
    shown, fix = _shown(name, path), f"name a file, e.g. {_shown(name, example)}"
    if not os.fspath(path):
        raise ValueError(f"{shown} is empty; {fix}")
    target = real_target(path)
    found = describe(target)
    if found != "a regular file" and not found.startswith("missing"):
        if found == "a folder":
            fix = f"name a file inside it, e.g. {_shown(name, os.path.join(os.fspath(path), example))}"
        via = (
            f" (where its link points: {str(target)!r})"
            if str(target) != os.path.abspath(os.fspath(path))
            else ""
        )
        raise ValueError(f"{shown} is {found}{via}; torchspan writes only regular files: {fix}")
    _writable_folder(target.parent, shown, make_parent, fix)
    return target


def output_folder(
    path: str | os.PathLike[str], *, name: str = "out", files: Iterable[str] = (), example: str = "run-out"
) -> Path:
    """Check that the folder ``path`` exists or can be created, is writable, and that each of ``files`` in it
    could be written; nothing is created. Returns ``Path(path)``. A one-line ``ValueError`` otherwise
    (``example``: a folder name for the advice)."""
    shown, fix = _shown(name, path), f"name a folder (it is created if missing), e.g. {_shown(name, example)}"
    if not os.fspath(path):
        raise ValueError(f"{shown} is empty; {fix}")
    folder = Path(path)
    found = describe(folder)
    if found.startswith("missing"):
        _creatable(folder, shown, fix)
        return folder
    if found != "a folder":
        raise ValueError(f"{shown} is {'a file' if found == 'a regular file' else found}; {fix}")
    _writable_folder(real_target(folder), shown, False, fix)
    for file in files:
        there = describe(folder / file)
        if there != "a regular file" and not there.startswith("missing"):
            raise ValueError(
                f"{shown}: {str(folder / file)!r} is {there}, where torchspan writes {file}; move it away "
                f"or {fix}"
            )
    return folder


def _creatable(folder: Path, shown: str, fix: str) -> None:
    """The nearest existing folder above ``folder`` is a writable folder (so ``mkdir(parents=True)``
    works)."""
    above = folder.absolute().parent
    while describe(above).startswith("missing") and above.parent != above:
        above = above.parent
    found = describe(above)
    if found != "a folder":
        raise ValueError(f"{shown}: {str(above)!r} is {found}, so nothing can be created under it; {fix}")
    _writable_folder(real_target(above), shown, False, fix)


def _writable_folder(folder: Path, shown: str, make: bool, fix: str) -> None:
    found = describe(folder)
    if found.startswith("missing"):
        _creatable(folder, shown, fix)  # a file in the way is named as such
        if not make:
            raise ValueError(f"{shown}: folder {str(folder)!r} does not exist; create it first")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(
                f"{shown}: cannot create its folder {str(folder)!r} ({exc.strerror or exc}); {fix} in a "
                "folder you can write to"
            ) from None
        return
    if found != "a folder":
        raise ValueError(f"{shown}: {str(folder)!r} is {found}, so nothing can be created under it; {fix}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(
            f"{shown}: cannot write in folder {str(folder)!r} (permission denied or read-only); {fix} in a "
            "folder you can write to"
        )


# --------------------------------------------------------------------------- atomic writes


@contextlib.contextmanager
def atomic_open(
    path: str | os.PathLike[str],
    mode: str = "wb",
    *,
    name: str = "path",
    durable: bool = False,
    make_parent: bool = False,
) -> Iterator[IO[Any]]:
    """A file object whose contents replace ``path``'s real target when the block ends without an exception
    (and are discarded when it raises). ``mode`` is ``"wb"`` or ``"w"`` (UTF-8). ``durable=True`` fsyncs the
    file and its folder; ``make_parent=True`` creates a missing folder. The target keeps its permission
    bits; a new file gets the umask's. Refusals (see :func:`output_file`) come before anything is written.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"mode={mode!r} must be 'wb' or 'w'")
    target = output_file(path, name=name, make_parent=make_parent)
    clean_temporaries(target)
    tmp = _open_temporary(target)
    try:
        with open(tmp, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as fh:
            yield fh
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        _keep_mode(target, tmp)
        if describe(target) not in (
            "a regular file",
            "missing",
        ):  # something else appeared meanwhile (a folder, a device)
            raise ValueError(
                f"{_shown(name, path)} became {describe(target)} while it was written; nothing was replaced"
            )
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(str(tmp))
    if durable:
        _fsync_folder(target.parent)


def _open_temporary(target: Path) -> Path:
    """Create an empty temporary beside ``target`` (``O_EXCL``: never someone else's) and mark it ours."""
    for _ in range(16):
        tmp = _temporary(target)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:  # pragma: no cover - a 32-bit token collided
            continue
        os.close(fd)
        with _ACTIVE_LOCK:
            _ACTIVE.add(str(tmp))
        return tmp
    raise FileExistsError(f"no free temporary name beside {str(target)!r}")  # pragma: no cover


def _keep_mode(target: Path, tmp: Path) -> None:
    with contextlib.suppress(OSError):
        os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable (skipped where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def write_text(
    path: str | os.PathLike[str],
    text: str,
    *,
    name: str = "path",
    durable: bool = False,
    make_parent: bool = False,
) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns ``Path(path)``."""
    with atomic_open(path, "w", name=name, durable=durable, make_parent=make_parent) as fh:
        fh.write(text)
    return Path(path)


def write_bytes(
    path: str | os.PathLike[str],
    data: bytes,
    *,
    name: str = "path",
    durable: bool = False,
    make_parent: bool = False,
) -> Path:
    """Write ``data`` to ``path`` atomically; returns ``Path(path)``."""
    with atomic_open(path, "wb", name=name, durable=durable, make_parent=make_parent) as fh:
        fh.write(data)
    return Path(path)


# --------------------------------------------------------------------------- leftovers of interrupted writes


def clean_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporaries that interrupted writes of ``path`` left beside its real target; returns them.

    Removed: torchspan's own (``.NAME.torchspan.PID.TOKEN.HOST.tmp``, files or folders) whose writer on this
    machine is dead, and those from another machine or in the older ``.NAME.XXXXXXXX.tmp`` form whose last
    change is older than this process. A temporary a live process (or another thread here) is writing stays.
    A dead writer's ``.old`` folder (the previous folder, renamed aside by :func:`replace_folder`) is renamed
    back when the target is missing (the writer died between its two renames), else removed.
    """
    target = real_target(path)
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return []
    since = _this_process_started()
    prefix, legacy = _prefix(target), re.compile(re.escape(f".{target.name}.") + r"[A-Za-z0-9_]{8}\.tmp")
    removed = []
    for entry in sorted(entries, key=lambda e: e.name):
        if entry.name.startswith(prefix):
            stale = _stale(Path(entry.path), entry.name[len(prefix) :], since)
        elif legacy.fullmatch(entry.name):
            stale = _stale(Path(entry.path), "", since)
        else:
            continue
        if not stale:
            continue
        if (
            entry.name.endswith(".old")
            and entry.is_dir(follow_symlinks=False)
            and describe(target) == "missing"
        ):
            with contextlib.suppress(OSError):
                os.rename(entry.path, target)  # the previous folder back: its replacement never arrived
            continue
        with contextlib.suppress(FileNotFoundError):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            elif entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
            else:
                continue
            removed.append(Path(entry.path))
    return removed


# --------------------------------------------------------------------------- folders written whole


def temporary_folder(path: str | os.PathLike[str]) -> Path:
    """A new empty folder beside ``path``'s real target, named as a temporary of it and marked as this
    process's (so :func:`clean_temporaries` leaves it while this process lives); fill it, then
    :func:`replace_folder`."""
    target = real_target(path)
    for _ in range(16):
        tmp = _temporary(target)
        try:
            os.mkdir(tmp)
        except FileExistsError:  # pragma: no cover - a 32-bit token collided
            continue
        with _ACTIVE_LOCK:
            _ACTIVE.add(str(tmp))
        return tmp
    raise FileExistsError(f"no free temporary name beside {str(target)!r}")  # pragma: no cover


def replace_folder(
    tmp: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    durable: bool = True,
    keep: Callable[[str], bool] | None = None,
) -> None:
    """Put the folder ``tmp`` (from :func:`temporary_folder`, complete) in place of ``path``'s real target and
    remove what was there: a reader sees the previous folder or ``tmp``'s contents, never a mixture.

    Missing target: one ``rename``. A folder there: exchanged with ``tmp`` in one
    ``renameat2(RENAME_EXCHANGE)`` (Linux), then removed; where the filesystem cannot exchange (``EINVAL``,
    ``ENOSYS``, another system), renamed aside to ``.NAME.torchspan.PID.TOKEN.HOST.old``, ``tmp`` renamed in,
    the aside folder removed (a crash between the renames is undone by :func:`clean_temporaries`).
    ``durable=True`` fsyncs ``tmp`` and the parent folder.

    ``keep(name)``: whether the previous folder's entry ``name`` (not the writer's: a user's file) lives on in
    the new one. Each kept entry ``tmp`` lacks is hard-linked into ``tmp`` before the swap (copied where links
    are refused; a folder as a tree of links), so it is there in both and a crash at any point loses it from
    neither; one that appears in the previous folder during the swap is moved over after it.
    """
    tmp, target = Path(tmp), real_target(path)
    try:
        if keep is not None and describe(target) == "a folder":
            _carry(target, tmp, keep)
        if durable:
            _fsync_folder(tmp)
        if describe(target) == "missing":
            os.rename(tmp, target)
        elif _exchange(tmp, target):
            _remove_previous(tmp, target, keep)  # tmp holds the previous folder now
        else:
            aside = _temporary(target, "old")
            os.rename(target, aside)
            os.rename(tmp, target)
            _remove_previous(aside, target, keep)
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(str(tmp))
    if durable:
        _fsync_folder(target.parent)


def _kept(folder: Path, into: Path, keep: Callable[[str], bool]) -> list[os.DirEntry[str]]:
    """``folder``'s entries that ``keep`` keeps and ``into`` does not have (links not followed)."""
    return [e for e in os.scandir(folder) if keep(e.name) and not os.path.lexists(into / e.name)]


def _carry(previous: Path, tmp: Path, keep: Callable[[str], bool]) -> None:
    """Link (or copy) the kept entries of the previous folder into ``tmp``; fifos and sockets move after the
    swap."""
    for entry in _kept(previous, tmp, keep):
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), tmp / entry.name)
        elif entry.is_dir():
            shutil.copytree(entry.path, tmp / entry.name, symlinks=True, copy_function=_link_or_copy)
        elif entry.is_file():
            _link_or_copy(entry.path, tmp / entry.name)


def _link_or_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
        shutil.copy2(src, dst, follow_symlinks=False)


def _remove_previous(previous: Path, target: Path, keep: Callable[[str], bool] | None) -> None:
    """Move what ``keep`` keeps and the new folder lacks (it appeared during the swap) into ``target``, then
    remove the previous folder; a move that fails raises, and the previous folder stays, its entries with
    it."""
    for entry in _kept(previous, target, keep) if keep is not None else ():
        os.rename(entry.path, target / entry.name)
    shutil.rmtree(previous, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    call = getattr(_libc(), "renameat2", None)
    if call is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if call(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"cannot exchange {str(a)!r} and {str(b)!r}: {os.strerror(code)}")


def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - no C library to open (some embedded builds)
        return None

"""Reading ``torch.distributed.checkpoint`` (DCP) folders safely, into a job or into one plain process.

DCP itself unpickles two things with no restriction: the folder's ``.metadata`` (``pickle.load``) and every
non-tensor value (``torch.load(weights_only=False)``: an optimizer's ``param_groups``, plain values), so a
checkpoint folder from elsewhere could run code when loaded. torchspan reads them under the rules of its
single-file checkpoints instead:

- ``.metadata`` through an unpickler that builds only DCP's own metadata classes (``Metadata``,
  ``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``_StorageInfo``...), ``torch.Size``, dtypes, layouts
  and paths; anything else is a one-line ``ValueError`` naming ``trusted=True``.
- values through ``torch.load(weights_only=True)``: tensors, numbers, strings, lists, tuples, dicts.
  ``trusted=True`` lifts both (for folders you trust only). Tensors are read weights-only by DCP already.

:func:`read_full` loads a whole folder (or some of its top-level keys) in this process, without a process
group, as full tensors with the saved keys (a sharded model's own keys, whatever world size wrote it):
what ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` reads, safely.

Usage::

    state = read_full(Path("ckpt"), trusted=False)   # {"model": {...full tensors...}, "optimizer": {...}}
    dcp.load(sd, storage_reader=SafeReader(path, trusted), planner=SafeLoadPlanner(trusted=trusted))
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from .checkpointio import refusal

__all__ = [
    "SafeLoadPlanner",
    "SafeReader",
    "check_shards",
    "checkpoint_error",
    "incomplete",
    "read_full",
    "read_metadata",
]

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, ``torch.Size``, dtypes and layouts; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (
            name == "Size"
            or isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def read_metadata(path: Path, trusted: bool) -> Any:
    """The folder's DCP ``Metadata`` (restricted unpickling unless ``trusted``); a one-line ``ValueError`` for
    a refused object or a damaged file."""
    shown = f"load_checkpoint({str(path)!r})"
    try:
        with open(path / ".metadata", "rb") as fh:
            return pickle.load(fh) if trusted else _MetadataUnpickler(fh).load()
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if text.startswith("GLOBAL "):
            raise refusal(shown, text[len("GLOBAL ") :] + " (in its .metadata)", path) from None
        raise _damaged(shown, exc) from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise _damaged(shown, exc) from None


def incomplete(folder: Path, what: str) -> ValueError:
    """The refusal of a checkpoint folder missing a part (``what``: which, in words)."""
    return ValueError(
        f"load_checkpoint({str(folder)!r}): the checkpoint is incomplete: {what}; restore the folder from "
        "a copy, or delete it to start afresh (a save killed midway leaves the previous folder whole: a "
        "part was removed or lost since)"
    )


def check_shards(folder: Path, metadata: Any) -> None:
    """Every file the ``.metadata`` points into is in ``folder`` and long enough (else :func:`incomplete`): a
    load that starts finds all its parts, none refused halfway with some tensors loaded."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if isinstance(name, str):
            needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(needed.items()):
        try:
            found = (folder / name).stat().st_size
        except FileNotFoundError:
            raise incomplete(folder, f"its .metadata lists the shard {name!r}, which is missing") from None
        if found < size:
            raise incomplete(
                folder,
                f"the shard {name!r} holds {found} bytes, where its .metadata lists {size} (cut short)",
            )


def _damaged(shown: str, exc: BaseException) -> ValueError:
    why = type(exc).__name__ + (f": {str(exc).splitlines()[0][:160]}" if str(exc) else "")
    return ValueError(
        f"{shown}: the folder's .metadata is corrupt or truncated, or it is not a sharded checkpoint "
        f"({why}); restore it from a copy or delete it to start afresh"
    )


class SafeReader(FileSystemReader):
    """DCP's file-system reader whose ``.metadata`` is unpickled under :func:`read_metadata`'s rules."""

    def __init__(self, path: str | Path, trusted: bool = False) -> None:
        super().__init__(path)
        self._folder, self._trusted = Path(path), trusted

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:  # a per-rank metadata file (no collectives): DCP's own reading
            return super().read_metadata(*args, **kwargs) if self._trusted else _refuse_per_rank(self._folder)
        metadata = read_metadata(self._folder, self._trusted)
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _refuse_per_rank(folder: Path) -> Any:
    raise ValueError(
        f"load_checkpoint({str(folder)!r}): per-rank metadata files are read only with trusted=True"
    )


class _SafeBytes:
    """``load_bytes`` by ``torch.load(weights_only=not trusted)`` (DCP's own passes
    ``weights_only=False``)."""

    trusted = False
    folder = Path(".")

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=not self.trusted)
        except pickle.UnpicklingError as exc:
            found = re.search(r"GLOBAL ([\w.]+)", str(exc))
            shown = f"load_checkpoint({str(self.folder)!r})"
            raise refusal(
                shown,
                f"{found.group(1) if found else 'an object'} (in {read_item.dest_index.fqn})",
                self.folder,
            ) from None
        super().load_bytes(read_item, io.BytesIO(_resaved(loaded)))  # type: ignore[misc]


def _resaved(value: Any) -> bytes:
    """``value`` as ``torch.save`` bytes: DCP's ``load_bytes`` unpickles them again (now known to be safe)."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """DCP's default load planner (into a given state dict, resharded) with safe values."""

    def __init__(self, *args: Any, trusted: bool = False, folder: Path = Path("."), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trusted, self.folder = trusted, folder


class _SafeEmptyPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """DCP's planner that builds the state dict from the metadata (full tensors), with safe values."""

    def __init__(
        self, keys: set[str] | None = None, *, trusted: bool = False, folder: Path = Path(".")
    ) -> None:
        super().__init__(keys=keys)
        self.trusted, self.folder = trusted, folder

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        """DCP rebuilds the state dict in the order the ranks' write items came (a tensor-parallel model's
        split tensors first, each replicated one where its writer's items fall); ``planner_data`` keeps the
        state dict's own order (every rank's keys, flattened), so the full tensors come back with the model's
        key order."""
        order = getattr(metadata, "planner_data", None)
        if isinstance(order, dict):
            saved = metadata.state_dict_metadata
            metadata.state_dict_metadata = {k: saved[k] for k in order if k in saved} | saved
        super().set_up_planner(state_dict, metadata, is_coordinator)


def read_full(path: Path, trusted: bool = False, keys: set[str] | None = None) -> dict[str, Any]:
    """Every saved value in this process, without a process group: full tensors (on the CPU) under the saved
    keys, nested as saved (``{"model": {"lm_head.weight": ...}, "optimizer": {...}}``); ``keys``: only these
    top-level keys. Reads each tensor whole, so the whole model is in this process's memory."""
    check_shards(
        path, read_metadata(path, trusted)
    )  # its refusal in one line (DCP would retry per-rank files and hide it)
    state: dict[str, Any] = {}
    planner = _SafeEmptyPlanner(keys, trusted=trusted, folder=path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            _load_state_dict(state, storage_reader=SafeReader(path, trusted), planner=planner, no_dist=True)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            raise checkpoint_error(exc, path) from None
    return state


def checkpoint_error(exc: BaseException, path: Path) -> BaseException:
    """What to raise for DCP's failure ``exc``: a ``ValueError`` of ours inside it (a refusal), a one-line
    ``ValueError`` for DCP's own errors (a damaged folder), or ``exc`` itself (interrupts, exits)."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit, MemoryError)):
        return exc
    failures = getattr(exc, "failures", None)
    inner = [
        pair[0] if isinstance(pair, tuple) else getattr(pair, "exc", pair)
        for pair in (failures or {}).values()
    ]
    for found in [exc, *inner]:
        if isinstance(found, ValueError) and str(found).startswith("load_checkpoint("):
            return found
    first = inner[0] if inner else exc
    text = str(first).strip().splitlines()
    why = type(first).__name__ + (f": {text[-1][:200]}" if text else "")
    return ValueError(
        f"load_checkpoint({str(path)!r}): the sharded checkpoint could not be read ({why}); it may be "
        "damaged or not match what it is loaded into (keys, shapes): restore it from a copy or delete it "
        "to start afresh"
    )

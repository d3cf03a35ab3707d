"""Checkpoints for a launched job: written once (rank 0) atomically.

Data parallel: replicas are identical, so one rank writes for all and any world size loads it.
Pipelines: a rank holds only its stage (other stages' tensors are ``meta``), so when any rank's
state has a ``meta`` tensor, the writer gathers every rank's state into the one file
(``{"torchspan_ranks": [state of rank 0, ...]}``) and ``load_checkpoint`` gives each rank its own
back (a job of the same size and layout resumes it; another size is refused, never half-loaded).

Files (``torchspan.files``): the checkpoint appears whole or not at all (a temporary file beside the
real target of a link, fsynced, then ``os.replace`` onto the name and the folder fsynced), so a job
killed mid-save leaves the previous checkpoint intact; the temporary such a kill leaves is removed by
the next save or load of the same checkpoint. A path that is not a regular file (a folder, a device)
or whose folder is missing is refused on every rank before anything is gathered or written.

Loading is safe by default: ``torch.load(weights_only=True)`` reads tensors, numbers, strings,
``None``, lists, tuples, dicts (state dicts and optimizer states, the per-rank layout above) and runs
no code from the file. A file that needs other objects (a pickled class or function, numpy values)
is refused with a one-line ``ValueError`` naming ``trusted=True``, the opt-in for files you trust;
``save_checkpoint`` warns when what it wrote would need it. A corrupt or truncated file is a one-line
``ValueError`` naming the path. Keys are the model's own (``replica.state_dict()``, no ``module.``
prefix), so any world size, one process included, loads them.

Usage::

    save_checkpoint("ckpt.pt", {"model": replica.state_dict(), "optimizer": opt.state_dict(), "step": step})
    state = load_checkpoint("ckpt.pt")        # None when there is none yet (first start)
    state = load_checkpoint("theirs.pt", trusted=True)   # only for a file you trust: it may run code
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves, tree_map

from ... import files

__all__ = ["save_checkpoint", "load_checkpoint", "model_keys"]

_RANKS = "torchspan_ranks"  # a pipeline job's checkpoint: one state per rank


def model_keys(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state_dict`` with the model's own keys: the ``module.`` prefix that DataParallel/DDP checkpoints
    put on every key is dropped (a dict with any other key is returned as it is).

    Usage: ``model.load_state_dict(model_keys(torch.load("ddp.pt")))``.
    """
    if state_dict and all(k.startswith("module.") for k in state_dict):
        return {k[len("module.") :]: v for k, v in state_dict.items()}
    return state_dict


def _group_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any], *, writer: int = 0, barrier: bool = True) -> bool:
    """Write ``state`` to ``path`` from rank ``writer`` only; returns True on the rank that wrote.

    Call it on every rank: with ``barrier=True`` (default) all ranks wait until the file is in
    place, so none reads an older checkpoint afterwards. A pipeline rank's state (``meta`` tensors
    for other stages) is gathered with every other rank's into the one file.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state={type(state).__name__} must be a mapping, e.g. {{'model': replica.state_dict(), 'step': step}}")
    world = _group_size()
    if isinstance(writer, bool) or not isinstance(writer, int) or not 0 <= writer < world:
        raise ValueError(f"writer={writer!r} must be a rank in [0, world size {world})")
    target = Path(path)
    problem = _unwritable(target) if _rank() == writer else None
    if world > 1:
        meta, unwritable = _any_rank(_holds_meta(state), problem is not None)
        if unwritable:  # every rank stops here, none waits at a barrier for a writer that gave up
            raise problem or ValueError(f"path={str(path)!r}: rank {writer}, which writes the checkpoint, cannot write it (see its error); nothing was saved")
        if meta:  # a pipeline: each rank holds only its stage
            states: list[Any] | None = [None] * world if _rank() == writer else None
            dist.gather_object(tree_map(_to_cpu, dict(state)), states, dst=writer)
            if states is not None:
                state = {_RANKS: states, "world_size": world}
    elif problem is not None:
        raise problem
    wrote = False
    if _rank() == writer:
        with files.atomic_open(target, "wb", name="path", durable=True) as f:
            torch.save(dict(state), f)
        _warn_if_unsafe(target)
        wrote = True
    if barrier and world > 1:
        dist.barrier()
    return wrote


def _unwritable(target: Path) -> ValueError | None:
    try:
        files.output_file(target, name="path", example="ckpt.pt")
    except ValueError as exc:
        return exc
    return None


def _warn_if_unsafe(target: Path) -> None:
    """Warn when the file just written needs objects a weights-only load refuses (``trusted=True`` to load)."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(target)
    except Exception:  # pragma: no cover - an older torch or an unreadable file: the load says so
        return
    if unsafe:
        warnings.warn(
            f"the checkpoint {str(target)!r} holds {', '.join(unsafe)}: load_checkpoint refuses such objects unless "
            "trusted=True; save plain values instead (tensors, numbers, strings, lists, dicts: e.g. float(x), "
            "torch.from_numpy(a), vars(namespace))",
            stacklevel=3,
        )


def _holds_meta(state: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves(state))


def _to_cpu(x: Any) -> Any:
    return x.detach().cpu() if isinstance(x, torch.Tensor) and not x.is_meta else x


def _any_rank(*flags: bool) -> tuple[bool, ...]:
    """Each of ``flags`` OR-ed over all ranks (a collective: every rank calls ``save_checkpoint``)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([int(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in t.tolist())


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu", *, trusted: bool = False) -> dict[str, Any] | None:
    """The state saved at ``path``, its tensors on ``map_location``; ``None`` when the file does not exist.

    Safe by default (``weights_only=True``: tensors, numbers, strings, lists, tuples, dicts; no code from the
    file runs). ``trusted=True`` loads any pickled object, which can run arbitrary code: only for a file
    you trust. Leftover temporaries of interrupted saves of ``path`` are removed.
    """
    target = Path(path)
    if not os.fspath(path) or not target.exists():
        return None
    files.require_regular_file(target, name="path", what="a checkpoint file", fix="name the file save_checkpoint wrote")
    files.clean_temporaries(target)
    state = _load(target, map_location, trusted)
    if not isinstance(state, dict):
        raise ValueError(f"{str(path)!r} holds a {type(state).__name__}, not a checkpoint dict written by save_checkpoint")
    if _RANKS in state:
        saved, world = state[_RANKS], _group_size()
        if len(saved) != world:
            raise ValueError(
                f"{str(path)!r} was written by a pipeline job of {len(saved)} ranks (one state per rank: each held only its "
                f"stage), but this job has {world}; resume it with {len(saved)} processes and the same stages"
            )
        return saved[_rank()]
    return state


def _load(target: Path, map_location: Any, trusted: bool) -> Any:
    """``torch.load``; its refusals and a damaged file's errors as one line naming the path and what to do."""
    shown = f"load_checkpoint({str(target)!r})"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*pickle protocol.*", category=UserWarning)
            return torch.load(target, map_location=map_location, weights_only=not trusted)
    except MemoryError:
        raise
    except Exception as exc:
        text = str(exc)
        found = re.search(r"GLOBAL ([\w.]+)", text)
        if not trusted and "Weights only load failed" in text and found:
            raise ValueError(
                f"{shown}: the file needs {found.group(1)}, which a safe (weights-only) load refuses: loading it could run "
                f"code from the file. If you trust the file, load it with load_checkpoint({str(target)!r}, trusted=True)"
            ) from None
        why = type(exc).__name__ + (f": {_gist(text)}" if _gist(text) else "")
        raise ValueError(
            f"{shown}: the file is corrupt or truncated, or not a torch checkpoint ({why}); restore it from a copy "
            "or delete it to start afresh"
        ) from None


def _gist(text: str) -> str:
    """The telling part of a ``torch.load`` error: its first line that is not boilerplate, up to the first sentence."""
    boiler = ("Weights only load failed", "Please file an issue", "Check the documentation", "In PyTorch 2.6")
    for line in text.splitlines():
        line = line.strip()
        if line and not any(b in line for b in boiler):
            return line.split(". ")[0].rstrip(".")[:160]
    return ""

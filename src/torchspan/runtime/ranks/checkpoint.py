"""Checkpoints for a launched job: written once (rank 0) atomically.

Data parallel: replicas are identical, so one rank writes for all and any world size loads it.
Pipelines: a rank holds only its stage (other stages' tensors are ``meta``), so when any rank's
state has a ``meta`` tensor, the writer gathers every rank's state into the one file
(``{"torchspan_ranks": [state of rank 0, ...]}``) and ``load_checkpoint`` gives each rank its own
back (a job of the same size and layout resumes it; another size is refused, never half-loaded). The file appears whole or not at all: a
temporary file in the same directory, flushed and fsynced, then ``os.replace`` onto the name (and
the directory fsynced), so a job killed mid-save leaves the previous checkpoint intact. Keys are
the model's own (``replica.state_dict()``, no ``module.`` prefix), so any world size, one process
included, loads them.

Usage::

    save_checkpoint("ckpt.pt", {"model": replica.state_dict(), "optimizer": opt.state_dict(), "step": step})
    state = load_checkpoint("ckpt.pt")        # None when there is none yet (first start)
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves, tree_map

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
    wrote = False
    if world > 1 and _any_rank(_holds_meta(state)):  # a pipeline: each rank holds only its stage
        states: list[Any] | None = [None] * world if _rank() == writer else None
        dist.gather_object(tree_map(_to_cpu, dict(state)), states, dst=writer)
        if states is not None:
            state = {_RANKS: states, "world_size": world}
    if _rank() == writer:
        if not target.parent.is_dir():
            raise ValueError(f"path={str(path)!r}: directory {str(target.parent)!r} does not exist; create it first")
        _write_atomically(target, dict(state))
        wrote = True
    if barrier and world > 1:
        dist.barrier()
    return wrote


def _holds_meta(state: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves(state))


def _to_cpu(x: Any) -> Any:
    return x.detach().cpu() if isinstance(x, torch.Tensor) and not x.is_meta else x


def _any_rank(flag: bool) -> bool:
    """``flag`` OR-ed over all ranks (a collective: every rank calls ``save_checkpoint``)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _write_atomically(target: Path, state: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(target.parent, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(dir_fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any] | None:
    """The state saved at ``path``, its tensors on ``map_location``; ``None`` when the file does not exist."""
    target = Path(path)
    if not target.exists():
        return None
    state = torch.load(target, map_location=map_location, weights_only=False)
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

"""Checkpoints for a launched job (or one process): one file written by rank 0, or a sharded folder.

Two forms, chosen by what ``state`` holds:

- **A sharded folder** (``ranks.dcp``, on ``torch.distributed.checkpoint``) when ``state`` holds a model (a
  ``Spanned``, any ``nn.Module``), an optimizer or ``DTensor`` shards: ``{"model": spanned, "optimizer": opt,
  "step": 3}``. Every rank writes its own shards (nothing is gathered on one rank), the folder is swapped in
  whole once all have written, any world size (one plain process included) loads it, and
  ``torchspan.export_safetensors`` turns it into one safetensors file for transformers' ``from_pretrained``.
- **One file** when ``state`` holds state dicts and plain values (``{"model": replica.state_dict(), ...}``),
  as below.

Data parallel: replicas are identical, so one rank writes for all and any world size loads it.
Pipelines: a rank holds only its stage (other stages' tensors are ``meta``), so when any rank's
state has a ``meta`` tensor, the writer gathers every rank's state into the one file
(``{"torchspan_ranks": [state of rank 0, ...]}``) and ``load_checkpoint`` gives each rank its own
back (a job of the same size and layout resumes it; another size is refused, never half-loaded).
A pipeline's sharded folder (``{"model": spanned, ...}``) has no such limit: each rank writes its stage
(``ranks.dcpstages``) and any layout, one process included, loads it.

Files (``torchspan.files``): the checkpoint appears whole or not at all (a temporary file beside the
real target of a link, fsynced, then ``os.replace`` onto the name and the folder fsynced), so a job
killed mid-save leaves the previous checkpoint intact; the temporary such a kill leaves is removed by
the next save or load of the same checkpoint. A path that is not a regular file (a folder, a device)
or whose folder is missing is refused on every rank before anything is gathered or written.

Loading is safe by default: ``torch.load(weights_only=True)`` reads tensors, numbers, strings,
``None``, lists, tuples, dicts (state dicts and optimizer states, the per-rank layout above) and runs
no code from the file (a folder: its ``.metadata`` and values too, ``ranks.dcpread``). A file that needs
other objects (a pickled class or function, numpy values) is refused with a one-line ``ValueError``
naming ``trusted=True``, the opt-in for files you trust; ``save_checkpoint`` warns when what it wrote
would need it. A corrupt or truncated file is a one-line ``ValueError`` naming the path. Keys are the
model's own (``replica.state_dict()``, no ``module.`` prefix), so any world size, one process included,
loads them.

Usage::

    # a sharded folder
    save_checkpoint("ckpt", {"model": spanned, "optimizer": opt, "step": step})
    # loaded in place; state["step"]
    state = load_checkpoint("ckpt", {"model": spanned, "optimizer": opt})
    save_checkpoint("ckpt.pt", {"model": replica.state_dict(), "optimizer": opt.state_dict(), "step": step})
    state = load_checkpoint("ckpt.pt")                   # None when there is none yet (first start)
    state = load_checkpoint("theirs.pt", trusted=True)   # only for a file you trust: it may run code
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from ... import files
from . import dcp, dcpload
from .checkpointio import any_rank, group_size, key_mismatch, missing_key, rank, safe_load, warn_if_unsafe

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


def save_checkpoint(
    path: str | os.PathLike[str], state: Mapping[str, Any], *, writer: int = 0, barrier: bool = True
) -> bool:
    """Write ``state`` to ``path`` from rank ``writer`` only; returns True on the rank that wrote.

    Call it on every rank: with ``barrier=True`` (default) all ranks wait until the file is in
    place, so none reads an older checkpoint afterwards. A pipeline rank's state (``meta`` tensors
    for other stages) is gathered with every other rank's into the one file. A ``state`` holding a
    model, an optimizer or ``DTensor`` shards is a sharded folder instead (``ranks.dcp``): every rank
    writes its shards, rank 0 swaps the folder in and returns True.
    """
    if not isinstance(state, Mapping):
        raise TypeError(
            f"state={type(state).__name__} must be a mapping, e.g. {{'model': replica.state_dict(), "
            "'step': step}"
        )
    if dcp.holds_objects(state):
        if writer != 0:
            raise ValueError(
                f"writer={writer!r}: a sharded checkpoint is written by every rank and put in place by "
                "rank 0; leave writer=0"
            )
        return dcp.save_folder(path, state, barrier=barrier)
    world = group_size()
    if isinstance(writer, bool) or not isinstance(writer, int) or not 0 <= writer < world:
        raise ValueError(f"writer={writer!r} must be a rank in [0, world size {world})")
    target = Path(path)
    problem = _unwritable(target) if rank() == writer else None
    if world > 1:
        meta, unwritable = any_rank(_holds_meta(state), problem is not None)
        if unwritable:  # every rank stops here, none waits at a barrier for a writer that gave up
            raise problem or ValueError(
                f"path={str(path)!r}: rank {writer}, which writes the checkpoint, cannot write it (see its "
                "error); nothing was saved"
            )
        if meta:  # a pipeline: each rank holds only its stage
            states: list[Any] | None = [None] * world if rank() == writer else None
            dist.gather_object(tree_map(_to_cpu, dict(state)), states, dst=writer)
            if states is not None:
                state = {_RANKS: states, "world_size": world}
    elif problem is not None:
        raise problem
    wrote = False
    if rank() == writer:
        with files.atomic_open(target, "wb", name="path", durable=True) as f:
            torch.save(dict(state), f)
        warn_if_unsafe(target)
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


def _holds_meta(state: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves(state))


def _to_cpu(x: Any) -> Any:
    return x.detach().cpu() if isinstance(x, torch.Tensor) and not x.is_meta else x


def load_checkpoint(
    path: str | os.PathLike[str],
    state: Mapping[str, Any] | None = None,
    *,
    map_location: Any = "cpu",
    trusted: bool = False,
    strict: bool = True,
) -> dict[str, Any] | None:
    """The state saved at ``path``; ``None`` when there is none (a first start).

    Without ``state``: what was saved, its tensors on ``map_location`` (a sharded folder: full tensors with
    the model's own keys, read in this process, no process group needed). With ``state`` (call it on every
    rank): its models, optimizers and objects with a ``load_state_dict`` are loaded in place (a sharded
    folder: resharded to this job's world size; a file: each one's ``load_state_dict``), and the saved dict is
    returned with those objects under their keys. ``load_checkpoint(path, "cuda:0")`` (``map_location`` given
    second, the older form) still works.

    Complete or refused, with a one-line ``ValueError`` naming the path and the fix: a key of ``state`` the
    checkpoint lacks, a folder missing a part (its ``values.pt``, ``torchspan.json``, ``.metadata``, a shard),
    and (``strict=True``, as ``load_state_dict``) a model whose keys differ from the saved ones; nothing is
    loaded then. ``strict=False`` loads the keys a model and the checkpoint both have and leaves the rest.

    Safe by default (``weights_only=True``: tensors, numbers, strings, lists, tuples, dicts; no code from the
    file runs). ``trusted=True`` loads any pickled object, which can run arbitrary code: only for a file
    you trust. Leftover temporaries of interrupted saves of ``path`` are removed.
    """
    if isinstance(state, (str, torch.device)) or _is_location(state):
        state, map_location = None, state  # the older positional form: load_checkpoint(path, map_location)
    if state is not None and not isinstance(state, Mapping):
        raise TypeError(
            f"state={type(state).__name__} must be a mapping of what to load into, e.g. {{'model': "
            "spanned, 'optimizer': opt}"
        )
    if state is not None and dcp.loads_into(state):
        return _load_into(path, state, trusted, strict)
    target = Path(path)
    if not os.fspath(path):
        return None
    files.clean_temporaries(
        target
    )  # an interrupted folder swap is undone here, before the target is looked for
    if not target.exists():
        return None
    if dcp.is_folder_checkpoint(target):
        saved = dcpload.read_folder(files.real_target(target), map_location, trusted=trusted)
    else:
        saved = _load_file(target, map_location, trusted)
    _require_keys(target, state or {}, saved)  # a state of plain values names the keys wanted
    return saved


def _is_location(value: Any) -> bool:
    """A ``map_location`` dict given where ``state`` now stands (``{"cuda:1": "cuda:0"}``)."""
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(v, (str, torch.device)) for v in value.values())
    )


def _load_file(target: Path, map_location: Any, trusted: bool) -> dict[str, Any]:
    if target.is_dir() and (target / dcp.MANIFEST).is_file():
        from .dcpread import incomplete

        raise incomplete(
            target,
            f"its .metadata is missing (the {dcp.MANIFEST} beside it shows save_checkpoint wrote the folder)",
        )
    files.require_regular_file(
        target,
        name="path",
        what="a checkpoint file",
        fix="name the file save_checkpoint wrote (or a sharded checkpoint folder, which holds a .metadata)",
    )
    state = safe_load(target, map_location, trusted)
    if not isinstance(state, dict):
        raise ValueError(
            f"{str(target)!r} holds a {type(state).__name__}, not a checkpoint dict written by "
            "save_checkpoint"
        )
    if _RANKS in state:
        saved, world = state[_RANKS], group_size()
        if len(saved) != world:
            raise ValueError(
                f"{str(target)!r} was written by a pipeline job of {len(saved)} ranks (one state per rank: "
                f"each held only its stage), but this job has {world}; resume it with {len(saved)} "
                "processes and the same stages"
            )
        return saved[rank()]
    return state


def _load_into(
    path: str | os.PathLike[str], state: Mapping[str, Any], trusted: bool, strict: bool
) -> dict[str, Any] | None:
    """``state``'s objects loaded in place on every rank (a collective): rank 0 looks for the checkpoint
    (undoing an interrupted swap) and every rank goes by what it found."""
    target = Path(path)
    found = folder = False
    if rank() == 0 and os.fspath(path):
        files.clean_temporaries(target)
        found, folder = target.exists(), dcp.is_folder_checkpoint(target)
    found, folder = any_rank(found, folder)
    if not found:
        return None
    if folder:
        return dcpload.load_into(files.real_target(target), state, trusted=trusted, strict=strict)
    saved = _load_file(target, "cpu", trusted)
    _require_keys(target, state, saved)
    loading = {key: obj for key, obj in state.items() if callable(getattr(obj, "load_state_dict", None))}
    for (
        key,
        obj,
    ) in loading.items():  # every check before the first load: a refusal leaves every object as it was
        if not isinstance(saved[key], Mapping):
            raise ValueError(
                f"load_checkpoint({str(target)!r}): {key!r} holds a {type(saved[key]).__name__}, not a "
                f"state dict to load into the {type(obj).__name__} given; name the key that holds its "
                f"state dict, or leave {key!r} out"
            )
        problem = (
            _model_mismatch(target, key, obj, saved[key]) if strict and isinstance(obj, nn.Module) else None
        )
        if problem is not None:
            raise problem
    for key, obj in loading.items():
        if isinstance(obj, nn.Module):
            obj.load_state_dict(saved[key], strict=strict)
        else:
            obj.load_state_dict(saved[key])
        saved[key] = obj
    return saved


def _require_keys(target: Path, state: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    for key in state:
        if key not in saved:
            raise missing_key(target, key, list(saved))


def _model_mismatch(target: Path, key: str, model: nn.Module, saved: Mapping[str, Any]) -> ValueError | None:
    """``load_state_dict(strict=True)``'s refusal, found before anything is copied (it copies the keys that
    match first); a model's own keys, with or without DDP's ``module.`` prefix, as ``Spanned.load_state_dict``
    takes them."""
    return key_mismatch(target, key, list(model_keys(saved)), list(dcp.unwrap(model).state_dict()))

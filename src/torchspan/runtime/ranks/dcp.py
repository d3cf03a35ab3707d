"""Sharded checkpoints: a folder that every rank writes its own shards into, on
``torch.distributed.checkpoint``.

``save_checkpoint(path, {"model": spanned, "optimizer": opt, "step": 3})``: a state that holds a model (a
``Spanned``, any ``nn.Module``), an optimizer, or a state dict of ``DTensor`` shards is written here, as a DCP
folder; state dicts of plain values keep the one-file form (``ranks.checkpoint``).

- **No rank gathers the model**: each model's state is ``get_model_state_dict`` (a sharded model's
  ``DTensor`` shards; a replica's tensors, written once by DCP's de-duplication), each optimizer's is
  ``get_optimizer_state_dict`` paired with the model whose parameters it holds (keys are parameter names, so
  any world size reads them); ``dcp.save`` writes every rank's part. A pipeline rank writes its stage's
  entries, each copy held by several ranks once (``ranks.dcpstages``). Other values (``step``, losses, an LR
  scheduler's ``state_dict()``) are rank 0's, written beside them in ``values.pt``; ``torchspan.json``
  records what each key is, each model's class, its tied parameters and a transformers model's config.
- **Whole or not at all**: rank 0 makes a temporary folder beside ``path``
  (``.NAME.torchspan.PID.TOKEN.HOST.tmp``) and broadcasts its name; every rank writes into it; DCP's save
  returns on rank 0 only after every rank's data and the ``.metadata`` are written (a rank that fails makes
  it raise on every rank); rank 0 then writes the manifest and swaps the folder in (``files.replace_folder``:
  one atomic exchange), and the ranks agree on the outcome. A job killed at any point leaves the previous
  folder whole; the temporary is removed by the next save or load (its writer is dead). The swap replaces only
  the checkpoint's own files (:func:`own_file`): anything else in the folder (a user's notes, the
  ``model.safetensors`` and ``config.json`` of ``export_safetensors(path, path)``) is linked into the new
  folder first and stays (an export kept so is of the step it was made from).
- **Loading** (``ranks.dcpload``) into objects (``load_checkpoint(path, {"model": spanned, "optimizer":
opt})``, every rank):
  each rank reads the parts of its current shards, whatever world size wrote them (DCP reshards), and
  ``set_state_dict`` puts them in place. Without objects, in any process, with or without a process group:
  full tensors with the model's own keys (``dcpread.read_full``). Both read ``.metadata`` and values under the
  safe rules of ``dcpread`` (``trusted=True`` to lift them).

Usage::

    save_checkpoint("ckpt", {"model": spanned, "optimizer": opt, "step": step})   # every rank
    state = load_checkpoint("ckpt", {"model": spanned, "optimizer": opt})         # None on the first start
    # one plain process: {"model": {name: tensor}, "optimizer": ..., "step": 3}
    full = load_checkpoint("ckpt")
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from ... import files
from .checkpointio import any_rank, group_size, rank, warn_if_unsafe

__all__ = [
    "MANIFEST",
    "VALUES",
    "Parts",
    "holds_objects",
    "is_folder_checkpoint",
    "loads_into",
    "own_file",
    "save_folder",
    "split",
    "unwrap",
]

MANIFEST = "torchspan.json"
VALUES = "values.pt"
_FORMAT = "torchspan sharded checkpoint"
_OWN = re.compile(
    # DCP's files, the manifest, the values
    r"(__\d+)?\.metadata(\.tmp)?|.*\.distcp|torchspan\.json|values\.pt"
    r"|\.(torchspan\.json|values\.pt)\.torchspan\..*"  # their temporaries (files.atomic_open)
)


def _is_dtensor(t: Any) -> bool:
    tensor = sys.modules.get(
        "torch.distributed.tensor"
    )  # not imported yet: no DTensor exists (and none is imported here)
    return tensor is not None and isinstance(t, tensor.DTensor)


def _kind(value: Any) -> str:
    if isinstance(value, nn.Module):
        return "model"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(value, Mapping) and any(_is_dtensor(t) for t in tree_leaves(dict(value))):
        return "tree"
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return "stateful"  # an LR scheduler, a sampler, a scaler: its state_dict() is saved with the values
    return "value"


def holds_objects(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` is written as a sharded (DCP) folder: it holds a model, an optimizer or ``DTensor``
    shards."""
    return any(_kind(v) in ("model", "optimizer", "tree") for v in state.values())


def loads_into(state: Mapping[str, Any]) -> bool:
    """Whether ``load_checkpoint(path, state)`` loads into ``state``'s objects (a model, an optimizer, shards,
    or anything with ``state_dict``/``load_state_dict``)."""
    return any(_kind(v) != "value" for v in state.values())


def own_file(name: str) -> bool:
    """Whether ``name`` in a checkpoint folder is the checkpoint's (DCP's ``.metadata`` and ``.distcp``
    shards, the manifest, the values, their temporaries): a save replaces these and keeps every other entry (a
    user's notes, an export's ``model.safetensors``)."""
    return bool(_OWN.fullmatch(name))


def is_folder_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def unwrap(value: nn.Module) -> nn.Module:
    """The model a ``Spanned``, DDP or DataParallel wraps (its state dict has the model's own keys)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while type(value).__module__ == "torchspan.runtime.spanned" or isinstance(
        value, (DistributedDataParallel, DataParallel)
    ):
        value = value.module  # type: ignore[assignment]
    return value


@dataclass
class Parts:
    """``state`` sorted by what each key holds (``order``: the keys as given)."""

    models: dict[str, nn.Module] = field(default_factory=dict)
    optimizers: dict[str, tuple[torch.optim.Optimizer, str]] = field(
        default_factory=dict
    )  # key -> (optimizer, model key)
    trees: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    stateful: dict[str, Any] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    def kinds(self) -> dict[str, str]:
        found = {
            **{k: "model" for k in self.models},
            **{k: "optimizer" for k in self.optimizers},
            **{k: "tree" for k in self.trees},
        }
        found.update({k: "stateful" for k in self.stateful} | {k: "value" for k in self.values})
        return {k: found[k] for k in self.order}


def split(state: Mapping[str, Any], *, saving: bool) -> Parts:
    """``state`` sorted into models, optimizers (each paired with the model holding its parameters),
    ``DTensor`` state dicts, objects with a state dict, and plain values; ``ValueError`` for what cannot be
    checkpointed."""
    parts = Parts(order=list(state))
    optimizers: dict[str, torch.optim.Optimizer] = {}
    for key, value in state.items():
        if not isinstance(key, str) or not key:
            raise ValueError(
                f"state key {key!r} must be a non-empty string (e.g. 'model', 'optimizer', 'step')"
            )
        kind = _kind(value)
        if kind == "model":
            parts.models[key] = _model(key, value, saving)
        elif kind == "optimizer":
            optimizers[key] = value
        elif kind == "tree":
            parts.trees[key] = value
        elif kind == "stateful":
            parts.stateful[key] = value
        else:
            parts.values[key] = value
    for key, opt in optimizers.items():
        parts.optimizers[key] = (opt, _owner(key, opt, parts.models))
    return parts


def _model(key: str, value: nn.Module, saving: bool) -> nn.Module:
    module = unwrap(value)
    if group_size() > 1 or not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        return module  # a pipeline across ranks: each rank saves or loads its stage (ranks.dcpstages)
    raise ValueError(
        f"the model under {key!r} holds meta tensors (a pipeline rank holds only its stage), and in one "
        f"process no other rank holds them, so a sharded checkpoint cannot "
        f"{'save' if saving else 'load into'} it; materialise it first (model.to_empty(device='cpu')), or "
        "run the pipeline in its launched job"
    )


def _owner(key: str, opt: torch.optim.Optimizer, models: Mapping[str, nn.Module]) -> str:
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    owners = [k for k, m in models.items() if held & {id(p) for p in m.parameters()}]
    if len(owners) != 1:
        where = (
            "none of the models in the state"
            if not owners
            else f"parameters of several models ({', '.join(owners)})"
        )
        raise ValueError(
            f"the optimizer under {key!r} holds {where}; a sharded checkpoint names optimizer state by its "
            "model's parameter names: put the one model it trains in the same state, e.g. {'model': spanned, "
            "'optimizer': opt}"
        )
    return owners[0]


def _state_dicts(parts: Parts) -> dict[str, Any]:
    """What DCP saves or loads into: each model's and optimizer's state dict in this rank's current
    sharding (a pipeline rank's: its stage's entries, ``ranks.dcpstages``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from .dcpstages import held_optimizer_state, holds_meta, stage_state

    staged = {k for k, m in parts.models.items() if holds_meta(m)}
    out: dict[str, Any] = {
        k: stage_state(m) if k in staged else get_model_state_dict(m) for k, m in parts.models.items()
    }
    for key, (opt, owner) in parts.optimizers.items():
        state = get_optimizer_state_dict(parts.models[owner], opt)
        out[key] = held_optimizer_state(state) if owner in staged else state
    out.update({k: dict(v) for k, v in parts.trees.items()})
    return out


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP's warning that one process without a process group saves or loads alone: that is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


# --------------------------------------------------------------------------------------------------- saving


def save_folder(path: str | os.PathLike[str], state: Mapping[str, Any], *, barrier: bool = True) -> bool:
    """Write ``state`` as a sharded checkpoint folder at ``path`` from every rank (call it on every rank);
    returns True on rank 0, which puts the folder in place. See the module docstring."""
    parts = split(state, saving=True)
    coordinator = rank() == 0
    tmp = _begin(path) if group_size() == 1 else _shared_begin(path, coordinator)
    error: BaseException | None = None
    try:
        saved = _state_dicts(parts)
    except Exception as exc:
        error = exc
    if any_rank(error is not None)[0]:  # no rank enters DCP's collectives alone
        _discard(tmp, coordinator)
        raise error or RuntimeError(
            f"save_checkpoint({os.fspath(path)!r}): another rank failed to collect its state (see its "
            "error); nothing was saved"
        )
    try:
        planner = _stage_planner(saved, parts)  # a pipeline's: each chunk from one owner
    except ValueError:
        _discard(tmp, coordinator)
        raise
    error = _write(tmp, saved, parts, path, coordinator, planner)
    if error is not None and coordinator:
        _discard(tmp, coordinator)
    failed = any_rank(error is not None)[0] if barrier or group_size() == 1 else error is not None
    if failed:
        raise _save_error(path, error)
    return coordinator


def _stage_planner(saved: dict[str, Any], parts: Parts) -> Any:
    """``ranks.dcpstages``' planner when a model in the state holds ``meta`` tensors on any rank (a pipeline
    across ranks), else ``None`` (DCP's default)."""
    from .dcpstages import holds_meta, key_order, owner_planner

    staged = any(holds_meta(m) for m in parts.models.values())
    if _no_dist() or not any_rank(staged)[0]:
        return None
    owners = {k: owner for k, (_, owner) in parts.optimizers.items()}
    every = [f"{k}.{name}" for k, m in parts.models.items() for name in m.state_dict()]
    return owner_planner(saved, key_order(parts.order, parts.models, owners), every)


def _begin(path: str | os.PathLike[str]) -> Path:
    """Rank 0: check the target, remove stale temporaries, make the temporary folder."""
    shown = f"path={os.fspath(path)!r}"
    if not os.fspath(path):
        raise ValueError(f"{shown} is empty; name a folder for the sharded checkpoint, e.g. path='ckpt'")
    target = files.real_target(path)
    found = files.describe(target)
    if found == "a regular file":
        raise ValueError(
            f"{shown} is a file (a one-file checkpoint); a state holding a model, an optimizer or sharded "
            "tensors is saved as a folder, every rank writing its shards: name another path, e.g. path='ckpt'"
        )
    if found == "a folder":
        if any(target.iterdir()) and not (target / ".metadata").exists() and not (target / MANIFEST).exists():
            raise ValueError(
                f"{shown} is a folder of other files, not a sharded checkpoint; torchspan replaces only a "
                "checkpoint folder: name another path"
            )
        if not os.access(target.parent, os.W_OK | os.X_OK):
            raise ValueError(
                f"{shown}: cannot write in folder {str(target.parent)!r} (permission denied or read-only)"
            )
    elif found.startswith("missing"):
        files.output_file(path, name="path", example="ckpt")
    else:
        raise ValueError(
            f"{shown} is {found}; a sharded checkpoint is a folder: name another path, e.g. path='ckpt'"
        )
    files.clean_temporaries(target)
    return files.temporary_folder(target)


def _shared_begin(path: str | os.PathLike[str], coordinator: bool) -> Path:
    """Rank 0 begins; every rank gets the temporary folder's name, or rank 0's refusal."""
    shared: list[Any] = [None, None]
    if coordinator:
        try:
            shared[0] = str(_begin(path))
        except (ValueError, OSError) as exc:
            shared[1] = exc
    dist.broadcast_object_list(shared, src=0)
    if shared[1] is not None:
        raise shared[1]
    return Path(shared[0])


def _write(
    tmp: Path,
    saved: dict[str, Any],
    parts: Parts,
    path: str | os.PathLike[str],
    coordinator: bool,
    planner: Any = None,
) -> BaseException | None:
    """DCP's save into ``tmp`` (every rank), then rank 0 writes the values and manifest and swaps the folder
    in."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet():
            writer = dcp.FileSystemWriter(tmp, sync_files=True)
            dcp.save(saved, storage_writer=writer, planner=planner, no_dist=_no_dist())
        if coordinator:  # DCP returned here: every rank's shards and the .metadata are written
            _write_values(tmp, parts, path)
            files.write_text(tmp / MANIFEST, json.dumps(_manifest(parts), indent=1) + "\n", durable=True)
            files.replace_folder(tmp, path, keep=lambda name: not own_file(name))
    except (Exception, CheckpointException) as exc:
        return exc
    return None


def _write_values(tmp: Path, parts: Parts, path: str | os.PathLike[str]) -> None:
    values = {k: v for k, v in parts.values.items()} | {
        k: obj.state_dict() for k, obj in parts.stateful.items()
    }
    with open(tmp / VALUES, "wb") as fh:
        torch.save(values, fh)
        fh.flush()
        os.fsync(fh.fileno())
    warn_if_unsafe(tmp / VALUES, stacklevel=5, shown=os.fspath(path))


def _manifest(parts: Parts) -> dict[str, Any]:
    return {
        "format": _FORMAT,
        "version": 1,
        "world_size": group_size(),
        "torch": torch.__version__,
        "keys": parts.kinds(),
        "models": {k: _describe(m) for k, m in parts.models.items()},
        "optimizers": {k: owner for k, (_, owner) in parts.optimizers.items()},
    }


def _describe(module: nn.Module) -> dict[str, Any]:
    """A model's class (a sharded model's own, not FSDP2's subclass), its tied parameters and its config."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6
        FSDPModule = ()  # noqa: N806
    cls = next(c for c in type(module).__mro__ if not (FSDPModule and issubclass(c, FSDPModule)))
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {
        "class": cls.__name__,
        "ties": [group for group in names.values() if len(group) > 1],
        "config": _config(module, cls.__name__),
    }


def _config(module: nn.Module, cls: str) -> dict[str, Any] | None:
    config = getattr(module, "config", None)
    if not callable(getattr(config, "to_json_string", None)):
        return None
    try:
        data = json.loads(config.to_json_string(use_diff=True))
    except Exception:  # a config that does not serialise: the export asks for config= instead
        return None
    data["architectures"] = data.get("architectures") or [cls]
    return data


def _discard(tmp: Path, coordinator: bool) -> None:
    if coordinator:
        shutil.rmtree(tmp, ignore_errors=True)


def _save_error(path: str | os.PathLike[str], error: BaseException | None) -> BaseException:
    failures = getattr(error, "failures", None) or {}
    first_rank, first = next(iter(sorted(failures.items())), (rank(), error))
    inner = first[0] if isinstance(first, tuple) else getattr(first, "exc", first)
    if isinstance(inner, ValueError) and str(inner).startswith("path="):
        return inner
    why = f"{type(inner).__name__}: {inner}" if inner is not None else "see its error"
    who = f"rank {first_rank}" if inner is not None else "another rank"
    err = RuntimeError(
        f"save_checkpoint({os.fspath(path)!r}) failed on {who} ({why}); nothing was replaced: the previous "
        "checkpoint, if any, is whole"
    )
    err.__cause__ = inner if isinstance(inner, BaseException) else None
    return err

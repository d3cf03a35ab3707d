"""Loading a sharded checkpoint folder (``ranks.dcp`` writes it): into a job's objects, or as values in any
process.

- ``load_into(folder, {"model": spanned, "optimizer": opt})`` on every rank: each rank reads the parts of its
current
  shards, whatever world size wrote them (DCP reshards), and ``set_state_dict`` puts them in place; keys the
  folder lacks or has extra are refused by name (``strict``).
- ``read_folder(folder)`` in one process, with or without a process group: full tensors with the model's own
keys
  (``dcpread.read_full``) and the values beside them.
- ``read_manifest(folder)``: what ``torchspan.json`` records (each key's kind, classes, ties, configs).

Both read ``.metadata`` and values under the safe rules of ``dcpread`` (``trusted=True`` to lift them).

Usage: ``state = load_into(Path("ckpt"), {"model": spanned, "optimizer": opt})`` (``load_checkpoint`` calls
it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

from .checkpointio import any_rank, key_mismatch, missing_key, safe_load
from .dcp import _FORMAT, MANIFEST, VALUES, Parts, _no_dist, _quiet, _state_dicts, split

__all__ = ["load_into", "read_folder", "read_manifest"]


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        if (folder / VALUES).exists():  # save_checkpoint writes both: the manifest was lost
            from .dcpread import incomplete

            what = (
                f"its {MANIFEST} is missing (it records what each saved key is; the {VALUES} beside it "
                "shows save_checkpoint wrote the folder)"
            )
            raise incomplete(folder, what) from None
        return None  # a folder dcp.save wrote by itself: its keys are all there is
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"load_checkpoint({str(folder)!r}): its {MANIFEST} is damaged ({exc}); restore it from a copy"
        ) from None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError(
            f"load_checkpoint({str(folder)!r}): its {MANIFEST} was not written by torchspan's save_checkpoint"
        )
    return data


def _values(
    folder: Path, manifest: dict[str, Any] | None, map_location: Any, trusted: bool
) -> dict[str, Any]:
    """The saved values (``values.pt``); every one the manifest lists, else a refusal."""
    from .dcpread import incomplete

    listed = [k for k, kind in (manifest or {}).get("keys", {}).items() if kind in ("value", "stateful")]
    if not (folder / VALUES).exists():
        if manifest is None:
            return {}
        holds = f", which holds {', '.join(map(repr, listed))}" if listed else ""
        raise incomplete(folder, f"its {VALUES} is missing{holds}")
    values = safe_load(folder / VALUES, map_location, trusted, checkpoint=folder)
    if not isinstance(values, dict):
        raise ValueError(
            f"load_checkpoint({str(folder)!r}): its {VALUES} holds a {type(values).__name__}, not the "
            "saved values"
        )
    lost = [k for k in listed if k not in values]
    if lost:
        raise incomplete(
            folder, f"its {VALUES} lacks {', '.join(map(repr, lost))}, which its {MANIFEST} lists"
        )
    return values


def read_folder(folder: Path, map_location: Any = "cpu", *, trusted: bool = False) -> dict[str, Any]:
    """The whole checkpoint in this process (no process group needed): full tensors with the saved keys, the
    values, each key in the order it was saved; a folder missing a part is refused."""
    from .dcpread import read_full

    manifest = read_manifest(folder)
    values = _values(folder, manifest, map_location, trusted)
    state = read_full(folder, trusted)
    if map_location not in (None, "cpu") and isinstance(map_location, (str, torch.device)):
        state = tree_map(lambda t: t.to(map_location) if isinstance(t, torch.Tensor) else t, state)
    state.update(values)
    order = list(manifest["keys"]) if manifest else list(state)
    return {k: state[k] for k in order if k in state} | {k: v for k, v in state.items() if k not in order}


def load_into(
    folder: Path, state: Mapping[str, Any], *, trusted: bool = False, strict: bool = True
) -> dict[str, Any]:
    """Load the folder into ``state``'s objects in place on every rank (resharded to this job's world size);
    returns every saved key: the objects given, the saved values. Every check (parts, keys, with ``strict``
    each model's keys) comes before the first tensor is loaded: refused, nothing has changed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from .dcpread import SafeLoadPlanner, SafeReader, check_shards, checkpoint_error, read_full, read_metadata
    from .dcpstages import holds_meta, require_held

    metadata = read_metadata(
        folder, trusted
    )  # a refusal in one line, on every rank, before DCP's collectives
    check_shards(folder, metadata)
    manifest, names = read_manifest(folder), _saved_names(metadata)
    parts = split(state, saving=False)
    _check_keys(folder, parts, manifest, names)
    values = _values(folder, manifest, "cpu", trusted)
    if manifest is None and (
        parts.values or parts.stateful
    ):  # a folder dcp.save wrote holds its values itself
        values = read_full(folder, trusted, keys={*parts.values, *parts.stateful})
    loaded = _state_dicts(parts)
    staged = {k for k, m in parts.models.items() if holds_meta(m)}  # a pipeline rank's: its stage, in place
    if not _no_dist() and any_rank(bool(staged))[0]:
        for key, module in parts.models.items():
            require_held(key, module)
    for key in parts.models if strict else ():
        own = list(parts.models[key].state_dict() if key in staged else loaded[key])
        problem = key_mismatch(folder, key, names.get(key, []), own)
        if problem is not None:
            raise problem
    try:
        planner = SafeLoadPlanner(trusted=trusted, folder=folder, allow_partial_load=not strict)
        with _quiet():
            dcp.load(loaded, storage_reader=SafeReader(folder, trusted), planner=planner, no_dist=_no_dist())
    except BaseException as exc:  # DCP raises the same CheckpointException on every rank
        raise checkpoint_error(exc, folder) from None
    for key, module in parts.models.items():
        if key not in staged:
            set_model_state_dict(module, loaded[key])
    for key, (opt, owner) in parts.optimizers.items():
        if owner in staged:
            _set_groups(opt, loaded[key]["param_groups"])
        else:
            set_optimizer_state_dict(parts.models[owner], opt, loaded[key])
    for key, obj in parts.stateful.items():
        obj.load_state_dict(values.pop(key))
    given = {k: state[k] for k in parts.order if k not in parts.values}
    order = list(manifest["keys"]) if manifest else parts.order
    out = {k: given.get(k, values.get(k)) for k in order if k in given or k in values}
    return out | {k: v for k, v in given.items() if k not in out}


def _set_groups(opt: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """A pipeline rank's optimizer: its moments were loaded in place (``get_optimizer_state_dict`` hands out
    the optimizer's own tensors); its groups' settings (``lr``, betas...) are the saved ones."""
    if len(groups) != len(opt.param_groups):
        raise ValueError(
            f"load_checkpoint: the optimizer was saved with {len(groups)} parameter groups, this one has "
            f"{len(opt.param_groups)}; build it with the same groups"
        )
    for group, saved in zip(opt.param_groups, groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _saved_names(metadata: Any) -> dict[str, list[str]]:
    """Each top-level key the ``.metadata`` holds, in order, with the names saved under it (a model's
    keys)."""
    paths = getattr(metadata, "planner_data", None)
    if not isinstance(paths, dict):  # an older writer: the flattened names alone
        paths = {n: tuple(n.split(".", 1)) for n in metadata.state_dict_metadata}
    out: dict[str, list[str]] = {}
    for path in paths.values():
        out.setdefault(str(path[0]), []).extend([".".join(map(str, path[1:]))] if len(path) > 1 else [])
    return out


def _check_keys(
    folder: Path, parts: Parts, manifest: dict[str, Any] | None, names: Mapping[str, list[str]]
) -> None:
    """Each key given is one the checkpoint saved (a folder ``dcp.save`` wrote: a top-level key in its
    ``.metadata``), an object as that kind of object (one-line ``ValueError``)."""
    saved = manifest["keys"] if manifest is not None else dict.fromkeys(names)
    for key, kind in parts.kinds().items():
        if key not in saved:
            raise missing_key(folder, key, list(saved))
        if (
            saved[key] is None
            or saved[key] == kind
            or {saved[key], kind} in ({"tree", "model"}, {"value", "stateful"})
        ):
            continue
        fix = (
            f"load it into a {saved[key]}, e.g. {{{key!r}: {saved[key]}}}"
            if saved[key] in ("model", "optimizer")
            else f"leave {key!r} out"
        )
        raise ValueError(
            f"load_checkpoint({str(folder)!r}): {key!r} was saved as a {saved[key]}, not a {kind}; {fix}"
        )

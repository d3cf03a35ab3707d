"""``span(model, ..., weights=...)`` for a model built on ``meta``: each rank fills only what it holds.

A model built under ``torch.device("meta")`` (or transformers' ``from_config`` there) has shapes and no
values. The executor first makes this rank's part real and empty (``runtime.metainit.Slot``: an FSDP2 shard
after ``fully_shard`` on ``meta`` and ``to_empty``, a pipeline stage's tensors, a replica's whole model), then
``fill`` gives it values from ``weights``:

- ``"init"``: the model's own initialisation replayed (``runtime.metainit.run_init``): bit-equal to the same
  model built normally on the CPU after the same ``torch.manual_seed`` (every rank draws rank 0's generator
  stream, so the job's weights are one device's; each rank keeps its part of each tensor as it is drawn).
  A callable ``weights=fn`` runs ``fn(model)`` after that (``lambda m: m.init_weights()``).
- a path: a torchspan / ``torch.distributed.checkpoint`` folder (``save_checkpoint(path, {"model": ...})``:
  each rank's DCP load reads only the chunks of its shard or stage), a ``.safetensors`` file, or a folder with
  ``model.safetensors`` or ``model.safetensors.index.json`` (transformers' layout; a tie saved once is found
  under any of its names): each rank reads only its rows' bytes (one seek and read each; the header names
  where they lie; the ``safetensors`` package is not needed). Non-persistent buffers
  (rotary ``inv_freq``), which no checkpoint holds, come from their module's own initialisation.

No process ever holds the whole model: its part, and one tensor being read or initialised. Errors are the same
on every rank (every rank checks every name), so none waits for a peer that refused.

Usage (the executors do this)::

    slots = meta_slots(model); ...make this rank's part real...; bind(slots, model)
    fill(model, slots, weights, group=None)
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...layers.ties import declared_ties
from ..metainit import Slot, bind, has_meta, materialize, meta_slots, run_init

__all__ = ["WEIGHTS_HELP", "check_weights", "fill", "materialize_replica", "materialize_stage", "retie"]

WEIGHTS_HELP = (
    "weights='init' (the model's own initialisation: reset_parameters, transformers' init weights, seeded by "
    "torch.manual_seed as a normal build), weights='path/to/checkpoint' (a "
    "torchspan/torch.distributed.checkpoint folder, a .safetensors file or a folder with "
    "model.safetensors), or weights=callable(model) that initialises it"
)


def check_weights(model: nn.Module, weights: Any, where: str = "span") -> None:
    """``ValueError`` before any work: a ``meta`` model with no ``weights`` (naming the options), ``weights``
    for a model that is not on ``meta``, a ``weights`` of another kind, parameters partly on ``meta``, a path
    that is no checkpoint, a checkpoint lacking one of the model's tensors or holding another shape (its index
    or ``.metadata`` only is read). A tie the model declares and lost on ``meta`` is made again first
    (``retie``)."""
    meta = has_meta(model)
    if weights is None:
        if meta:
            first = next(n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta)
            raise ValueError(
                f"{where}(model): the model is on the meta device ({first!r} has a shape and no values), "
                f"so nothing could be trained; say where its weights come from: {WEIGHTS_HELP}. Each rank "
                "then materializes only what it holds (its shard or stage)"
            )
        return
    if not (isinstance(weights, (str, os.PathLike)) or callable(weights)):
        raise ValueError(f"weights={weights!r} is not one of: {WEIGHTS_HELP}")
    if not meta:
        raise ValueError(
            f"weights={weights!r} is for a model built on the meta device (with torch.device('meta'): "
            "model = ...); this model already holds values: leave weights out, or load a checkpoint with "
            "load_checkpoint"
        )
    params = [(n, p.is_meta) for n, p in model.named_parameters()]
    real = [n for n, is_meta in params if not is_meta]
    if real and len(real) < len(params):
        raise ValueError(
            f"{len(params) - len(real)} parameter(s) of the model are on meta and {len(real)} are not "
            f"(e.g. {real[0]!r}); build every parameter on meta (with torch.device('meta'): model = ...) "
            "or none"
        )
    retie(model)
    if isinstance(weights, (str, os.PathLike)) and weights != "init":
        _check_saved(Path(weights), meta_slots(model))


def retie(model: nn.Module) -> None:
    """Tie again what ``model`` declares tied (``layers.ties.declared_ties``: a config's
    ``tie_word_embeddings``) and holds as separate tensors: ``accelerate.init_empty_weights()`` registers a
    copy of every parameter, so under transformers 5.x ``lm_head.weight = embed_tokens.weight`` leaves two.
    The model's own ``tie_weights()`` first (as ``from_pretrained`` runs it), then each holder given its
    source's parameter; a tie of two shapes is refused."""
    pairs = declared_ties(model)

    def broken() -> list[tuple[str, str]]:
        return [(t, s) for t, s in pairs if model.get_parameter(t) is not model.get_parameter(s)]

    if not broken():
        return
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    for holder, source in broken():
        kept, given = model.get_parameter(source), model.get_parameter(holder)
        if kept.shape != given.shape:
            raise ValueError(
                f"span(..., weights=...): the model declares {holder!r} tied to {source!r} (its config's "
                f"tie_word_embeddings), but they have shapes {list(given.shape)} and {list(kept.shape)}; "
                "build it with tie_word_embeddings=False, or give the two one shape"
            )
        parent, _, key = holder.rpartition(".")
        setattr(model.get_submodule(parent), key, kept)


def _source(path: Path) -> tuple[str, Path]:
    """``("dcp", folder)`` or ``("safetensors", file or index)`` for a weights path; ``ValueError``
    otherwise."""
    if (path / ".metadata").is_file():
        return "dcp", path
    if path.is_file() and path.suffix == ".safetensors":
        return "safetensors", path
    for name in ("model.safetensors.index.json", "model.safetensors"):
        if (path / name).is_file():
            return "safetensors", path / name
    found = (
        "does not exist"
        if not path.exists()
        else "is not a checkpoint folder (no .metadata) nor a .safetensors file"
    )
    raise ValueError(f"weights={str(path)!r} {found}; {WEIGHTS_HELP}")


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _not_safetensors(file: Path, why: str) -> ValueError:
    return ValueError(
        f"weights={str(file)!r} is not a safetensors file ({why}); pass a file that safetensors' save_file "
        "or transformers' save_pretrained wrote (a torchspan checkpoint converts with export_safetensors), "
        "or weights='init'"
    )


def _header(file: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    """``{name: (dtype, shape, where its data starts in the file)}`` from a safetensors file's header; a file
    that is none (a header size past its end, no JSON object of tensor entries, data past its end) is refused
    by name."""
    with open(file, "rb") as fh:
        total = os.fstat(fh.fileno()).st_size
        size = int.from_bytes(fh.read(8), "little")
        if total < 8 or not 0 < size <= total - 8:
            raise _not_safetensors(
                file, f"its first 8 bytes give a header of {size} bytes and the file has {total}"
            )
        text = fh.read(size)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _not_safetensors(file, f"its header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _not_safetensors(file, f"its header is a JSON {type(header).__name__}, not an object")
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = (
                entry["dtype"],
                tuple(int(n) for n in entry["shape"]),
                map(int, entry["data_offsets"]),
            )
        except (TypeError, KeyError, ValueError):
            raise _not_safetensors(file, f"its entry {key!r} is not {{dtype, shape, data_offsets}}") from None
        if dtype not in _DTYPES:
            raise ValueError(
                f"weights={str(file)!r}: {key!r} is stored as {dtype}, which torchspan does not read"
            )
        if not 0 <= start <= end <= total - 8 - size:
            raise ValueError(f"weights={str(file)!r} is truncated: {key!r}'s data ends past the file's end")
        out[key] = (_DTYPES[dtype], shape, 8 + size + start)
    return out


def _shards(path: Path, index: Path) -> list[Path]:
    """The files a ``model.safetensors.index.json`` names (its ``weight_map``), each of them there."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = list(dict.fromkeys(index.parent / f for f in weight_map.values()))
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"weights={str(path)!r}: {index.name} is not a safetensors index ({type(exc).__name__}: {exc}; "
            "it needs a "
            '"weight_map" of tensor names to files); save the model again with save_pretrained, or '
            "weights='init'"
        ) from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(
            f"weights={str(path)!r}: {index.name} names {', '.join(map(repr, missing))}, which "
            f"{'does' if len(missing) == 1 else 'do'} not exist in {str(index.parent)!r}; put every shard "
            "the index lists there (download or save the model again)"
        )
    return files


def _saved(
    path: Path, slots: Sequence[Slot], trusted: bool = False
) -> tuple[str, dict[str, tuple[int, ...]], dict[str, Any], str]:
    """``(kind, {name: shape}, {name: (file, header entry)}, prefix)`` of what a weights path holds (DCP: the
    model's keys without their top-level ``prefix``), from its index, headers or ``.metadata``: no tensor is
    read."""
    kind, found = _source(path)
    if kind == "dcp":
        from .dcpread import read_metadata

        saved = {
            k: tuple(getattr(v, "size", ()))
            for k, v in read_metadata(found, trusted).state_dict_metadata.items()
        }
        prefix = _prefix(found, set(saved), {n for slot in slots for n in slot.names})
        return kind, {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}, {}, prefix
    files = _shards(path, found) if found.name.endswith(".index.json") else [found]
    where = {key: (file, entry) for file in files for key, entry in _header(file).items()}
    return kind, {key: entry[1] for key, (_, entry) in where.items()}, where, ""


def _rows(
    file: Path, entry: tuple[torch.dtype, tuple[int, ...], int], region: tuple[slice, ...]
) -> torch.Tensor:
    """``region`` of a tensor in a safetensors file: its rows (one contiguous range of a row-major tensor)
    read alone, then narrowed in the other dimensions."""
    dtype, shape, start = entry
    first = region[0] if region else slice(0, 1)
    row = 1
    for n in shape[1:]:
        row *= n
    count = (first.stop - first.start) * row
    size = torch.empty((), dtype=dtype).element_size()
    data = bytearray(count * size)
    with open(file, "rb") as fh:
        fh.seek(start + first.start * row * size)
        if fh.readinto(data) != len(data):
            raise ValueError(f"weights={str(file)!r} is truncated: a tensor's data ends past the file's end")
    flat = torch.frombuffer(data, dtype=dtype) if count else torch.empty(0, dtype=dtype)
    if not shape:
        return flat.reshape(())
    return flat.reshape(first.stop - first.start, *shape[1:])[(slice(None), *region[1:])]


def _check_saved(path: Path, slots: Sequence[Slot]) -> None:
    """Every persistent tensor of the model is saved (under one of its tied names) with its shape."""
    shapes = _saved(path, slots)[1]
    missing = []
    for slot in slots:
        key = next((n for n in slot.names if n in shapes), None)
        if key is None:
            if slot.persistent:
                missing.append(slot.name)
        elif shapes[key] != tuple(slot.meta.shape):
            raise ValueError(
                f"weights={str(path)!r}: {key!r} has shape {list(shapes[key])} in the file and "
                f"{list(slot.meta.shape)} in the model"
            )
    if missing:
        some = ", ".join(map(repr, missing[:5])) + (" ..." if len(missing) > 5 else "")
        raise ValueError(
            f"weights={str(path)!r}: the checkpoint has no {some} (nor any name tied to it; it holds e.g. "
            f"{', '.join(map(repr, list(shapes)[:3]))}); load a checkpoint of this model (the same module "
            "names), or weights='init'"
        )


def materialize_replica(model: nn.Module, device: torch.device) -> list[Slot]:
    """A replica holds everything: every ``meta`` tensor becomes an empty tensor on ``device``; its slots,
    bound."""
    slots = meta_slots(model)
    materialize(slots, lambda s: device)
    bind(slots, model)
    return slots


def materialize_stage(
    model: nn.Module, layers: Sequence[nn.Module], device: torch.device, roots: Sequence[str] | bool = ()
) -> list[Slot]:
    """A pipeline rank's part of a ``meta`` model: the tensors of ``layers`` (this stage's; a tie with another
    stage included) and the model's own tensors named in ``roots`` (``True``: all of them) made empty on
    ``device``; the others stay ``meta``. Call it before ``RankStage.find_ties`` (the tensors are new
    objects). Returns the slots."""
    slots = meta_slots(model)
    mine = {id(m) for layer in layers for m in layer.modules()} | ({id(model)} if roots is True else set())
    named = set(roots) if not isinstance(roots, bool) else set()
    materialize(
        slots,
        lambda s: device if any(id(m) in mine for m, _, _ in s.positions) or named & set(s.names) else None,
    )
    return slots


def fill(
    model: nn.Module,
    slots: Sequence[Slot],
    weights: Any,
    *,
    group: Any = None,
    comm: torch.device | None = None,
) -> None:
    """Give every bound slot its values from ``weights`` (module docstring; ``check_weights`` has checked the
    checkpoint's names and shapes). Every rank of ``group`` calls it."""
    if isinstance(weights, (str, os.PathLike)) and weights != "init":
        kind, shapes, files, prefix = _saved(Path(weights), slots)
        if kind == "dcp":
            _read_dcp(Path(weights), slots, shapes, prefix)
        else:
            _read_safetensors(slots, shapes, files)
        buffers = {
            s.name for s in slots if not any(n in shapes for n in s.names)
        }  # non-persistent: rotary inv_freq
        with torch.random.fork_rng(devices=[]):  # their modules' own initialisation; the generator untouched
            missing = run_init(model, slots, only=buffers) if buffers else []
    else:
        _same_generator(group, comm or torch.device("cpu"))
        missing = run_init(model, slots, weights if callable(weights) else None)
    if missing:
        some = ", ".join(map(repr, missing[:5])) + (" ..." if len(missing) > 5 else "")
        raise ValueError(
            f"span(..., weights={weights if isinstance(weights, str) else 'fn'!r}): no initialisation "
            f"writes {some} whole (a tensor made in __init__ without reset_parameters, e.g. "
            "nn.Parameter(torch.ones(n)), has no value on meta, and no checkpoint holds a non-persistent "
            "buffer); give its module a reset_parameters() that sets it, pass weights=callable(model) that "
            "does, keep such a buffer real (only parameters on meta), or load a checkpoint that holds it"
        )


def _same_generator(group: Any, comm: torch.device) -> None:
    """Every rank's CPU generator set to rank 0's: each draws the one-device stream and keeps its part."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    state = torch.get_rng_state().to(comm)
    dist.broadcast(state, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    torch.set_rng_state(state.cpu())


# --------------------------------------------------------------------------------------------- safetensors


def _read_safetensors(
    slots: Sequence[Slot], shapes: dict[str, tuple[int, ...]], where: dict[str, Any]
) -> None:
    """Each held slot's region read from its file: only its rows' bytes (``_rows``)."""
    for slot in slots:
        key = next((n for n in slot.names if n in shapes), None)
        region = slot.region()
        if key is not None and region is not None:
            slot.write_local(_rows(where[key][0], where[key][1], region))


# ---------------------------------------------------------------------------------------------------- DCP


def _prefix(folder: Path, keys: set[str], names: set[str]) -> str:
    """The top-level key the model was saved under ("model" for save_checkpoint(path, {"model": ...}));
    without torchspan's manifest (a folder ``dcp.save`` wrote), "model." or none, whichever finds more of
    ``names``."""
    from .dcpload import read_manifest

    manifest = read_manifest(folder)
    if manifest is not None:
        models = [k for k, kind in manifest["keys"].items() if kind in ("model", "tree")]
        if len(models) == 1:
            return models[0] + "."
        if "model" in models:
            return "model."
        raise ValueError(
            f"weights={str(folder)!r} holds several models ({', '.join(models)}) and none is 'model'"
        )
    return max(("", "model."), key=lambda p: sum(p + n in keys for n in names))


def _read_dcp(
    folder: Path,
    slots: Sequence[Slot],
    shapes: dict[str, tuple[int, ...]],
    prefix: str,
    trusted: bool = False,
) -> None:
    """Each held slot's part read by ``torch.distributed.checkpoint`` (only the saved chunks its part
    overlaps); every rank of the job calls it (a collective)."""
    import torch.distributed.checkpoint as dcp

    from .dcpread import SafeLoadPlanner, SafeReader, checkpoint_error

    state = {}
    for slot in slots:
        key = next((n for n in slot.names if n in shapes), None)
        if key is not None and slot.dest is not None:
            state[prefix + key] = slot.dest.detach()
    no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        dcp.load(
            state,
            storage_reader=SafeReader(folder, trusted),
            planner=SafeLoadPlanner(trusted=trusted, folder=folder),
            no_dist=no_dist,
        )
    except BaseException as exc:
        raise checkpoint_error(exc, folder) from None

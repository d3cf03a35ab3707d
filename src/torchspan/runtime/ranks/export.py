"""Export a checkpoint's model to one safetensors file that transformers' ``from_pretrained`` reads.

``export_safetensors("ckpt", "hf-model")`` reads the model's full tensors from a checkpoint (a sharded folder
written by any world size, or a one-file checkpoint) in this process and writes ``hf-model/model.safetensors``
(``{"format": "pt"}`` metadata, as transformers writes it) and ``hf-model/config.json``: the ``config`` given
(a transformers config, a dict, or the path of a ``config.json`` or of a folder holding one), else the one the
sharded checkpoint recorded from a transformers model. Both files are written atomically. ``folder`` may be
the checkpoint folder itself (``export_safetensors("ckpt", "ckpt")``): later saves of the checkpoint keep both
files (they replace only the checkpoint's own), so export again after a save for the newer weights.

Tied weights are written once, as ``save_pretrained`` writes them: of the names a tied parameter has (recorded
at save time, or found as tensors sharing storage in a one-file checkpoint), the first the model registered is
kept (``model.embed_tokens.weight``, not ``lm_head.weight``) and ``from_pretrained`` ties the other to it.

safetensors is optional (it comes with transformers); without it the export is refused naming the install.

Usage::

    torchspan.export_safetensors("ckpt", "hf-model")   # a sharded checkpoint of a transformers model
    model = transformers.LlamaForCausalLM.from_pretrained("hf-model")
    # a one-file checkpoint: name the config
    torchspan.export_safetensors("ckpt.pt", "out", config=model.config)
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ... import files
from . import dcp, dcpload
from .checkpointio import safe_load

__all__ = ["export_safetensors"]

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def export_safetensors(
    checkpoint: str | os.PathLike[str],
    folder: str | os.PathLike[str],
    *,
    config: Any = None,
    model: str | None = None,
    trusted: bool = False,
) -> Path:
    """Write the model saved in ``checkpoint`` to ``folder/model.safetensors`` (plus ``config.json``); returns
    the safetensors file's path. ``model``: the checkpoint's key of the model (default: its only model, or
    ``"model"``). Reads the whole model into this process (one process, no process group needed);
    ``trusted`` as for ``load_checkpoint``."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ImportError(
            "export_safetensors needs the safetensors package: pip install safetensors (it comes with "
            "transformers: pip install 'torchspan[hf]')"
        ) from None
    source = Path(checkpoint)
    if not source.exists():
        raise ValueError(
            f"checkpoint={os.fspath(checkpoint)!r} does not exist; name the folder or file save_checkpoint "
            "wrote"
        )
    out = files.output_folder(folder, name="folder", files=(WEIGHTS, CONFIG), example="hf-model")
    tensors, ties, recorded = _model_state(source, model, trusted)
    tensors = _untied(tensors, ties)
    out.mkdir(parents=True, exist_ok=True)
    target = out / WEIGHTS
    with files.atomic_open(target, "wb", name="folder", durable=True) as fh:
        save_file(tensors, fh.name, metadata={"format": "pt"})  # written by name into atomic_open's temporary
    _write_config(out, config if config is not None else recorded)
    return target


def _model_state(
    source: Path, key: str | None, trusted: bool
) -> tuple[dict[str, torch.Tensor], list[list[str]], dict[str, Any] | None]:
    """The model's full tensors, its tie groups and its recorded config."""
    if dcp.is_folder_checkpoint(source):
        from .dcpread import read_full

        folder = files.real_target(source)
        manifest = dcpload.read_manifest(folder) or {}
        models = [k for k, kind in manifest.get("keys", {}).items() if kind in ("model", "tree")]
        key = _choose(key, models, source)
        state = read_full(folder, trusted, keys={key})
        described = manifest.get("models", {}).get(key, {})
        return _tensors(state.get(key), key, source), described.get("ties", []), described.get("config")
    files.require_regular_file(
        source, name="checkpoint", what="a checkpoint", fix="name the folder or file save_checkpoint wrote"
    )
    saved = safe_load(source, "cpu", trusted)
    if not isinstance(saved, dict):
        raise ValueError(
            f"checkpoint={str(source)!r} holds a {type(saved).__name__}, not a checkpoint dict written by "
            "save_checkpoint"
        )
    if "torchspan_ranks" in saved:  # ranks.checkpoint's one file of a pipeline job: one state per rank
        raise ValueError(
            f"checkpoint={str(source)!r} is a pipeline job's per-rank checkpoint (one state per rank, each "
            "holding only its stage), so no state in it is the whole model; save a sharded one, "
            "save_checkpoint(path, {'model': spanned, ...}), and export that folder"
        )
    key = _choose(
        key,
        [
            k
            for k, v in saved.items()
            if isinstance(v, Mapping) and any(isinstance(t, torch.Tensor) for t in v.values())
        ],
        source,
    )
    tensors = _tensors(saved.get(key), key, source)
    return tensors, _shared(tensors), None


def _choose(key: str | None, models: list[str], source: Path) -> str:
    if key is not None:
        if key not in models:
            raise ValueError(
                f"checkpoint={str(source)!r} has no model under {key!r} (its models: "
                f"{', '.join(map(repr, models)) or 'none'})"
            )
        return key
    if len(models) == 1:
        return models[0]
    if "model" in models:
        return "model"
    raise ValueError(
        f"checkpoint={str(source)!r} holds "
        f"{'no model' if not models else 'several models: ' + ', '.join(map(repr, models))}; name the one "
        "to export with model='...'"
    )


def _tensors(state: Any, key: str, source: Path) -> dict[str, torch.Tensor]:
    if not isinstance(state, Mapping) or not state:
        raise ValueError(f"checkpoint={str(source)!r}: {key!r} is not a model's state dict")
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor) or v.is_meta]
    if bad:
        raise ValueError(
            f"checkpoint={str(source)!r}: {key!r} holds values that are not tensors with data "
            f"({', '.join(bad[:3])}); a pipeline's per-rank checkpoint cannot be exported"
        )
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def _shared(tensors: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names whose tensors share storage (a one-file checkpoint keeps ties so), in the state dict's order."""
    groups: dict[tuple[int, int, tuple[int, ...]], list[str]] = {}
    for name, t in tensors.items():
        groups.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)), []).append(
            name
        )
    return [names for names in groups.values() if len(names) > 1]


def _untied(tensors: dict[str, torch.Tensor], ties: list[list[str]]) -> dict[str, torch.Tensor]:
    """Each tied parameter once, under the first name the model registered; every tensor its own storage."""
    drop = {name for group in ties for name in group[1:] if group[0] in tensors}
    kept = {k: v for k, v in tensors.items() if k not in drop}
    seen: set[int] = set()
    out = {}
    for name, t in kept.items():  # safetensors refuses tensors sharing memory: copy any that still do
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def _write_config(out: Path, config: Any) -> None:
    if config is None:
        return
    if callable(getattr(config, "to_json_string", None)):
        text = config.to_json_string(use_diff=True)
    elif isinstance(config, Mapping):
        text = json.dumps(dict(config), indent=2, sort_keys=True) + "\n"
    elif isinstance(config, (str, os.PathLike)):
        found = Path(config) / CONFIG if Path(config).is_dir() else Path(config)
        files.require_regular_file(
            found,
            name="config",
            what="a config.json",
            fix="give a transformers config, a dict or a config.json",
        )
        if found.resolve() != (out / CONFIG).resolve():
            with files.atomic_open(out / CONFIG, "wb", name="folder") as fh, open(found, "rb") as src:
                shutil.copyfileobj(src, fh)
        return
    else:
        raise TypeError(
            f"config={type(config).__name__}: give a transformers config, a dict or the path of a config.json"
        )
    files.write_text(out / CONFIG, text, name="folder")

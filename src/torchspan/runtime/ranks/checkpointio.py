"""What both checkpoint forms share: the safe ``torch.load`` with one-line errors, the warning for a save that
would need ``trusted=True``, and ranks agreeing on a flag.

Used by ``ranks.checkpoint`` (one file written by one rank) and ``ranks.dcp`` (a folder every rank writes,
on ``torch.distributed.checkpoint``).

Usage::

    # ValueError naming trusted=True for other objects
    state = safe_load(Path("ckpt.pt"), "cpu", trusted=False)
    failed_here, failed_anywhere = any_rank(False, error is not None)
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "any_rank",
    "group_size",
    "key_mismatch",
    "missing_key",
    "rank",
    "refusal",
    "safe_load",
    "warn_if_unsafe",
]


def group_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def any_rank(*flags: bool) -> tuple[bool, ...]:
    """Each of ``flags`` OR-ed over all ranks (a collective: every rank calls it); as given in one process."""
    if group_size() == 1:
        return tuple(bool(f) for f in flags)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    t = torch.tensor([int(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in t.tolist())


def warn_if_unsafe(target: Path, stacklevel: int = 4, shown: str | None = None) -> None:
    """Warn when the file just written needs objects a weights-only load refuses (``trusted=True`` to load);
    ``shown``: the checkpoint to name, when ``target`` is a file inside it."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(target)
    except Exception:  # pragma: no cover - an older torch or an unreadable file: the load says so
        return
    if unsafe:
        warnings.warn(
            f"the checkpoint {shown or str(target)!r} holds {', '.join(unsafe)}: load_checkpoint refuses "
            "such objects unless trusted=True; save plain values instead (tensors, numbers, strings, "
            "lists, dicts: e.g. float(x), torch.from_numpy(a), vars(namespace))",
            stacklevel=stacklevel,
        )


def refusal(shown: str, needed: str, path: Path) -> ValueError:
    """The one-line refusal of an object a safe load does not build, naming the opt-in."""
    return ValueError(
        f"{shown}: the file needs {needed}, which a safe (weights-only) load refuses: loading it could run "
        f"code from the file. If you trust the file, load it with load_checkpoint({str(path)!r}, "
        "trusted=True)"
    )


def _few(keys: Sequence[str], shown: int = 3) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(map(repr, keys[:shown])) + more


def missing_key(path: Path, key: str, saved: Sequence[str]) -> ValueError:
    """The refusal of a key asked for that the checkpoint at ``path`` does not hold (``saved``: the keys it
    holds)."""
    example = f"e.g. {{{saved[0]!r}: ...}} for what it saved under {saved[0]!r}, " if saved else ""
    return ValueError(
        f"load_checkpoint({str(path)!r}): the checkpoint has no {key!r} (it holds "
        f"{_few(saved, 8) or 'nothing'}); name a key it holds, {example}or leave {key!r} out of what you load"
    )


def key_mismatch(path: Path, key: str, saved: Sequence[str], expected: Sequence[str]) -> ValueError | None:
    """The refusal of a model's keys that differ from the checkpoint's (``saved``: its keys under ``key``;
    ``expected``: the model's), as ``load_state_dict(strict=True)`` refuses them; None when they agree."""
    have, want = set(saved), set(expected)
    unexpected, missing = [k for k in saved if k not in want], [k for k in expected if k not in have]
    if not unexpected and not missing:
        return None
    found = [f"has keys the model lacks (unexpected: {_few(unexpected)})"] if unexpected else []
    found += [f"lacks keys of the model (missing: {_few(missing)})"] if missing else []
    return ValueError(
        f"load_checkpoint({str(path)!r}): the checkpoint's {key!r} {' and '.join(found)}; load it into the "
        "model it was saved from (the same layers), or pass strict=False to load the keys both have and "
        "leave the rest as they are"
    )


def safe_load(
    target: Path,
    map_location: Any,
    trusted: bool,
    *,
    shown: str | None = None,
    checkpoint: Path | None = None,
) -> Any:
    """``torch.load`` (``weights_only`` unless ``trusted``); its refusals and a damaged file's errors as one
    line naming the path (``checkpoint``: the checkpoint it belongs to, when ``target`` is a file inside one)
    and what to do."""
    checkpoint = checkpoint if checkpoint is not None else target
    shown = shown or f"load_checkpoint({str(checkpoint)!r})"
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
            raise refusal(shown, found.group(1), checkpoint) from None
        why = type(exc).__name__ + (f": {gist(text)}" if gist(text) else "")
        raise ValueError(
            f"{shown}: the file is corrupt or truncated, or not a torch checkpoint ({why}); restore it "
            "from a copy or delete it to start afresh"
        ) from None


def gist(text: str) -> str:
    """The telling part of a ``torch.load`` error: its first line that is not boilerplate, up to the first
    sentence."""
    boiler = ("Weights only load failed", "Please file an issue", "Check the documentation", "In PyTorch 2.6")
    for line in text.splitlines():
        line = line.strip()
        if line and not any(b in line for b in boiler):
            return line.split(". ")[0].rstrip(".")[:160]
    return ""

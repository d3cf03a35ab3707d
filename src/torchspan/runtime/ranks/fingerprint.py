"""A fingerprint of a batch: equal on every rank given the same batch, different when anything differs.

``RankStage.check_same_batch`` all-gathers it in a pipeline every training step (a rank given another
batch is refused before any gradient). It is a few int64s:

- a hash of the structure: containers, dict keys, tensor shapes and dtypes, plain values by type and
  value (``1``, ``1.0``, ``True`` differ), computed once and reused while the structure repeats;
- the values, read the same way wherever the tensors live (one rank may hold the batch on its GPU, another
  on the CPU), chosen by the batch's size alone:
  - up to 16 MiB of tensors (token batches, most batches): zlib's CRC-32 of their bytes in order, read in
  place
    on the host (no copy for a contiguous CPU tensor; an accelerator's copied there), so any changed bit or
    moved element changes it, whatever the memory layout (a strided tensor is read in its logical order);
  - larger (image batches): the sum and the position-weighted sum of their bits read as integers, on the
    tensors' own device, so that only two int64s leave it (int64 sums do not depend on the order of additions,
    so equal batches agree whatever the threads). Linear sums miss some changes a CRC would see (+1, -2, +1 on
    three words in a row leaves both unchanged); a CRC of 37 MB would take 10 ms of a core per step.

Usage: ``fp, known = batch_fingerprint((chunks, targets), known)`` (``known``: the previous call's).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["batch_fingerprint"]

_CRC_BYTES = (
    16 << 20
)  # batches of up to this many bytes of tensors: their CRC-32; larger: the sums of their bits

_PLAIN = (type(None), bool, int, float, str)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an odd pytree context: hash the structure again
        return False


def _plain_structure(v: Any, tensors: list[torch.Tensor]) -> Any:
    """``v``'s structure (container kinds, dict keys, tensor shapes and dtypes, plain values; its tensors
    appended to ``tensors`` in pytree order) when it holds only tuples, lists, dicts, tensors and plain
    values, else ``None``."""
    kind = type(v)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        tensors.append(v)
        return (v.shape, v.dtype)
    if kind is tuple or kind is list:
        parts = []
        for item in v:
            part = _plain_structure(item, tensors)
            if part is None:
                return None
            parts.append(part)
        return ("list" if kind is list else "tuple", tuple(parts))
    if kind is dict:
        parts = []
        for key, item in v.items():
            part = _plain_structure(item, tensors)
            if part is None or type(key) is not str:
                return None
            parts.append((key, part))
        return ("dict", tuple(parts))
    if (
        kind in _PLAIN
    ):  # by type and repr: 1, 1.0, True and -0.0, 0.0 differ (== alone would not tell them apart)
        return ("value", kind.__name__, repr(v) if kind is float else v)
    return None


def _structure(batch: Any, known: tuple[Any, int] | None) -> tuple[list[torch.Tensor], tuple[Any, int]]:
    """The batch's tensors in pytree order and ``(structure, its hash)``, ``known`` reused when the structure
    repeats."""
    tensors: list[torch.Tensor] = []
    shape = _plain_structure(
        batch, tensors
    )  # tuples, lists and dicts of tensors and plain values: no pytree walk
    if shape is None:
        leaves, spec = tree_flatten(batch)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        plain = tuple(
            v if isinstance(v, _PLAIN) else type(v).__name__
            for v in leaves
            if not isinstance(v, torch.Tensor)
        )
        structure: Any = (spec, tuple((t.shape, t.dtype) for t in tensors), plain)
        if known is None or not _same(known[0], structure):
            known = (structure, zlib.crc32(repr((str(spec), structure[1:])).encode()))
    elif known is None or known[0] != shape:
        known = (shape, zlib.crc32(repr(("plain", shape)).encode()))
    return tensors, known


def _host_bytes(t: torch.Tensor) -> Any:
    """``t``'s elements in logical order as a buffer of bytes on the host (a view of its memory when
    contiguous there)."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()


def _device_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The plain and the position-weighted sum (int64) of the tensors' bits read as int32 words (smaller
    elements one each; the tensors of one device and dtype concatenated in order), on the first one's
    device."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t.detach().reshape(-1))
    words = []
    for parts in groups.values():
        bits = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
        if bits.is_complex():
            bits = torch.view_as_real(bits).reshape(-1)
        size = bits.element_size()  # each element read alike whatever its offset in memory
        words.append(
            bits.view(torch.int32)
            if size >= 4
            else bits.view(torch.int16 if size == 2 else torch.uint8).to(torch.int32)
        )
    device = words[0].device
    flat = torch.cat([w.to(device) for w in words]) if len(words) > 1 else words[0]
    # running sums in int64 (a flipped sign bit never cancels out mod 2**32): the last is the plain sum, and
    # their sum weighs word i by the n - i words from it to the end (position-weighted, in one pass)
    run = torch.cumsum(flat, 0, dtype=torch.int64)
    return torch.cat([run[-1:], run.sum().reshape(1)])


def batch_fingerprint(
    batch: Any, known: tuple[Any, int] | None = None
) -> tuple[torch.Tensor, tuple[Any, int]]:
    """Three int64s that differ when two ranks' batches differ: the structure's hash, then the values' CRC-32
    and 0 (up to 16 MiB of tensors) or their two sums. ``known``: the previous call's ``(structure, hash)``,
    reused when the structure repeats (the usual step). Returned on the CPU, or the device of the first tensor
    (the sums).

    Usage: ``fp, known = batch_fingerprint((chunks, targets), known)``.
    """
    tensors, known = _structure(batch, known)
    tensors = [t for t in tensors if t.numel()]
    if not tensors or sum(t.numel() * t.element_size() for t in tensors) <= _CRC_BYTES:
        crc = 0
        for t in tensors:
            crc = zlib.crc32(_host_bytes(t), crc)
        return torch.tensor([known[1], crc, 0], dtype=torch.int64), known
    sums = _device_sums(tensors)
    return torch.cat([torch.tensor([known[1]], dtype=torch.int64).to(sums.device), sums]), known

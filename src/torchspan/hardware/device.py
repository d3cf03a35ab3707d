"""One device torchspan can place work on, and the byte units its sizes are written in.

Usage::

    from torchspan.hardware import Device, format_bytes, parse_memory
    parse_memory("1.5GiB") == 1610612736
    format_bytes(3 * 2**30) == "3.00 GiB"
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Device", "parse_memory", "format_bytes"]

_UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_MEMORY_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_memory(value: int | float | str, *, name: str = "memory") -> int:
    """Parse a memory size (``"10GiB"``, ``"32GB"``, ``"512 MiB"``, ``1024``) into bytes.

    Usage: ``parse_memory("1.5GiB") == 1610612736``.
    Raises ``ValueError`` naming ``name`` for negative or unparseable values.
    """
    if isinstance(value, bool):
        raise ValueError(
            f"{name}={value!r} is not a memory size; use bytes (e.g. 1073741824) or a string like '1GiB'"
        )
    if isinstance(value, (int, float)):
        return _whole_bytes(value, value, name)
    if not isinstance(value, str):
        raise ValueError(
            f"{name}={value!r} ({type(value).__name__}) is not a memory size; use an int of bytes or a "
            "string like '10GiB'"
        )
    text = value.strip()
    if text.startswith("-"):
        raise ValueError(f"{name}={value!r} is negative; a memory size must be >= 0 bytes")
    m = _MEMORY_RE.match(text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"{name}={value!r} is not a memory size; write a number with an optional unit "
            "from B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '10GiB'"
        )
    return _whole_bytes(float(m.group(1)) * _UNITS[unit], value, name)


# a byte count beyond this (1 EiB) is a typo, not a budget; it also keeps sums of budgets finite
_MAX_BYTES = 2**60


def _whole_bytes(amount: int | float, value: int | float | str, name: str) -> int:
    """``amount`` bytes as an int; NaN, infinities, negatives and sizes over 1 EiB raise ``ValueError`` naming
    ``name``."""
    if isinstance(amount, float) and math.isnan(amount):
        raise ValueError(f"{name}={value!r} is not a number; give a size in bytes or a string like '80GiB'")
    if amount < 0:
        raise ValueError(f"{name}={value!r} is negative; a memory size must be >= 0 bytes")
    if amount > _MAX_BYTES:
        raise ValueError(
            f"{name}={value!r} is {'infinite' if math.isinf(amount) else 'over 1 EiB'}; give a finite size "
            "such as '80GiB' (leave the budget out to use the device's free memory)"
        )
    return int(amount)


def format_bytes(n: int | float | None) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


@dataclass
class Device:
    """One device torchspan can place work on.

    ``device`` is the ``torch.device``; ``total_memory``/``free_memory`` are bytes (``None`` when
    unknown); ``budget`` is the user's memory budget in bytes (``None``: use what is free).
    Devices found on this machine have ``source="found"``; devices described from a catalog
    (planning for hardware you do not have) carry where their figures come from.
    """

    device: torch.device
    name: str
    total_memory: int | None = None
    free_memory: int | None = None
    budget: int | None = None
    physical: str | None = None
    peak_flops: float | None = None
    host_bandwidth: float | None = None
    source: str = "found"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """Device type: ``"cpu"``, ``"cuda"``, ``"mps"``, ``"meta"``…"""
        return self.device.type

    @property
    def index(self) -> int | None:
        return self.device.index

    @property
    def capacity(self) -> int | None:
        """Bytes torchspan may use here: the budget if one was given, else free (or total) memory."""
        if self.budget is not None:
            return self.budget
        return self.free_memory if self.free_memory is not None else self.total_memory

    @property
    def present(self) -> bool:
        """True when the device exists on this machine (not merely described)."""
        return self.source == "found"

    def __str__(self) -> str:
        return str(self.device)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "kind": self.kind,
            "name": self.name,
            "total_memory": self.total_memory,
            "free_memory": self.free_memory,
            "budget": self.budget,
            "physical": self.physical,
            "peak_flops": self.peak_flops,
            "host_bandwidth": self.host_bandwidth,
            "source": self.source,
        }

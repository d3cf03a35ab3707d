"""Which list entries are one physical device, and what each device offers: budget, host link, memory
bandwidth.

List entries that are the same physical device (``['cpu', 'cpu']``, a present GPU listed twice)
share one ``identity`` and one name in ``physical_names``; the cost model treats them as ONE
device. Copies between devices go through the host, so a link runs at the slower of the two host
links; the CPU *is* the host (``inf``), and entries of one device hand over for free.

Usage::

    physical_names(devices("cpu,cpu,a100-40gb"))   # ['cpu', 'cpu', 'cuda:0']
    link_bandwidth(devs, 0, 2), budget_of(devs[2])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..hardware import Device

__all__ = [
    "INF",
    "DEFAULT_HOST_BANDWIDTH",
    "budget_of",
    "host_bandwidth",
    "memory_bandwidth",
    "identity",
    "physical_names",
    "link_bandwidth",
]

# Host link assumed when a found device does not report one (bytes/s): PCIe 3.0 x16, effective.
DEFAULT_HOST_BANDWIDTH: dict[str, float] = {"cuda": 12e9}
INF = math.inf


def host_bandwidth(dev: Device) -> float:
    """Bytes/s of ``dev``'s host link in one direction: ``inf`` for the CPU (it is the host), a default when
    unknown."""
    if dev.kind in ("cpu", "meta"):
        return INF
    if dev.host_bandwidth is not None and dev.host_bandwidth > 0:
        return float(dev.host_bandwidth)
    return DEFAULT_HOST_BANDWIDTH.get(dev.kind, INF)


def budget_of(dev: Device) -> float:
    """``dev``'s memory budget in bytes, ``inf`` when it has none. Usage:
    ``budget_of(profile.devices[0])``."""
    return float(dev.capacity) if dev.capacity is not None else INF


def memory_bandwidth(dev: Device) -> float:
    """Effective device-memory bytes/s (``extra``'s figure times its efficiency), 0 when unknown."""
    extra = dev.extra if isinstance(dev.extra, dict) else {}
    try:
        bw = float(extra.get("memory_bandwidth") or 0.0) * float(extra.get("memory_efficiency", 1.0))
    except (TypeError, ValueError):
        return 0.0
    return bw if math.isfinite(bw) and bw > 0 else 0.0


def identity(devs: Sequence[Device], index: int) -> str | None:
    """A key shared by list entries that are the same physical device (``['cpu', 'cpu']``)."""
    dev = devs[index]
    if dev.kind == "cpu":
        return "cpu"
    if dev.present:
        key = str(dev.device)
        if sum(1 for d in devs if d.present and str(d.device) == key) > 1:
            return key
    return None


def physical_names(devs: Sequence[Device]) -> list[str]:
    """Per list entry, the name of its physical device: shared by entries that are one device.

    ``str(device)`` normally (``'cpu'``, ``'cuda:0'``); distinct devices that print alike get
    ``'#index'`` appended so that no two physical devices share a name.
    """
    out: list[str] = []
    owner: dict[str, str | None] = {}  # printed name -> identity key of the entry that took it
    for d, dev in enumerate(devs):
        ident = identity(devs, d)
        name = str(dev.device)
        if name in owner and (ident is None or owner[name] != ident):
            name = f"{name}#{d}"
        owner.setdefault(name, ident)
        out.append(name)
    return out


def link_bandwidth(devs: Sequence[Device], a: int, b: int) -> float:
    """Bytes/s between ``devs[a]`` and ``devs[b]``: through the host at the slower host link."""
    ia, ib = identity(devs, a), identity(devs, b)
    if ia is not None and ia == ib:
        return INF
    return min(host_bandwidth(devs[a]), host_bandwidth(devs[b]))

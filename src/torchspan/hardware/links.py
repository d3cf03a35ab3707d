"""Links between devices and between machines: bandwidth and latency, with where each figure comes from.

The cluster planner (``planner.cluster``) prices gradient all-reduces and pipeline hand-overs with
these figures (``planner.comm``). ``bandwidth`` is bytes/s in ONE direction per device (datasheets
and marketing quote both directions together: NVLink 4 "900 GB/s" is 450e9 here; network links are
quoted per direction in bits: 400 Gb/s is 50e9 bytes/s). ``efficiency`` is the fraction of it that
collective libraries reach (a stated assumption, as ``catalog``'s efficiencies are), and
``latency`` the seconds one message costs before its first byte arrives (link plus library
software; for networks an assumption of the order that small-message benchmarks show).

Network links are per device: a node with 8 GPUs and ``ib-400g`` has one 400 Gb/s port per GPU
(as DGX H100 has); with one shared port, divide its figure by the devices per node.

Usage::

    from torchspan.hardware import links
    links.names()                                  # ['eth-100g', 'eth-25g', 'ib-200g', ...]
    link = links.lookup("ib-400g")                 # Link('ib-400g', 50e9 bytes/s, ...)
    link.effective_bandwidth, link.latency
    links.lookup("nvlink", catalog.lookup("a100-40gb"))   # NVLink 3, the A100's generation
    links.default_intra(dev), links.default_interconnect(dev)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .device import Device

__all__ = [
    "Link",
    "LINKS",
    "NVLINK_BY_DEVICE",
    "names",
    "lookup",
    "default_intra",
    "default_interconnect",
    "calibrated",
]

GIGA = 1e9
MICRO = 1e-6


@dataclass(frozen=True)
class Link:
    """One kind of link: one-direction bytes/s per device, achievable fraction, per-message latency,
    sources."""

    key: str
    name: str
    bandwidth: float  # bytes/s, one direction, per device
    latency: float  # seconds per message
    efficiency: float  # fraction of ``bandwidth`` that NCCL/gloo reach on large messages (assumption)
    source: str
    notes: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"Link({self.key!r}) bandwidth={self.bandwidth!r} must be > 0 bytes/s")
        if not self.latency >= 0:
            raise ValueError(f"Link({self.key!r}) latency={self.latency!r} must be >= 0 seconds")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Link({self.key!r}) efficiency={self.efficiency!r} must be in (0, 1]")

    @property
    def effective_bandwidth(self) -> float:
        """Bytes/s a large transfer gets: ``bandwidth * efficiency``."""
        return self.bandwidth * self.efficiency

    def short(self) -> str:
        """``'ib-400g (50 GB/s x 0.9, 3 us)'``: the figures without their sources."""
        return (
            f"{self.key} ({self.bandwidth / GIGA:g} GB/s x {self.efficiency:g}, {self.latency / MICRO:g} us)"
        )

    def describe(self) -> str:
        return (
            f"{self.key}: {self.name}, {self.bandwidth / GIGA:g} GB/s per direction x {self.efficiency:g}, "
            f"{self.latency / MICRO:g} us per message ({self.source})"
        )


_NV_LATENCY = "latency: assumption, the order of NCCL's small-message step time on one node (a few us)"
_NET_LATENCY = "latency: assumption, port latency plus NCCL/gloo software per message"

LINKS: tuple[Link, ...] = (
    Link(
        "nvlink2",
        "NVLink 2 (V100 SXM2)",
        150 * GIGA,
        5 * MICRO,
        0.8,
        f"NVIDIA Tesla V100 datasheet: NVLink 300 GB/s (both directions); {_NV_LATENCY}",
    ),
    Link(
        "nvlink3",
        "NVLink 3 (A100 SXM4)",
        300 * GIGA,
        5 * MICRO,
        0.8,
        f"NVIDIA A100 Tensor Core GPU datasheet: NVLink 600 GB/s (both directions); {_NV_LATENCY}",
    ),
    Link(
        "nvlink4",
        "NVLink 4 (H100 SXM5)",
        450 * GIGA,
        5 * MICRO,
        0.8,
        f"NVIDIA H100 Tensor Core GPU datasheet: NVLink 900 GB/s (both directions); {_NV_LATENCY}",
    ),
    Link(
        "pcie4",
        "PCIe Gen4 x16",
        32 * GIGA,
        10 * MICRO,
        0.8,
        "PCI-SIG PCIe 4.0: 16 GT/s x 16 lanes, 128b/130b = 31.5 GB/s per direction; latency: assumption "
        "(GPU-to-GPU through the host bridge)",
    ),
    Link(
        "pcie5",
        "PCIe Gen5 x16",
        64 * GIGA,
        10 * MICRO,
        0.8,
        "PCI-SIG PCIe 5.0: 32 GT/s x 16 lanes, 128b/130b = 63 GB/s per direction; latency: assumption "
        "(GPU-to-GPU through the host bridge)",
    ),
    Link(
        "ib-200g",
        "InfiniBand HDR 200 Gb/s",
        25 * GIGA,
        3 * MICRO,
        0.9,
        f"NVIDIA ConnectX-6 VPI product brief: 200 Gb/s per port, sub-600 ns port latency; {_NET_LATENCY}",
    ),
    Link(
        "ib-400g",
        "InfiniBand NDR 400 Gb/s",
        50 * GIGA,
        3 * MICRO,
        0.9,
        f"NVIDIA ConnectX-7 product brief: 400 Gb/s per port (DGX H100: one per GPU); {_NET_LATENCY}",
    ),
    Link(
        "eth-25g",
        "Ethernet 25 Gb/s (TCP)",
        3.125 * GIGA,
        30 * MICRO,
        0.9,
        f"IEEE 802.3by 25GBASE: 25 Gb/s per direction; {_NET_LATENCY} (TCP stack: tens of us)",
    ),
    Link(
        "eth-100g",
        "Ethernet 100 Gb/s (TCP)",
        12.5 * GIGA,
        20 * MICRO,
        0.9,
        f"IEEE 802.3ba/bj 100GBASE: 100 Gb/s per direction; {_NET_LATENCY} (TCP stack: tens of us)",
    ),
    # Calibrated, not quoted: benchmarks/plan_cluster.py fits latency and bandwidth to all-reduces of
    # 4 KiB .. 16 MiB over 2 gloo processes on 127.0.0.1 (relative least squares on the ring formula
    # of planner.comm), on the 2-core shared CPU of the machine that wrote benchmarks/RESULTS.md,
    # while other jobs loaded it (load average ~10): a pessimistic, noisy figure.
    Link(
        "loopback",
        "gloo over TCP on 127.0.0.1 (CPU processes on one machine)",
        0.82 * GIGA,
        275 * MICRO,
        1.0,
        "calibrated: benchmarks/plan_cluster.py, 2 gloo processes, 2-core shared CPU (see "
        "benchmarks/RESULTS.md)",
        notes="a measurement of one busy machine; re-run the benchmark to calibrate yours",
    ),
)

# the NVLink generation of each catalog GPU that has one (SXM parts); others have none
NVLINK_BY_DEVICE: dict[str, str] = {
    "h100-80gb": "nvlink4",
    "a100-40gb": "nvlink3",
    "a100-80gb": "nvlink3",
    "v100-16gb": "nvlink2",
    "v100-32gb": "nvlink2",
}
_HOST_LINK = {"PCIe Gen4 x16": "pcie4", "PCIe Gen5 x16": "pcie5"}
_ALIASES = {
    "gloo-cpu": "loopback",
    "gloo": "loopback",
    "localhost": "loopback",
    "ib-hdr": "ib-200g",
    "ib-ndr": "ib-400g",
    "pcie-gen4": "pcie4",
    "pcie-gen5": "pcie5",
}


def names() -> list[str]:
    """Link keys, sorted (``nvlink`` is also accepted: the generation of the device it joins)."""
    return sorted(link.key for link in LINKS)


def _catalog_key(device: Device | None) -> str | None:
    if device is None or not isinstance(device.extra, dict):
        return None
    key = device.extra.get("catalog")
    return key if isinstance(key, str) else None


def lookup(name: str, device: Device | None = None) -> Link:
    """The link called ``name`` (``"nvlink"``: ``device``'s generation). Raises ``ValueError`` naming the
    choices."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"link {name!r} must be one of nvlink, {', '.join(names())}")
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key == "nvlink":
        gen = NVLINK_BY_DEVICE.get(_catalog_key(device) or "")
        if gen is None:
            what = "an unnamed device" if device is None else f"{device.name}"
            raise ValueError(
                f"link 'nvlink' has no generation for {what}; name one "
                f"({', '.join(sorted(set(NVLINK_BY_DEVICE.values())))}) or use pcie4/pcie5 for GPUs "
                "without NVLink"
            )
        key = gen
    for link in LINKS:
        if link.key == key:
            return link
    raise ValueError(f"link {name!r} is not known; use one of nvlink, {', '.join(names())}")


def default_intra(device: Device) -> Link:
    """The link between devices of one node when none is named: NVLink for SXM GPUs, else the host link.

    CPU processes on one machine talk through ``loopback``.
    """
    if device.kind == "cpu":
        return lookup("loopback")
    gen = NVLINK_BY_DEVICE.get(_catalog_key(device) or "")
    if gen is not None:
        return lookup(gen)
    host = device.extra.get("host_link") if isinstance(device.extra, dict) else None
    return lookup(_HOST_LINK.get(str(host), "pcie4"))


def default_interconnect(device: Device) -> Link:
    """The link between nodes when none is named: ``ib-400g`` for GPUs, ``eth-25g`` for CPUs (assumptions)."""
    return lookup("eth-25g" if device.kind == "cpu" else "ib-400g")


def calibrated(link: Link, bandwidth: float, latency: float, source: str) -> Link:
    """A copy of ``link`` with measured figures (efficiency 1: the measurement is what is reached).

    Usage: ``calibrated(lookup("loopback"), 1.1e9, 90e-6, "measured here")``.
    """
    return dataclasses.replace(link, bandwidth=bandwidth, latency=latency, efficiency=1.0, source=source)

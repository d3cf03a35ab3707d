"""Communication times: ring all-reduce and point-to-point transfers over a ``hardware.links.Link``.

Ring all-reduce of ``S`` bytes over ``n`` devices (reduce-scatter then all-gather, each ``n - 1``
steps of ``S / n`` bytes per device), the bandwidth bound every ring reaches at best::

    allreduce(S, n) = 2 (n - 1) / n * S / bw  +  2 (n - 1) * latency        (0 when n == 1)

Point-to-point: ``p2p(S) = latency + S / bw``. ``bw`` is the link's effective bandwidth
(``bandwidth * efficiency``). A group spanning several links runs at the slowest of them
(``slowest``): a ring is as fast as its slowest hop.

Usage::

    allreduce_time(4 * 2**20, 8, links.lookup("nvlink4"))     # seconds
    p2p_time(2**20, links.lookup("ib-400g"))
"""

from __future__ import annotations

from collections.abc import Sequence

from ..hardware.links import Link

__all__ = ["allreduce_time", "p2p_time", "slowest", "ring_bytes"]


def _check_bytes(nbytes: float, where: str) -> float:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0:
        raise ValueError(f"{where}(nbytes={nbytes!r}) must be a number of bytes >= 0")
    return float(nbytes)


def ring_bytes(nbytes: float, n: int) -> float:
    """Bytes each device sends in a ring all-reduce of ``nbytes`` over ``n`` devices: ``2 (n-1)/n * nbytes``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"ring_bytes(n={n!r}) must be an int >= 1 (devices in the group)")
    return 2.0 * (n - 1) / n * _check_bytes(nbytes, "ring_bytes")


def allreduce_time(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``n`` devices joined by ``link`` (0 for ``n == 1`` or no bytes)."""
    sent = ring_bytes(nbytes, n)
    if n == 1 or nbytes == 0:
        return 0.0
    return sent / link.effective_bandwidth + 2 * (n - 1) * link.latency


def p2p_time(nbytes: float, link: Link) -> float:
    """Seconds to send ``nbytes`` from one device to another over ``link`` (0 for no bytes)."""
    nbytes = _check_bytes(nbytes, "p2p_time")
    return 0.0 if nbytes == 0 else link.latency + nbytes / link.effective_bandwidth


def slowest(links: Sequence[Link]) -> Link:
    """The link with the least effective bandwidth (ties: the larger latency). Usage: ``slowest([intra, inter])``."""
    if not links:
        raise ValueError("slowest(links=[]) needs at least one link")
    return min(links, key=lambda link: (link.effective_bandwidth, -link.latency))

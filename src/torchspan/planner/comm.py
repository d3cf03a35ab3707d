"""Communication times: ring all-reduce and point-to-point transfers over a ``hardware.links.Link``.

Ring all-reduce of ``S`` bytes over ``n`` devices (reduce-scatter then all-gather, each ``n - 1``
steps of ``S / n`` bytes per device), the bandwidth bound every ring reaches at best::

    allreduce(S, n) = 2 (n - 1) / n * S / bw  +  2 (n - 1) * latency        (0 when n == 1)

All-gather and reduce-scatter of a tensor of ``S`` bytes (whole; each device holds or ends with
``S / n``) are the two halves of that ring, as sharded data parallel (FSDP2, ZeRO-3) runs them::

    allgather(S, n) = reduce_scatter(S, n) = (n - 1) / n * S / bw  +  (n - 1) * latency

Point-to-point: ``p2p(S) = latency + S / bw``. ``bw`` is the link's effective bandwidth
(``bandwidth * efficiency``). A group spanning several links runs at the slowest of them
(``slowest``): a ring is as fast as its slowest hop.

Overlap with backward. Gradients become ready layer by layer, last layer first. The data-parallel
runtime (``DataParallelReplica``: DDP with ``bucket_cap_mb=25``, so every bucket, the first one too,
holds ``BUCKET_BYTES``) groups them in that order into buckets (``buckets``: a bucket closes once it
holds ``BUCKET_BYTES`` or more) and all-reduces each as soon as it is full, one after another on the
link; ``finish_time`` says when the last of such a stream of all-reduces ends::

    end_k = max(end_{k-1}, ready_k) + allreduce(bytes_k)        (end_0 = -inf)

Usage::

    allreduce_time(4 * 2**20, 8, links.lookup("nvlink4"))     # seconds
    p2p_time(2**20, links.lookup("ib-400g"))
    allgather_time(4 * 2**20, 8, links.lookup("nvlink4"))     # half the all-reduce's bytes and latency
    buckets([4e6, 30e6, 4e6], BUCKET_BYTES)                    # [(1, 34e6), (2, 4e6)]: (closing item, bytes)
    finish_time([-3e-3, 0.0], [2e-3, 1e-3])                    # 1e-3: the last all-reduce ends 1 ms after 0
"""

from __future__ import annotations

from collections.abc import Sequence

from ..hardware.links import Link

__all__ = [
    "BUCKET_BYTES",
    "allgather_time",
    "allreduce_time",
    "reduce_scatter_time",
    "buckets",
    "finish_time",
    "p2p_time",
    "ring_bytes",
    "slowest",
]

BUCKET_BYTES = (
    25 * 2**20
)  # runtime/ranks/dataparallel.py: DataParallelReplica(bucket_cap_mb=25.0), every bucket


def _check_bytes(nbytes: float, where: str) -> float:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0:
        raise ValueError(f"{where}(nbytes={nbytes!r}) must be a number of bytes >= 0")
    return float(nbytes)


def ring_bytes(nbytes: float, n: int) -> float:
    """Bytes each device sends in a ring all-reduce of ``nbytes`` over ``n`` devices: ``2 (n-1)/n *
    nbytes``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"ring_bytes(n={n!r}) must be an int >= 1 (devices in the group)")
    return 2.0 * (n - 1) / n * _check_bytes(nbytes, "ring_bytes")


def allreduce_time(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``n`` devices joined by ``link`` (0 for ``n == 1`` or
    no bytes)."""
    sent = ring_bytes(nbytes, n)
    if n == 1 or nbytes == 0:
        return 0.0
    return sent / link.effective_bandwidth + 2 * (n - 1) * link.latency


def allgather_time(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring all-gather of a tensor of ``nbytes`` (whole) over ``n`` devices on ``link``:
    ``(n - 1) / n * nbytes / bw + (n - 1) * latency`` (0 for ``n == 1`` or no bytes)."""
    sent = ring_bytes(nbytes, n) / 2
    if n == 1 or nbytes == 0:
        return 0.0
    return sent / link.effective_bandwidth + (n - 1) * link.latency


def reduce_scatter_time(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring reduce-scatter of ``nbytes`` (whole) over ``n`` devices: as ``allgather_time``."""
    return allgather_time(nbytes, n, link)


def p2p_time(nbytes: float, link: Link) -> float:
    """Seconds to send ``nbytes`` from one device to another over ``link`` (0 for no bytes)."""
    nbytes = _check_bytes(nbytes, "p2p_time")
    return 0.0 if nbytes == 0 else link.latency + nbytes / link.effective_bandwidth


def slowest(links: Sequence[Link]) -> Link:
    """The link with the least effective bandwidth (ties: the larger latency). Usage: ``slowest([intra,
    inter])``."""
    if not links:
        raise ValueError("slowest(links=[]) needs at least one link")
    return min(links, key=lambda link: (link.effective_bandwidth, -link.latency))


def buckets(sizes: Sequence[float], cap: float) -> list[tuple[int, float]]:
    """Items (bytes, in the order they become ready) grouped into buckets of at least ``cap`` bytes.

    Returns ``(index of the item that closes the bucket, bytes)`` per bucket, in launch order: a
    bucket closes with the item that brings it to ``cap`` or more (DDP's rule); the last bucket holds
    what is left. Items of 0 bytes join the open bucket. Usage: ``buckets(layer_grad_bytes[::-1],
    BUCKET_BYTES)``.
    """
    if not cap > 0:
        raise ValueError(f"buckets(cap={cap!r}) must be a number of bytes > 0")
    out: list[tuple[int, float]] = []
    held = 0.0
    for k, nbytes in enumerate(sizes):
        held += _check_bytes(nbytes, "buckets")
        if held >= cap:
            out.append((k, held))
            held = 0.0
    if held > 0 or (sizes and not out):
        out.append((len(sizes) - 1, held))
    return out


def finish_time(ready: Sequence[float], seconds: Sequence[float]) -> float:
    """When the last of a stream of all-reduces ends, each starting once it is ready and the one before ended.

    ``ready[k]``, ``seconds[k]``: when all-reduce ``k`` may start and how long it takes (launch order,
    one link). ``-inf`` for no all-reduce. Usage: ``finish_time([-3e-3, 0.0], [2e-3, 1e-3]) == 1e-3``.
    """
    if len(ready) != len(seconds):
        raise ValueError(f"finish_time: {len(ready)} ready times for {len(seconds)} durations")
    end = float("-inf")
    for start, took in zip(ready, seconds):
        end = max(end, start) + took
    return end

"""``torchspan plan``'s cluster options: ``--nodes``, ``--interconnect``, ``--intra-link``,
``--data-parallel``, ``--tp``.

Usage::

    add_cluster_options(parser)
    plan(model, x, devices=args.devices, **cluster_kwargs(args))   # {} without cluster options: as before
"""

from __future__ import annotations

import argparse
from typing import Any

from ..hardware import links
from ._common import UsageError
from ._common import parse_microbatches as _count

__all__ = ["add_cluster_options", "cluster_kwargs"]


def add_cluster_options(p: argparse.ArgumentParser) -> None:
    """Add the cluster options to the ``plan`` parser."""
    known = ", ".join(["nvlink", *links.names()])
    p.add_argument(
        "--nodes",
        default=None,
        metavar="N",
        help="plan for N machines, each with --devices (a data x pipeline plan over nodes x devices ranks)",
    )
    p.add_argument(
        "--interconnect",
        default=None,
        metavar="LINK",
        help=f"link between nodes: {known} (default ib-400g for GPUs)",
    )
    p.add_argument(
        "--intra-link",
        default=None,
        metavar="LINK",
        help="link between a node's devices (default: NVLink for SXM GPUs, else PCIe)",
    )
    p.add_argument(
        "--data-parallel",
        default="auto",
        metavar="N",
        help="data-parallel degree (default: search; must divide the ranks)",
    )
    p.add_argument(
        "--tp",
        default="auto",
        metavar="N",
        help="tensor-parallel degree within a node (default: price 2, 4 and 8 where they divide --devices; "
        "1: none)",
    )


def cluster_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``plan()`` keyword arguments from the parsed options; empty when none was given."""
    out: dict[str, Any] = {}
    if args.nodes is not None:
        try:
            nodes = int(args.nodes)
        except ValueError:
            nodes = 0
        if nodes < 1:
            raise UsageError(
                f"--nodes {args.nodes!r} must be an integer >= 1 (machines, each with --devices)"
            )
        out["nodes"] = nodes
    for option, key in (("--interconnect", "interconnect"), ("--intra-link", "intra_link")):
        value = getattr(args, key)
        if value is None:
            continue
        if value.strip().lower() != "nvlink":
            try:
                links.lookup(value)
            except ValueError as exc:
                raise UsageError(f"{option} {value!r}: {exc}") from None
        out[key] = value
    if args.data_parallel != "auto":
        out["data_parallel"] = _count(args.data_parallel, "--data-parallel")
    if args.tp != "auto":
        out["tp"] = _count(args.tp, "--tp")
    if "interconnect" in out and out.get("nodes", 1) == 1 and "intra_link" not in out:
        raise UsageError(f"--interconnect {out['interconnect']} joins nodes; add --nodes N (N >= 2)")
    return out

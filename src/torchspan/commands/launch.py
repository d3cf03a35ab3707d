"""``torchspan launch [--nproc-per-node N|auto] [--nnodes K --node-rank I --master-addr A --master-port P |
--rdzv-endpoint HOST:PORT] [--max-restarts R] SCRIPT.py [script args]``: one process per replica.

Built on ``torch.distributed.run`` (torchrun): the script sees torchrun's environment and runs the
same under plain ``torchrun``. Exit status: 0, 1 when a rank failed, 2 for bad arguments. A failure
prints a summary first: the rank that raised (with its traceback's frames in the script) or was
killed, or the rank that stopped answering while the others waited (``TORCHSPAN_TIMEOUT`` seconds,
default 300) and what it was doing; the full tracebacks stay in the file it names
(``TORCHSPAN_VERBOSE=1`` prints them as they happen). Workers end when the launcher dies.
"""

from __future__ import annotations

import argparse

from ..launch import launch
from ._common import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="run a training script data-parallel over processes (torchrun underneath)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        default="auto",
        metavar="N|auto",
        help="processes on this node: a count, or auto (one per GPU; on CPUs up to 8, cores divided among "
        "them; default auto)",
    )
    p.add_argument("--nnodes", default="1", metavar="K", help="number of nodes (default 1)")
    p.add_argument(
        "--node-rank", "--node_rank", default="0", metavar="I", help="this node's index in [0, K) (default 0)"
    )
    p.add_argument(
        "--master-addr", "--master_addr", default=None, metavar="A", help="node 0's address (several nodes)"
    )
    p.add_argument(
        "--master-port",
        "--master_port",
        default=None,
        metavar="P",
        help="a port on node 0, the same on every node (one node: default, a free port)",
    )
    p.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        metavar="HOST:PORT",
        help="c10d rendezvous endpoint instead of --master-addr/--master-port",
    )
    p.add_argument(
        "--max-restarts",
        "--max_restarts",
        default="0",
        metavar="R",
        help="restart every rank up to R times after a failure, to resume from your checkpoint (default 0)",
    )
    p.add_argument("script", metavar="SCRIPT.py", nargs="?", default=None, help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def _count(option: str, text: str, low: int, other: str = "") -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise UsageError(f"{option} {text!r} must be {other}an integer >= {low}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.script is None:  # argparse would say "script_args" is required too, which it is not
        raise UsageError(
            "a training script is required: torchspan launch [--nproc-per-node N|auto] SCRIPT.py [script "
            "args], e.g. torchspan launch --nproc-per-node 2 train.py --epochs 3"
        )
    nproc = (
        "auto"
        if args.nproc_per_node == "auto"
        else _count("--nproc-per-node", args.nproc_per_node, 1, "'auto' or ")
    )
    return launch(
        args.script,
        args.script_args,
        nproc_per_node=nproc,
        nnodes=_count("--nnodes", args.nnodes, 1),
        node_rank=_count("--node-rank", args.node_rank, 0),
        master_addr=args.master_addr,
        master_port=None if args.master_port is None else _count("--master-port", args.master_port, 1),
        rdzv_endpoint=args.rdzv_endpoint,
        max_restarts=_count("--max-restarts", args.max_restarts, 0),
    )

"""``torchspan devices [SPEC] [--memory DEV=SIZE ...] [--json]``: the device inventory."""

from __future__ import annotations

import argparse

from rich.table import Table

from .. import pictures
from ..hardware import devices
from ._common import console, parse_memory_options, print_json
from ._options import add_json_option, add_memory_option


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("devices", help="list devices with memory and budgets", description=__doc__)
    p.add_argument(
        "spec",
        nargs="?",
        default="auto",
        help="device spec: auto (default), cpu, cuda, 'cuda:0,1', 'cuda:0,cpu', mps",
    )
    add_memory_option(p)
    add_json_option(p, "the devices")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    found = devices(args.spec, memory=parse_memory_options(args.memory))
    if args.json:
        print_json([d.to_dict() for d in found])
        return 0
    table = Table(title=f"torchspan devices ({args.spec})")
    for col in (*pictures.DEVICE_COLUMNS, "logical -> physical"):
        table.add_column(col, justify="right" if col in ("total", "free", "budget") else "left")
    for d, row in zip(found, pictures.device_rows(found)):
        table.add_row(*row, f"{d.device} -> {d.physical}" if d.kind == "cuda" else str(d.physical or "-"))
    console().print(table)
    return 0

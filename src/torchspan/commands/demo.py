"""``torchspan demo [--devices SPEC] [--memory DEV=SIZE ...] [--steps N] [--out DIR]``: watch torchspan train across your devices.

Also ``--schedule gpipe|1f1b`` and ``--microbatches N`` to override the planner's choice, and
``--nproc N`` to train data-parallel over N processes instead (report.md gives per-rank throughput).

Trains a small character-level transformer on torchspan's own source code, planned for the given
devices and run pipelined with ``span``; shows the devices, the plan and live training figures,
prints a text sample, and writes plan.json, loss.png, timeline.png, memory.png and report.md to DIR.

Usage: ``torchspan demo``; ``torchspan demo --devices cpu,cpu --steps 100 --out /tmp/demo``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ._common import UsageError, add_memory_option, console, parse_memory_options, parse_microbatches


def register(sub: argparse._SubParsersAction) -> None:
    from ..demo.run import DEFAULT_STEPS

    p = sub.add_parser("demo", help="train a small language model across your devices and draw what happened", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", default="auto", metavar="SPEC", help="device spec: auto (default), cpu, 'cpu,cpu' (two-stage pipeline), 'cuda:0,cpu', ...")
    add_memory_option(p)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"training steps (default {DEFAULT_STEPS})")
    p.add_argument("--out", default="torchspan-demo", metavar="DIR", help="folder for plan.json, the pictures and report.md (default ./torchspan-demo)")
    p.add_argument("--schedule", choices=("auto", "gpipe", "1f1b"), default="auto", help="pipeline schedule (default: the planner's choice)")
    p.add_argument("--microbatches", default="auto", metavar="N", help="micro-batches per step (default: the planner's choice)")
    p.add_argument("--nproc", type=int, default=None, metavar="N", help="train data-parallel over N >= 2 processes instead (gloo on this machine's CPU)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..demo.run import run_demo

    if args.steps < 1:
        raise UsageError(f"--steps {args.steps} must be >= 1")
    microbatches = parse_microbatches(args.microbatches)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out!r} is a file; name a folder for plan.json, the pictures and report.md (it is created if missing), e.g. --out torchspan-demo")
    if args.nproc is not None:
        return _run_ranks(args, microbatches)
    run_demo(
        devices=args.devices,
        memory=parse_memory_options(args.memory),
        steps=args.steps,
        out=args.out,
        console=console(),
        schedule=args.schedule,
        microbatches=microbatches,
    )
    return 0


def _run_ranks(args: argparse.Namespace, microbatches: object) -> int:
    """``--nproc N``: data parallel over N processes (``demo.ranks``); pipeline options do not apply."""
    from ..demo.ranks import run_demo_ranks

    if args.nproc < 2:
        raise UsageError(f"--nproc {args.nproc} must be >= 2 (data parallel over N processes); drop --nproc to train in one process")
    given = [
        opt
        for opt, on in (
            ("--devices", args.devices != "auto"),
            ("--memory", bool(args.memory)),
            ("--schedule", args.schedule != "auto"),
            ("--microbatches", microbatches != "auto"),
        )
        if on
    ]
    if given:
        raise UsageError(f"--nproc {args.nproc} trains one replica per CPU process, so {', '.join(given)} do not apply; drop them or drop --nproc")
    run_demo_ranks(args.nproc, steps=args.steps, out=args.out, console=console())
    return 0

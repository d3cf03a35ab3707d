"""``torchspan demo [--devices SPEC] [--memory DEV=SIZE ...] [--steps N] [--out DIR] [--json]``: watch
torchspan train across your devices.

Also ``--schedule gpipe|1f1b`` and ``--microbatches N`` to override the planner's choice, and
``--nproc-per-node N`` to train data-parallel over N processes instead (report.md gives per-rank throughput),
with ``--tp T`` tensor-parallel (each block's MLP split over T of them; parity with one device in report.md).

Trains a small character-level transformer on torchspan's own source code, planned for the given
devices and run pipelined with ``span``. On any machine it shows a span: without a GPU the planner
keeps the model on the CPU (one stage), so the demo runs it as two pipeline stages on the CPU
(cpu, cpu) and says so, and says what a GPU machine would run instead. Before training, one step's
gradients are checked against the same model on one device (max abs/rel difference), and plain
PyTorch trains the first steps beside the span on the same batches. Shows the devices, the plan and
live training figures, prints a text sample, and writes plan.json, loss.png, timeline.png,
memory.png and report.md (what ran and why) to DIR. ``--json`` prints the report's figures and the
paths written as JSON (the live output goes to stderr).

Usage: ``torchspan demo``; ``torchspan demo --devices cpu,cpu,cpu --steps 100 --out /tmp/demo``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console

from ._common import UsageError, console, parse_memory_options, parse_microbatches, print_json
from ._options import (
    add_devices_option,
    add_json_option,
    add_memory_option,
    add_microbatches_option,
    add_nproc_option,
    add_out_option,
    add_schedule_option,
)


def register(sub: argparse._SubParsersAction) -> None:
    from ..demo.run import DEFAULT_STEPS

    p = sub.add_parser(
        "demo",
        help="train a small language model across your devices and draw what happened",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_devices_option(
        p,
        "train on these devices ('cpu,cpu': a two-stage pipeline; auto: a span on any machine, cpu,cpu "
        "without a GPU)",
        default="auto",
    )
    add_memory_option(p)
    p.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"training steps (default {DEFAULT_STEPS})"
    )
    add_out_option(p, "DIR", "plan.json, the pictures and report.md", default="torchspan-demo")
    add_schedule_option(p, default="auto")
    add_microbatches_option(p, auto=True, default="auto")
    add_nproc_option(
        p, "train data-parallel over N >= 2 processes instead (gloo on this machine's CPU)", default=None
    )
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="T",
        help="with --nproc-per-node: split each block's MLP over T of the processes (tensor parallel; N / T "
        "sharded "
        "replicas) and report parity with one device (default none: data parallel)",
    )
    add_json_option(p, "the report's figures and the files written", " (the live output goes to stderr)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..demo.run import DEMO_FILES, run_demo
    from ..files import output_folder

    if args.steps < 1:
        raise UsageError(f"--steps {args.steps} must be >= 1")
    microbatches = parse_microbatches(args.microbatches)
    output_folder(args.out, name="--out", files=DEMO_FILES, example="torchspan-demo")  # before any training
    con = console(sys.stderr) if args.json else console()
    if args.nproc_per_node is not None:
        return _run_ranks(args, microbatches, con)
    if args.tp is not None:
        raise UsageError(
            f"--tp {args.tp} splits layers over processes: pass --nproc-per-node N too (a multiple of "
            f"{args.tp})"
        )
    result = run_demo(
        devices=args.devices,
        memory=parse_memory_options(args.memory),
        steps=args.steps,
        out=args.out,
        console=con,
        schedule=args.schedule,
        microbatches=microbatches,
    )
    if args.json:
        print_json(_demo_json(result))
    return 0


def _run_ranks(args: argparse.Namespace, microbatches: object, con: Console) -> int:
    """``--nproc-per-node N``: data parallel over N processes (``demo.ranks``); pipeline options do not
    apply."""
    from ..demo.ranks import run_demo_ranks

    nproc = args.nproc_per_node
    if nproc < 2:
        raise UsageError(
            f"--nproc-per-node {nproc} must be >= 2 (data parallel over N processes); drop "
            "--nproc-per-node to train in one process"
        )
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
        raise UsageError(
            f"--nproc-per-node {nproc} trains one replica per CPU process, so {', '.join(given)} do not "
            "apply; drop them or drop --nproc-per-node"
        )
    if args.tp is not None and (args.tp < 2 or nproc % args.tp):
        raise UsageError(f"--tp {args.tp} must be >= 2 and divide --nproc-per-node {nproc}")
    result = run_demo_ranks(nproc, steps=args.steps, out=args.out, console=con, tp=args.tp)
    if args.json:
        print_json(_ranks_json(result))
    return 0


def _losses(losses: list[float]) -> dict[str, Any]:
    tail = losses[-20:]
    return {
        "first": losses[0],
        "last": losses[-1],
        "last_20_mean": sum(tail) / len(tail),
        "steps": len(losses),
    }


def _demo_json(result: Any) -> dict[str, Any]:
    """The pipelined demo's figures (``demo.run.DemoResult``): plan, devices, loss, speed, sample and
    files."""
    return {
        "strategy": "pipeline",
        "out": str(result.out),
        "devices": [str(d.device) for d in result.devices],
        "plan": result.plan.to_dict(),
        "loss": _losses(result.losses),
        "seconds": result.seconds,
        "seconds_per_step": result.seconds / len(result.losses),
        "predicted_step_time": result.plan.predicted_step_time,
        "tokens_per_second": result.tokens_per_second,
        "sample": result.sample,
        "losses": result.losses,
        "files": {name: str(path) for name, path in result.files.items()},
        "found_devices": [str(d.device) for d in result.found],
        "planner_choice": None if result.chosen is None else result.chosen.to_dict(),
        "gradient_check": None if result.check is None else result.check.to_dict(),
        "one_device": None if result.one_device is None else result.one_device.to_dict(),
        "ms_per_step": result.ms_per_step,
        "why": result.story,
        "gpu_machine": result.gpu_machine or None,
        "next": [line for line in result.next if not line.startswith("#")],
    }


def _ranks_json(result: Any) -> dict[str, Any]:
    """The data-parallel demo's figures (``demo.ranks.RanksDemoResult``): per-rank throughput, loss, sample
    and files."""
    return {
        "strategy": "data-parallel" if result.tp is None else "tensor-parallel",
        "out": str(result.out),
        "nproc_per_node": result.nproc,
        "tp": result.tp,
        "parity": result.parity,
        "ranks": [{k: v for k, v in r.items() if k not in ("losses", "sample")} for r in result.ranks],
        "loss": _losses(result.losses),
        "seconds": result.seconds,
        "sample": result.sample,
        "losses": result.losses,
        "files": {name: str(path) for name, path in result.files.items()},
    }

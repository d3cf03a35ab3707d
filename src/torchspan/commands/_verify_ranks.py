"""``torchspan verify ... --strategies single,local-pipeline,dp,rank-pipeline,hybrid,fsdp --nproc-per-node
2|4``: the printing half.

``torchspan.parity_ranks.compare_strategies`` runs the steps (multi-process ones in gloo processes);
this prints one table per strategy (per-parameter max abs / rel difference against one device), a
summary line per strategy and PASS/FAIL (``--json``: the same as JSON), and returns the exit status
(1 when any strategy is out of tolerance or failed to run).

Usage: ``torchspan verify models.py:mlp --input-shape 7,16 --strategies single,dp,rank-pipeline
--nproc-per-node 2``.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from rich.table import Table

from ..parity_ranks import StepOptions, StrategyResult, compare_strategies, processes_for
from ..training import mse_loss
from ._common import UsageError, console, print_json
from ._target import build_for_verify

__all__ = ["run_strategies"]


# strategies that run nothing of their kind in one process, and what each would need the others for
_NEEDS_TWO = {
    "dp": "data parallel (gradients averaged across replicas)",
    "rank-pipeline": "a pipeline across ranks (one stage per process)",
    "hybrid": "the hybrid (2 stages x 2 replicas)",
    "fsdp": "sharded data parallel (parameters, gradients and optimizer state split over the processes)",
    "tp": "tensor parallel (each layer split over the processes)",
    "tp-fsdp": "tensor parallel x sharded",
}


def tp_plan(text: str | None) -> tuple[tuple[str, str], ...] | None:
    """``--tp-plan 0=colwise,2=rowwise`` as (module pattern, style) pairs; ``None``: the model's own plan."""
    if not text:
        return None
    pairs = [item.partition("=") for item in text.split(",") if item.strip()]
    bad = [f"{k}{eq}{v}" for k, eq, v in pairs if not eq or not k.strip() or not v.strip()]
    if bad:
        raise UsageError(
            f"--tp-plan {text!r}: {bad[0]!r} is not MODULE=STYLE; e.g. --tp-plan 0=colwise,2=rowwise"
        )
    return tuple((k.strip(), v.strip()) for k, _, v in pairs)


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError(
            f"--strategies {text!r} names no strategy; e.g. --strategies single,local-pipeline,dp"
        )
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"--strategies {text!r} names {', '.join(twice)} twice; list each strategy once")
    return names


def _summary(r: StrategyResult) -> str:
    where = "this process" if r.processes == 0 else f"{r.processes} processes"
    if r.parity is None:
        return f"{r.name} ({where}): FAIL, did not run: {r.error}"
    p = r.parity
    worst_abs = max((g.max_abs for g in p.grads), default=0.0)
    worst_rel = max((g.max_rel for g in p.grads), default=0.0)
    bad = sum(not g.within for g in p.grads)
    verdict = "PASS" if r.ok else "FAIL"
    loss = f"loss {p.loss:.6g} vs {p.reference_loss:.6g}" + ("" if p.same_loss else " (DIFFERENT)")
    return (
        f"{r.name} ({where}): {verdict}, max abs diff {worst_abs:.3e}, max rel diff {worst_rel:.3e}, "
        f"{bad} of {len(p.grads)} parameter(s) out of tolerance, {loss}, "
        + (
            f"{r.seconds:.1f} s"
            if r.processes == 0
            else f"{r.seconds:.1f} s for the whole {r.processes}-process run"
        )
    )


def _table(r: StrategyResult) -> Table:
    table = Table(title=f"{r.name}: gradient difference vs one device, per parameter")
    for col in ("parameter", "max abs diff", "max rel diff", "result"):
        table.add_column(col, justify="left" if col in ("parameter", "result") else "right")
    assert r.parity is not None
    for g in r.parity.grads:
        table.add_row(g.name, f"{g.max_abs:.3e}", f"{g.max_rel:.3e}", "ok" if g.within else "DIFFERENT")
    return table


def run_strategies(
    args: argparse.Namespace,
    model: torch.nn.Module,
    x: Any,
    balance: list[int] | None,
    target: Callable[[Any], Any],
    notes: Sequence[str] = (),
) -> int:
    """Compare ``args.strategies`` with one device and print them (``target(output)``: the step's target;
    ``notes``: printed under the heading); 0 when all pass, 1 otherwise."""
    names = _names(args.strategies)
    nproc = args.nproc_per_node
    if nproc < 1:
        raise UsageError(f"--nproc-per-node {nproc} must be >= 1, e.g. --nproc-per-node 2")
    alone = [n for n in names if n in _NEEDS_TWO]
    if (
        alone and nproc < 2
    ):  # one process: no replica to average with, no stage to hand over to; a PASS would prove nothing
        raise UsageError(
            f"--strategies {','.join(alone)} with --nproc-per-node {nproc}: {_NEEDS_TWO[alone[0]]} needs "
            "at least 2 processes; pass --nproc-per-node "
            f"{4 if 'hybrid' in alone or 'tp-fsdp' in alone else 2}, or compare single and local-pipeline "
            "alone"
        )
    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout:g} must be > 0 seconds, e.g. --timeout 180")
    options = StepOptions(
        microbatches=args.microbatches,
        schedule=args.schedule,
        recompute=args.recompute,
        balance=tuple(balance) if balance else None,
        devices=tuple(d.strip() for d in args.devices.split(",") if d.strip()),
        loss_reduction="mean",  # mse_loss: a mean over rows, so shards weigh by their row counts
        tp_plan=tp_plan(args.tp_plan),
    )
    counts = processes_for(names, nproc, options)  # a ValueError (exit 2) before anything runs
    con = console()
    if not args.json:
        con.print(
            f"torchspan verify {args.target}: strategies "
            f"{', '.join(f'{n} ({c} processes)' if c else n for n, c in counts.items())}; "
            f"microbatches={args.microbatches}, schedule={args.schedule}, "
            f"balance={list(balance) if balance else 'even'}, seed={args.seed}"
        )
        for note in notes:
            con.print(f"note: {note}")
    results = compare_strategies(
        model,
        x,
        target,
        mse_loss,
        names,
        build=functools.partial(build_for_verify, args.target),
        nproc=nproc,
        options=options,
        atol=args.atol,
        rtol=args.rtol,
        timeout=args.timeout,
    )
    ok = all(r.ok for r in results)
    if args.json:
        print_json({**_as_json(args, options, results, ok), "notes": list(notes)})
        return 0 if ok else 1
    for r in results:
        if r.parity is not None:
            con.print(_table(r))
    for r in results:
        con.print(_summary(r))
    con.print(
        f"{'PASS' if ok else 'FAIL'}: {sum(r.ok for r in results)} of {len(results)} strategies match one "
        f"device (atol={args.atol:g}, rtol={args.rtol:g})"
    )
    return 0 if ok else 1


def _strategy_json(r: StrategyResult) -> dict[str, Any]:
    """One strategy's result: processes (0: this process), verdict, the error that stopped it, losses and
    per-parameter differences."""
    p = r.parity
    return {
        "name": r.name,
        "processes": r.processes,
        "verdict": "PASS" if r.ok else "FAIL",
        "error": r.error,
        "seconds": r.seconds,
        "loss": p.loss if p is not None else None,
        "reference_loss": p.reference_loss if p is not None else None,
        "same_loss": p.same_loss if p is not None else None,
        "parameters": [g.to_dict() for g in p.grads] if p is not None else [],
    }


def _as_json(
    args: argparse.Namespace, options: StepOptions, results: list[StrategyResult], ok: bool
) -> dict[str, Any]:
    return {
        "target": args.target,
        "microbatches": options.microbatches,
        "schedule": options.schedule,
        "recompute": options.recompute,
        "balance": list(options.balance) if options.balance else None,
        "seed": args.seed,
        "nproc_per_node": args.nproc_per_node,
        "atol": args.atol,
        "rtol": args.rtol,
        "strategies": [_strategy_json(r) for r in results],
        "verdict": "PASS" if ok else "FAIL",
    }

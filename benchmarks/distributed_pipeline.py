"""Pipelines across processes: torchspan against torch.distributed.pipelining and plain DDP.

1. **2-rank pipeline** (``pipeline``): the same ``nn.Sequential`` cut in two, the same micro-batches,
   2 gloo processes; torchspan ``span(model, balance=..., schedule="1f1b")`` against
   ``torch.distributed.pipelining`` ``PipelineStage`` + ``Schedule1F1B``. Prints the median step
   times, their ratio torchspan / torch and the median of per-round ratios (goal <= 0.9).
   ``--schedule 1f1b gpipe`` times several torchspan schedules in the same rounds (torch's
   stays ``Schedule1F1B``), each with its own ratios. ``--batch-check-cost`` adds each torchspan
   pipeline with its per-step same-batch check off, and prints checked / unchecked.
2. **Hybrid 2 x 2** (``hybrid``) on 4 processes against plain ``DistributedDataParallel`` of the
   whole model (each DDP rank a quarter of the batch).

Fairness: both sides run in the same processes with the same intra-op threads (``--threads``,
default cores // processes), the same stages, batch and micro-batches; both are warmed up
(``--warmup`` steps each) and a round times one step of each, the order swapping every round
(torchspan first, then torch first, ...), with a barrier around each step. Wall-clock medians; on a
machine with few cores the processes share them: say so (and the load average) next to the numbers.

Usage: ``python benchmarks/distributed_pipeline.py [--steps 20] [--only pipeline|hybrid]``, or the same
through ``python benchmarks/distributed.py --pipeline`` / ``--hybrid`` (flags below pass through).
``--quick`` (``torchspan bench --quick``): tiny sizes, 2 rounds; each ratio also as a ``RATIO`` line.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torchspan  # noqa: E402
from torchspan.schedule import SCHEDULES  # noqa: E402
from torchspan.runtime.ranks import free_port, init_distributed  # noqa: E402
from _quick import add_quick  # noqa: E402  (benchmarks/_quick.py, beside this script)


def _model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _rounds(steps: dict[str, Any], args: argparse.Namespace) -> dict[str, list[float]]:
    """Warm every variant up, then ``args.steps`` rounds of one step each, the order reversed every other round."""
    names = list(steps)
    for _ in range(args.warmup):
        for name in names:
            _timed(steps[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.steps):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(_timed(steps[name]))
    return times


def _join(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // world))
    init_distributed(timeout=120)


def _pipeline(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    _join(rank, world, port, args)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)
    loss_fn = nn.MSELoss()
    n = 2 * args.depth
    ours = {
        f"torchspan {name}": torchspan.span(_model(args.width, args.depth), balance=[n // 2, n - n // 2], microbatches=args.microbatches, schedule=name)
        for name in args.schedule
    }
    spent: dict[str, tuple[list[float], list[float]]] = {}  # seconds in check_same_batch and its verdict's wait, per step
    if args.batch_check_cost:  # the same pipelines with the per-step same-batch check switched off, in the same rounds
        for name in args.schedule:
            unchecked = torchspan.span(_model(args.width, args.depth), balance=[n // 2, n - n // 2], microbatches=args.microbatches, schedule=name)
            unchecked._executor.ranks.check_same_batch = lambda *args: None
            ours[f"{name} unchecked"] = unchecked
            spent[name] = _clocked(ours[f"torchspan {name}"]._executor.ranks)
    whole = _model(args.width, args.depth)
    half = nn.Sequential(*list(whole)[: n // 2]) if rank == 0 else nn.Sequential(*list(whole)[n // 2 :])
    stage = PipelineStage(half, rank, world, torch.device("cpu"))
    theirs = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)

    def step_ours(spanned: torchspan.Spanned):  # type: ignore[no-untyped-def]
        def step() -> None:
            spanned.zero_grad()
            spanned.train_step(x, y, loss_fn)

        return step

    def step_theirs() -> None:
        half.zero_grad()
        if rank == 0:
            theirs.step(x)
        else:
            theirs.step(target=y, losses=[])

    steps = {name: step_ours(spanned) for name, spanned in ours.items()}
    times = _rounds({**steps, "torch": step_theirs}, args)
    if rank == 0:
        _report(out, "pipeline 2 ranks (torch: Schedule1F1B)", times, [k for k in steps if "unchecked" not in k], "torch", "pipeline_2ranks <=0.9")
        if args.batch_check_cost:
            with open(out, "a") as f:
                f.write(_check_cost(times, spent, args.schedule))


def _clocked(ranks: Any) -> tuple[list[float], list[float]]:
    """Time every ``check_same_batch`` call of ``ranks`` (a ``RankStage``), its verdict's wait before the
    first transfer apart (the ``gate`` it leaves on the transport); returns the per-step lists it fills."""
    spent: list[float] = []
    waits: list[float] = []
    check = ranks.check_same_batch

    def timed(chunks: Any, targets: Any, transport: Any = None) -> None:
        start = time.perf_counter()
        check(chunks, targets, transport)
        spent.append(time.perf_counter() - start)
        waits.append(0.0)
        gate = getattr(transport, "gate", None)
        if gate is not None:

            def waited() -> None:
                start = time.perf_counter()
                try:
                    gate()
                finally:
                    waits[-1] = time.perf_counter() - start

            transport.gate = waited

    ranks.check_same_batch = timed
    return spent, waits


def _check_cost(times: dict[str, list[float]], spent: dict[str, tuple[list[float], list[float]]], schedules: list[str]) -> str:
    """The same-batch check's cost: time inside the check (rank 0) against the step, and checked / unchecked
    step times from the same rounds (medians and median of per-round ratios)."""
    lines = ["per-step same-batch check (RankStage.check_same_batch), checked / unchecked in the same rounds:"]
    for name in schedules:
        on, off = times[f"torchspan {name}"], times[f"{name} unchecked"]
        per_round = [a / b for a, b in zip(on, off)]
        inside, waits = spent[name]
        both = statistics.median([a + b for a, b in zip(inside, waits)])
        lines.append(
            f"  {name}: rank 0 spent {statistics.median(inside) * 1e3:.3f} ms in the check (fingerprint, all-gather started) and "
            f"{statistics.median(waits) * 1e3:.3f} ms waiting for its verdict before the first send (medians of {len(inside)} steps); "
            f"together {both * 1e3:.3f} ms = {100 * both / statistics.median(on):.2f}% of the checked step"
        )
        lines.append(
            f"  {name}: checked {statistics.median(on) * 1e3:.2f} ms, unchecked {statistics.median(off) * 1e3:.2f} ms: "
            f"{statistics.median(on) / statistics.median(off):.4f} (medians); median of per-round ratios {statistics.median(per_round):.4f}"
        )
    return "\n".join(lines) + "\n"


def _hybrid(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    _join(rank, world, port, args)
    replica = rank // 2
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)
    loss_fn = nn.MSELoss()
    n = 2 * args.depth
    ours = torchspan.span(_model(args.width, args.depth), balance=[n // 2, n - n // 2], microbatches=args.microbatches, schedule="1f1b")
    half = args.batch // 2
    xs, ys = x[replica * half : (replica + 1) * half], y[replica * half : (replica + 1) * half]
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(_model(args.width, args.depth)))
    q = args.batch // world
    xq, yq = x[rank * q : (rank + 1) * q], y[rank * q : (rank + 1) * q]

    def step_ours() -> None:
        ours.zero_grad()
        ours.train_step(xs, ys, loss_fn)

    def step_ddp() -> None:
        ddp.zero_grad()
        loss_fn(ddp(xq), yq).backward()

    times = _rounds({"torchspan 2x2": step_ours, "DDP x4": step_ddp}, args)
    if rank == 0:
        _report(out, "hybrid 2 stages x 2 replicas vs DDP on 4 processes", times, ["torchspan 2x2"], "DDP x4", "hybrid_2x2 -")


def _report(out: str, title: str, times: dict[str, list[float]], ours: list[str], anchor: str, ratio: str) -> None:
    """Medians and ratios to ``anchor`` into ``out``; ``ratio`` ("<key> <goal>") names the ``RATIO`` lines (median of per-round ratios)."""
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [f"{title}:"]
    lines += [f"  {k:20s} median {v * 1e3:8.2f} ms/step over {len(times[k])} rounds" for k, v in med.items()]
    for name in ours:
        per_round = [a / b for a, b in zip(times[name], times[anchor])]
        lines.append(f"  ratio {name} / {anchor} = {med[name] / med[anchor]:.3f} (medians); median of per-round ratios {statistics.median(per_round):.3f}")
        lines.append("    per-round ratios: " + " ".join(f"{r:.2f}" for r in per_round))
    key, goal = ratio.split()
    lines += [f"RATIO {key}/{n.replace(' ', '_')}_vs_{anchor.replace(' ', '_')} {statistics.median(a / b for a, b in zip(times[n], times[anchor])):.3f} "
              f"{goal} {title}" for n in ours]  # fmt: skip
    Path(out).write_text("\n".join(lines) + "\n")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed rounds (one step of each side per round)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each side first")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", nargs="+", choices=SCHEDULES, default=["1f1b"],
                   help="torchspan's pipeline schedule(s), each timed against Schedule1F1B in the same rounds (default 1f1b)")
    p.add_argument("--batch-check-cost", action="store_true",
                   help="also time each torchspan pipeline with its per-step same-batch check off, in the same rounds (the check's cost)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per process (0: cores // processes)")
    p.add_argument("--only", nargs="+", choices=("pipeline", "hybrid"), default=("pipeline", "hybrid"))
    p.add_argument("--skip-hybrid", action="store_true", help="same as --only pipeline")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    add_quick(p, argv, steps=2, warmup=1, width=32, depth=2, batch=8, microbatches=2)
    args = p.parse_args(argv)
    only = ["pipeline"] if args.skip_hybrid else list(args.only)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores shared by all processes (gloo on 127.0.0.1)")
    print("load average (1, 5, 15 min) before: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    print(f"model: {args.depth} x (Linear({args.width}, {args.width}) + ReLU), batch {args.batch}, {args.microbatches} micro-batches, "
          f"{args.warmup} warm-up steps then {args.steps} alternating rounds")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        runs = [(name, fn, world) for name, fn, world in (("pipeline", _pipeline, 2), ("hybrid", _hybrid, 4)) if name in only]
        for name, fn, world in runs:
            out = str(Path(tmp) / f"{name}.txt")
            mp.start_processes(fn, args=(world, free_port(), args, out), nprocs=world, start_method="spawn")
            print(Path(out).read_text(), end="")
    print("load average (1, 5, 15 min) after the runs: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

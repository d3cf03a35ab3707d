"""Pipelines across processes: torchspan against torch.distributed.pipelining and plain DDP.

1. **2-rank pipeline**: the same ``nn.Sequential`` cut in two, the same micro-batches, 2 gloo
   processes; torchspan ``span(model, balance=..., schedule="1f1b")`` against
   ``torch.distributed.pipelining`` ``PipelineStage`` + ``Schedule1F1B``, steps alternating in one
   run. Prints the median step-time ratio torchspan / torch (goal <= 0.9).
2. **Hybrid 2 x 2** on 4 processes against plain ``DistributedDataParallel`` of the whole model
   (each DDP rank a quarter of the batch), alternating in one run.

Timings are wall-clock medians with a barrier around each step. On a machine with few cores the
processes share them: say so next to the numbers.

Usage: ``python benchmarks/distributed_pipeline.py [--steps 20] [--width 512] [--depth 8] [--batch 64] [--microbatches 4]``
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torchspan  # noqa: E402
from torchspan.runtime.ranks import free_port, init_distributed  # noqa: E402


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


def _pipeline(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    init_distributed(timeout=120)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)
    loss_fn = nn.MSELoss()
    n = 2 * args.depth
    ours = torchspan.span(_model(args.width, args.depth), balance=[n // 2, n - n // 2], microbatches=args.microbatches, schedule="1f1b")
    whole = _model(args.width, args.depth)
    half = nn.Sequential(*list(whole)[: n // 2]) if rank == 0 else nn.Sequential(*list(whole)[n // 2 :])
    stage = PipelineStage(half, rank, world, torch.device("cpu"))
    theirs = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)

    def step_ours() -> None:
        ours.zero_grad()
        ours.train_step(x, y, loss_fn)

    def step_theirs() -> None:
        half.zero_grad()
        if rank == 0:
            theirs.step(x)
        else:
            theirs.step(target=y, losses=[])

    times: dict[str, list[float]] = {"torchspan": [], "torch": []}
    for i in range(args.steps + 2):
        a = _timed(step_ours)
        b = _timed(step_theirs)
        if i >= 2:  # warm-up
            times["torchspan"].append(a)
            times["torch"].append(b)
    if rank == 0:
        _report(out, "pipeline 2 ranks (1F1B)", times, "torchspan", "torch")


def _hybrid(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    init_distributed(timeout=120)
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

    times: dict[str, list[float]] = {"torchspan 2x2": [], "DDP x4": []}
    for i in range(args.steps + 2):
        a = _timed(step_ours)
        b = _timed(step_ddp)
        if i >= 2:
            times["torchspan 2x2"].append(a)
            times["DDP x4"].append(b)
    if rank == 0:
        _report(out, "hybrid 2 stages x 2 replicas vs DDP on 4 processes", times, "torchspan 2x2", "DDP x4")


def _report(out: str, title: str, times: dict[str, list[float]], ours: str, anchor: str) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [f"{title}:"]
    lines += [f"  {k:14s} median {v * 1e3:8.2f} ms/step over {len(times[k])} steps" for k, v in med.items()]
    lines.append(f"  ratio {ours} / {anchor} = {med[ours] / med[anchor]:.3f}")
    Path(out).write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--skip-hybrid", action="store_true")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores shared by all processes (gloo on 127.0.0.1)")
    print("load average (1, 5, 15 min) before: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    print(f"model: {args.depth} x (Linear({args.width}, {args.width}) + ReLU), batch {args.batch}, {args.microbatches} micro-batches")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        runs = [("pipeline", _pipeline, 2)] + ([] if args.skip_hybrid else [("hybrid", _hybrid, 4)])
        for name, fn, world in runs:
            out = str(Path(tmp) / f"{name}.txt")
            mp.start_processes(fn, args=(world, free_port(), args, out), nprocs=world, start_method="spawn")
            print(Path(out).read_text(), end="")
    print("load average (1, 5, 15 min) after the runs: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""torchspan data parallel against raw DistributedDataParallel: same model, data and processes.

Two gloo processes on 127.0.0.1 (or nccl with ``--backend nccl`` on GPUs) each hold two identical
replicas, one wrapped in raw DDP (mean loss per rank, DDP's averaging) and one in torchspan's
``DataParallelReplica`` (exact global loss: all-reduced normalizer, summing comm hook). Rounds
alternate between the two so that both see the same machine load; the ratio of median step
times is printed (goal: torchspan <= 1.03x raw DDP).

Usage::

    python benchmarks/distributed.py                       # 2 CPU processes, gloo
    python benchmarks/distributed.py --rounds 12 --steps 10 --hidden 2048
    python benchmarks/distributed.py --backend nccl --nproc 1   # one-GPU sanity run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchspan.runtime.ranks import DataParallelReplica, free_port, init_distributed


def _model(hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Linear(256, hidden), nn.ReLU()]
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(hidden, 10))


def _timed(step, sync) -> float:  # type: ignore[no-untyped-def]
    sync()
    start = time.perf_counter()
    step()
    sync()
    return time.perf_counter() - start


def _worker(rank: int, world: int, port: int, opts: argparse.Namespace, results: dict) -> None:  # type: ignore[type-arg]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(opts.threads)
    info = init_distributed(backend=opts.backend, timeout=120)
    device = info.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(opts.batch, 256, generator=g).to(device)
    y = torch.randint(0, 10, (opts.batch,), generator=g).to(device)
    loss_fn = nn.CrossEntropyLoss()

    raw = DistributedDataParallel(_model(opts.hidden, opts.layers).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    raw_opt = torch.optim.SGD(raw.parameters(), lr=1e-3)
    ours = DataParallelReplica(_model(opts.hidden, opts.layers))
    ours_opt = torch.optim.SGD(ours.parameters(), lr=1e-3)

    def raw_step() -> None:
        raw_opt.zero_grad()
        loss_fn(raw(x), y).backward()
        raw_opt.step()

    def ours_step() -> None:
        ours_opt.zero_grad()
        ours.train_step(x, y, loss_fn)
        ours_opt.step()

    for _ in range(opts.warmup):
        raw_step()
        ours_step()
    times: dict[str, list[float]] = {"raw DDP": [], "torchspan": []}
    for r in range(opts.rounds):
        order = [("raw DDP", raw_step), ("torchspan", ours_step)]
        for name, step in order if r % 2 == 0 else order[::-1]:
            dist.barrier()
            times[name].append(sum(_timed(step, sync) for _ in range(opts.steps)) / opts.steps)
    if rank == 0:
        results.update(times)
        results["device"] = str(device)
        results["backend"] = str(dist.get_backend())
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", default=None, help="gloo (default on CPU) or nccl")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch", type=int, default=64, help="rows per rank")
    p.add_argument("--steps", type=int, default=5, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=10, help="rounds per variant, alternating")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="intra-op threads per process")
    opts = p.parse_args()
    if opts.backend == "nccl" and opts.nproc > torch.cuda.device_count():
        sys.exit(f"--nproc {opts.nproc} > {torch.cuda.device_count()} visible GPUs")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(opts.nproc, free_port(), opts, results), nprocs=opts.nproc)
        res = dict(results)
    params = sum(p.numel() for p in _model(opts.hidden, opts.layers).parameters())
    print(f"{opts.nproc} x {res['backend']} on {res['device']}, {params / 1e6:.1f}M parameters, batch {opts.batch}/rank, "
          f"{opts.rounds} alternating rounds of {opts.steps} steps")
    med = {k: statistics.median(res[k]) for k in ("raw DDP", "torchspan")}
    for name, value in med.items():
        spread = f"{min(res[name]) * 1e3:.2f}..{max(res[name]) * 1e3:.2f}"
        print(f"  {name:10s} median {value * 1e3:8.2f} ms/step  (rounds {spread} ms)")
    ratio = med["torchspan"] / med["raw DDP"]
    paired = statistics.median(t / r for t, r in zip(res["torchspan"], res["raw DDP"]))
    print(f"  ratio torchspan / raw DDP: {ratio:.3f} (median of per-round ratios {paired:.3f}; goal <= 1.03)")


if __name__ == "__main__":
    main()

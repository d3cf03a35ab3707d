"""torchspan data parallel, as users call it, against raw DistributedDataParallel: same model, data and processes.

Two gloo processes on 127.0.0.1 (or nccl with ``--backend nccl`` on GPUs) each hold three identical
replicas: one wrapped in raw DDP (mean loss per rank, DDP's averaging), one ``torchspan.span(model)``
(the user's path in a launched job: the ``Spanned`` façade over ``ReplicaExecutor``; exact global
loss: all-reduced normalizer, summing comm hook) and, for reference, the bare ``DataParallelReplica``
that façade wraps. Each round times every variant, in an order rotating from round to round, so all
see the same machine load; medians and the median of per-round ratios to raw DDP are printed (goal:
``span`` <= 1.03x raw DDP).

Pipelines across ranks (issue 13) run from here too, by ``benchmarks/distributed_pipeline.py``:
``--pipeline`` times a 2-rank torchspan 1F1B pipeline against ``torch.distributed.pipelining``'s
``Schedule1F1B`` (goal <= 0.9), ``--hybrid`` a 2 stages x 2 replicas mesh against DDP on 4 processes;
the other flags then are that script's (``--steps`` counts rounds there, ``--threads`` as here).
``--shard`` (issue 20) times ``span(model, shard=True)`` against raw FSDP2 ``fully_shard`` at two model
sizes, with each rank's memory, by ``benchmarks/distributed_sharded.py`` (its flags then).

Usage::

    python benchmarks/distributed.py --rounds 21           # 2 CPU processes, gloo
    python benchmarks/distributed.py --rounds 12 --steps 10 --hidden 2048
    python benchmarks/distributed.py --backend nccl --nproc 1   # one-GPU sanity run
    python benchmarks/distributed.py --pipeline --steps 30      # torchspan 1F1B vs Schedule1F1B, 2 gloo ranks
    python benchmarks/distributed.py --pipeline --steps 30 --batch-check-cost   # + the same-batch check's cost per step
    python benchmarks/distributed.py --hybrid --steps 20        # torchspan 2x2 vs DDP x4
    python benchmarks/distributed.py --pipeline --help          # the pipeline flags
    python benchmarks/distributed.py --shard                    # span(shard=True) vs raw fully_shard, two sizes
    python benchmarks/distributed.py --quick                    # tiny, 2 rounds of 1 step (torchspan bench --quick)

Prints ``RATIO distributed/<variant>_vs_raw_ddp <median of per-round ratios> <goal> ...`` lines for ``torchspan bench``.
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

import torchspan
from torchspan.runtime.ranks import DataParallelReplica, free_port, init_distributed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _quick import add_quick  # noqa: E402  (benchmarks/_quick.py, beside this script)

VARIANTS = ("raw DDP", "span", "replica")


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

    def raw_step() -> None:
        raw_opt.zero_grad()
        loss_fn(raw(x), y).backward()
        raw_opt.step()

    spanned = torchspan.span(_model(opts.hidden, opts.layers))  # what users call: a replica in a launched job
    assert spanned.mode == "data-parallel", spanned.mode
    span_opt = torch.optim.SGD(spanned.parameters(), lr=1e-3)
    bare = DataParallelReplica(_model(opts.hidden, opts.layers))
    bare_opt = torch.optim.SGD(bare.parameters(), lr=1e-3)

    def span_step() -> None:
        span_opt.zero_grad()
        spanned.train_step(x, y, loss_fn)
        span_opt.step()

    def bare_step() -> None:
        bare_opt.zero_grad()
        bare.train_step(x, y, loss_fn)
        bare_opt.step()

    steps = dict(zip(VARIANTS, (raw_step, span_step, bare_step)))
    for _ in range(opts.warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(opts.rounds):
        names = VARIANTS[r % 3 :] + VARIANTS[: r % 3]  # every variant first, second and third in turn
        for name in names if r % 2 == 0 else names[::-1]:
            dist.barrier()
            times[name].append(sum(_timed(steps[name], sync) for _ in range(opts.steps)) / opts.steps)
    if rank == 0:
        results.update(times)
        results["device"] = str(device)
        results["backend"] = str(dist.get_backend())
    dist.destroy_process_group()


def _pipelines(argv: list[str]) -> int | None:
    """``--pipeline`` / ``--hybrid``: run ``distributed_pipeline`` (its own flags); ``None`` for data parallel."""
    modes = [m for m in ("pipeline", "hybrid") if f"--{m}" in argv]
    if not modes:
        return None
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import distributed_pipeline

    rest = [a for a in argv if a not in ("--pipeline", "--hybrid")]
    return distributed_pipeline.main(rest + ["--only", *modes])


def _sharded(argv: list[str]) -> int | None:
    """``--shard``: run ``distributed_sharded`` (its own flags); ``None`` without it."""
    if "--shard" not in argv:
        return None
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import distributed_sharded

    return distributed_sharded.main([a for a in argv if a != "--shard"])


def main() -> None:
    code = _sharded(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    code = _pipelines(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pipeline", action="store_true", help="time pipelines across ranks instead (benchmarks/distributed_pipeline.py)")
    p.add_argument("--hybrid", action="store_true", help="time the 2x2 hybrid against DDP x4 instead (benchmarks/distributed_pipeline.py)")
    p.add_argument("--shard", action="store_true", help="time span(shard=True) against raw fully_shard instead (benchmarks/distributed_sharded.py)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", default=None, help="gloo (default on CPU) or nccl")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch", type=int, default=64, help="rows per rank")
    p.add_argument("--steps", type=int, default=5, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=12, help="rounds; each times every variant, order rotating")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="intra-op threads per process")
    add_quick(p, None, hidden=64, layers=1, batch=8, steps=1, rounds=2, warmup=1)
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
    med = {k: statistics.median(res[k]) for k in VARIANTS}
    for name, value in med.items():
        spread = f"{min(res[name]) * 1e3:.2f}..{max(res[name]) * 1e3:.2f}"
        print(f"  {name:8s} median {value * 1e3:8.2f} ms/step  (rounds {spread} ms)")
    for name in VARIANTS[1:]:
        ratio = med[name] / med["raw DDP"]
        paired = statistics.median(t / r for t, r in zip(res[name], res["raw DDP"]))
        goal = "; goal <= 1.03" if name == "span" else ""
        print(f"  ratio {name} / raw DDP: {ratio:.3f} (median of per-round ratios {paired:.3f}{goal})")
        print(f"RATIO distributed/{name}_vs_raw_ddp {paired:.3f} {'<=1.03' if name == 'span' else '-'} raw DistributedDataParallel, "
              f"{opts.nproc} x {res['backend']}")

if __name__ == "__main__":
    main()

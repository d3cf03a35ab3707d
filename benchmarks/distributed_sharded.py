"""torchspan sharded data parallel, as users call it, against raw FSDP2 ``fully_shard``: same model, data and
processes.

``python benchmarks/distributed.py --shard`` runs this (so does ``python benchmarks/distributed_sharded.py``).
Two gloo processes on 127.0.0.1 (or nccl with ``--backend nccl`` on GPUs) each build, for every model
size, identical models from the same seed: one sharded by hand the way FSDP2's documentation
does it (``fully_shard`` on every block, then on the root; a mean loss per rank, FSDP2's default
averaging), one ``torchspan.span(model, shard=True)`` (the same units, plus the exact contract:
normalizers all-reduced, SUM reduce-scatter, the global loss all-reduced) and, for reference, the bare
``DataParallelReplica(model, shard=True)`` that façade wraps. Each round times all three in an order
rotating from round to round, so they see the same machine load; the median of per-round ratios is
printed per size (goal: ``span`` <= 1.03x raw ``fully_shard``), with each rank's memory: the bytes
of its parameter, gradient and Adam-state shards (``DTensor.to_local``; the unsharded total beside
them), the process's peak resident set (CPU) or ``torch.cuda.max_memory_allocated`` per variant (GPU).

Usage::

    python benchmarks/distributed.py --shard           # 2 CPU processes, gloo, two sizes
    python benchmarks/distributed.py --shard --sizes 512x2,1024x4 --rounds 15
    python benchmarks/distributed.py --shard --backend nccl --nproc 2
    python benchmarks/distributed.py --shard --quick   # tiny, 2 rounds of 1 step (torchspan bench --quick)

Prints ``RATIO distributed_sharded/span_vs_raw_fully_shard_<size> <median of per-round ratios> <=1.03 ...``
per size.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import torchspan
from torchspan.runtime.ranks import DataParallelReplica, free_port, init_distributed, shard_batch
from torchspan.runtime.ranks.sharded import local_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _quick import add_quick  # noqa: E402  (benchmarks/_quick.py, beside this script)
from _ranks import rank_env  # noqa: E402

VARIANTS = ("raw fully_shard", "span", "replica")


def _model(hidden: int, layers: int) -> nn.Module:
    """An MLP of residual-free blocks (``Linear, GELU, Linear``): ``model_layers`` finds the blocks, FSDP2's
    units."""
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        for _ in range(layers)
    ]
    return nn.Sequential(nn.Linear(256, hidden), *blocks, nn.Linear(hidden, 10))


def _raw(model: nn.Module) -> nn.Module:
    """FSDP2 as its documentation shows it: ``fully_shard`` on every child that has parameters, then on the
    root."""
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    fully_shard(model)
    return model


def _sizes(text: str) -> list[tuple[int, int]]:
    try:
        sizes = [tuple(int(v) for v in part.split("x")) for part in text.split(",") if part.strip()]
    except ValueError:
        sys.exit(f"--sizes {text!r} must be HIDDENxLAYERS,... e.g. 512x2,1024x4")
    if not sizes or any(len(s) != 2 or min(s) < 1 for s in sizes):
        sys.exit(f"--sizes {text!r} must be HIDDENxLAYERS,... e.g. 512x2,1024x4")
    return sizes  # type: ignore[return-value]


def _timed(step: Callable[[], None], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    step()
    sync()
    return time.perf_counter() - start


def _variants(
    hidden: int, layers: int, x: torch.Tensor, y: torch.Tensor, rank: int, world: int
) -> dict[str, Any]:
    """Both variants of one size: ``{name: (step, module, optimizer)}`` (the global batch is every rank's
    rows)."""
    loss_fn = nn.CrossEntropyLoss()
    raw = _raw(_model(hidden, layers))
    raw_opt = torch.optim.Adam(raw.parameters(), lr=1e-4)
    xs, ys = shard_batch((x, y), rank, world)

    def raw_step() -> None:
        raw_opt.zero_grad()
        loss_fn(raw(xs), ys).backward()
        raw_opt.step()

    spanned = torchspan.span(_model(hidden, layers), shard=True)
    assert spanned.mode == "sharded", spanned.mode
    span_opt = torch.optim.Adam(spanned.parameters(), lr=1e-4)

    def span_step() -> None:
        span_opt.zero_grad()
        spanned.train_step(xs, ys, loss_fn)
        span_opt.step()

    bare = DataParallelReplica(_model(hidden, layers), shard=True)  # what the façade wraps, for reference
    bare_opt = torch.optim.Adam(bare.parameters(), lr=1e-4)

    def bare_step() -> None:
        bare_opt.zero_grad()
        bare.train_step(xs, ys, loss_fn)
        bare_opt.step()

    return {
        "raw fully_shard": (raw_step, raw, raw_opt),
        "span": (span_step, spanned.module, span_opt),
        "replica": (bare_step, bare.module, bare_opt),
    }


def _measure(variants: dict[str, Any], opts: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Alternating rounds (each variant first in turn); per variant the per-step times and the peak device
    memory."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(opts.warmup):
        for step, _, _ in variants.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    peaks: dict[str, int | None] = dict.fromkeys(VARIANTS)
    for r in range(opts.rounds):
        names = VARIANTS[r % 3 :] + VARIANTS[: r % 3]  # every variant first, second and third in turn
        for name in names if r % 2 == 0 else names[::-1]:
            dist.barrier()
            if device.type == "cuda":  # pragma: no cover - needs a GPU
                torch.cuda.reset_peak_memory_stats(device)
            times[name].append(sum(_timed(variants[name][0], sync) for _ in range(opts.steps)) / opts.steps)
            if device.type == "cuda":  # pragma: no cover - needs a GPU
                peaks[name] = max(peaks[name] or 0, torch.cuda.max_memory_allocated(device))
    held = {name: local_bytes(module, opt) for name, (_, module, opt) in variants.items()}
    return {"times": times, "peaks": peaks, "held": held}


def _worker(rank: int, world: int, port: int, opts: argparse.Namespace, results: dict) -> None:  # type: ignore[type-arg]
    rank_env(rank, world, port)
    torch.set_num_threads(opts.threads)
    info = init_distributed(backend=opts.backend, timeout=300)
    g = torch.Generator().manual_seed(0)
    rows = opts.batch * world - (world // 2)  # uneven shards, as real epochs end
    x = torch.randn(rows, 256, generator=g).to(info.device)
    y = torch.randint(0, 10, (rows,), generator=g).to(info.device)
    for hidden, layers in _sizes(opts.sizes):
        measured = _measure(_variants(hidden, layers, x, y, rank, world), opts, info.device)
        measured["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, measured)
        if rank == 0:
            results[f"{hidden}x{layers}"] = everyone
    if rank == 0:
        results["device"], results["backend"] = str(info.device), str(dist.get_backend())
    dist.destroy_process_group()


def _report(size: str, ranks: list[dict[str, Any]], opts: argparse.Namespace, backend: str) -> None:
    hidden, layers = (int(v) for v in size.split("x"))
    params = sum(p.numel() for p in _model(hidden, layers).parameters())
    full = {"params": params * 4, "grads": params * 4, "optimizer": params * 8}
    times = ranks[0]["times"]
    med = {k: statistics.median(times[k]) for k in VARIANTS}
    print(f"  {size}: {params / 1e6:.2f}M parameters")
    for name, value in med.items():
        print(
            f"    {name:16s} median {value * 1e3:8.2f} ms/step  (rounds "
            f"{min(times[name]) * 1e3:.2f}..{max(times[name]) * 1e3:.2f} ms)"
        )
    for rank, r in enumerate(ranks):
        for name in VARIANTS:
            held = r["held"][name]
            shares = ", ".join(f"{k} {held[k] / 2**20:.2f}/{full[k] / 2**20:.2f} MiB" for k in full)
            peak = (
                f", peak allocated {r['peaks'][name] / 2**20:.1f} MiB" if r["peaks"][name] is not None else ""
            )
            print(f"    rank {rank} {name:16s} holds {shares}{peak}")
        print(f"    rank {rank} process peak RSS {r['rss'] / 2**20:.0f} MiB (every variant and size so far)")
    for name in VARIANTS[1:]:
        paired = statistics.median(s / f for s, f in zip(times[name], times["raw fully_shard"]))
        goal = "; goal <= 1.03" if name == "span" else ""
        print(
            f"    ratio {name} / raw fully_shard: {med[name] / med['raw fully_shard']:.3f} (median of "
            f"per-round ratios {paired:.3f}{goal})"
        )
        print(
            f"RATIO distributed_sharded/{name}_vs_raw_fully_shard_{size} {paired:.3f} "
            f"{'<=1.03' if name == 'span' else '-'} raw FSDP2 fully_shard, {opts.nproc} x {backend}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shard", action="store_true", help="(accepted: distributed.py --shard runs this script)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", default=None, help="gloo (default on CPU) or nccl")
    p.add_argument(
        "--sizes",
        default="256x2,512x4",
        help="model sizes, HIDDENxLAYERS (blocks of hidden -> 4 hidden -> hidden)",
    )
    p.add_argument(
        "--batch", type=int, default=32, help="rows per rank (the last rank gets fewer: uneven shards)"
    )
    p.add_argument("--steps", type=int, default=3, help="steps per timed round")
    p.add_argument(
        "--rounds", type=int, default=12, help="rounds; each times every variant, the order rotating"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="intra-op threads per process"
    )
    add_quick(p, args, sizes="64x1,128x2", batch=4, steps=1, rounds=2, warmup=1)
    opts = p.parse_args(args)
    if opts.backend == "nccl" and opts.nproc > torch.cuda.device_count():
        sys.exit(f"--nproc {opts.nproc} > {torch.cuda.device_count()} visible GPUs")
    _sizes(opts.sizes)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(opts.nproc, free_port(), opts, results), nprocs=opts.nproc)
        res = dict(results)
    print(
        f"{opts.nproc} x {res['backend']} on {res['device']}, batch {opts.batch}/rank (uneven), Adam, "
        f"{opts.rounds} alternating rounds of {opts.steps} steps, {opts.threads} thread(s) per process"
    )
    for hidden, layers in _sizes(opts.sizes):
        _report(f"{hidden}x{layers}", res[f"{hidden}x{layers}"], opts, res["backend"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""torchspan data parallel, as users call it, against raw DistributedDataParallel: same model, data and
processes.

Two gloo processes on 127.0.0.1 (or nccl with ``--backend nccl`` on GPUs) time, at each model size of
``--sizes`` (MLPs of about 3M, 20M and 100M parameters; default all three), raw DDP (mean loss per rank,
DDP's averaging) against ``torchspan.span(model)`` (the user's path in a launched job: the ``Spanned``
façade over ``ReplicaExecutor``; exact global loss), each two ways:

- **one step** (``raw DDP``, ``span``): ``zero_grad()`` (``.grad`` None), forward, backward,
``optimizer.step()``;
  ``span loop`` is the user's plain loop on the same span, ``loss_fn(spanned(x), y).backward()`` (exact: the
  output reads the loss applied to it and all-reduces its normalizer, ``runtime.ranks.plainloop``; goal <=
  1.03x);
- **accumulating** (``raw DDP acc``, ``span acc``): gradient accumulation over calls, no ``zero_grad()``
  between them, so every timed call adds to ``.grad`` (a round starts with ``zero_grad()`` and one untimed
  call). The anchor is raw DDP's plain ``loss.backward()`` each call: like ``span``'s ``train_step`` every
  call all-reduces and leaves the global gradient in ``.grad`` (DDP averages the accumulated gradients, which
  is right for identical replicas). DDP's ``no_sync()`` for all but the last micro-step reduces once per
  window and leaves rank-local sums in between, a different contract (what ``span``'s ``microbatches=`` do
  inside one call), so it is not the anchor here.

``--replica`` adds the bare ``DataParallelReplica`` the façade wraps. Each round times every variant, in an
order rotating from round to round, so all see the same machine load; per size the medians and the median
of per-round ratios to the anchor are printed (goal: ``span`` <= 1.0x raw DDP, with and without accumulation).

Pipelines across ranks (issue 13) run from here too, by ``benchmarks/distributed_pipeline.py``:
``--pipeline`` times a 2-rank torchspan 1F1B pipeline against ``torch.distributed.pipelining``'s
``Schedule1F1B`` (goal <= 0.9), ``--hybrid`` a 2 stages x 2 replicas mesh against DDP on 4 processes;
the other flags then are that script's (``--steps`` counts rounds there, ``--threads`` as here).
``--shard`` (issue 20) times ``span(model, shard=True)`` against raw FSDP2 ``fully_shard`` at two model
sizes, with each rank's memory, by ``benchmarks/distributed_sharded.py`` (its flags then).
``--tp`` (issue 33) times ``span(model, tp=2)`` against raw ``parallelize_module`` with the same plan (a Llama
and an MLP), by ``benchmarks/distributed_tp.py`` (its flags then).

Usage::

    # 2 CPU processes, gloo, 3M, 20M and 100M
    python benchmarks/distributed.py --threads 1 --rounds 12
    python benchmarks/distributed.py --threads 1 --sizes 3M,20M --rounds 21
    # one custom size
    python benchmarks/distributed.py --rounds 12 --steps 10 --hidden 2048 --layers 4
    # one-GPU sanity run
    python benchmarks/distributed.py --backend nccl --nproc 1
    # torchspan 1F1B vs Schedule1F1B, 2 gloo ranks
    python benchmarks/distributed.py --pipeline --steps 30
    # + the same-batch check's cost per step
    python benchmarks/distributed.py --pipeline --steps 30 --batch-check-cost
    # + what posting forward receives at once gains
    python benchmarks/distributed.py --pipeline --late-receives
    # torchspan 2x2 vs DDP x4
    python benchmarks/distributed.py --hybrid --steps 20
    # + the replicas' bucketed reduction (DDP's reducer) against the flat one, small and heavy sizes
    python benchmarks/distributed.py --hybrid --only hybrid --hybrid-sizes small heavy --flat-reduction
    python benchmarks/distributed.py --pipeline --help   # the pipeline flags
    python benchmarks/distributed.py --shard             # span(shard=True) vs raw fully_shard, two sizes
    python benchmarks/distributed.py --tp                # span(tp=2) vs raw parallelize_module, Llama and MLP
    python benchmarks/distributed.py --quick             # tiny, 2 rounds of 1 step (torchspan bench --quick)

Prints ``RATIO distributed/<variant>_vs_raw_ddp_<size> <median of per-round ratios> <goal> ...`` lines for
``torchspan bench`` (``span``, ``span_accumulating``; ``replica`` with ``--replica``).
"""

from __future__ import annotations

import argparse
import gc
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
from _ranks import rank_env  # noqa: E402

VARIANTS = ("raw DDP", "span", "span loop", "replica", "raw DDP acc", "span acc")
ANCHOR = {"span": "raw DDP", "span loop": "raw DDP", "replica": "raw DDP", "span acc": "raw DDP acc"}
SIZES = {
    "3M": (1024, 3),
    "20M": (2048, 5),
    "100M": (4096, 6),
}  # hidden, layers: 3.4M, 21.5M, 101.7M parameters


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


def _steps(
    hidden: int, layers: int, device: torch.device, x: torch.Tensor, y: torch.Tensor
) -> tuple[dict, dict]:  # type: ignore[type-arg]
    """Each variant's timed step and its round setup (the accumulating ones start a round with ``.grad``
    filled)."""
    loss_fn = nn.CrossEntropyLoss()
    raw = DistributedDataParallel(
        _model(hidden, layers).to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    raw_opt = torch.optim.SGD(raw.parameters(), lr=1e-3)
    spanned = torchspan.span(_model(hidden, layers))  # what users call: a replica in a launched job
    assert spanned.mode == "data-parallel", spanned.mode
    span_opt = torch.optim.SGD(spanned.parameters(), lr=1e-3)
    bare = DataParallelReplica(_model(hidden, layers))
    bare_opt = torch.optim.SGD(bare.parameters(), lr=1e-3)

    def raw_step() -> None:
        raw_opt.zero_grad()
        loss_fn(raw(x), y).backward()
        raw_opt.step()

    def span_step() -> None:
        span_opt.zero_grad()
        spanned.train_step(x, y, loss_fn)
        span_opt.step()

    def loop_step() -> (
        None
    ):  # the plain loop on the same replica: the output reads the loss (ranks.plainloop)
        span_opt.zero_grad()
        loss_fn(spanned(x), y).backward()
        span_opt.step()

    def bare_step() -> None:
        bare_opt.zero_grad()
        bare.train_step(x, y, loss_fn)
        bare_opt.step()

    def raw_acc() -> None:  # raw DDP accumulating over calls as its users write it when every call reduces
        loss_fn(raw(x), y).backward()

    def span_acc() -> None:
        spanned.train_step(x, y, loss_fn)

    def filled(zero, step):  # type: ignore[no-untyped-def]
        return lambda: (zero(), step())  # .grad=None, then one untimed call: every timed call accumulates

    steps = dict(zip(VARIANTS, (raw_step, span_step, loop_step, bare_step, raw_acc, span_acc)))
    setups = {
        "raw DDP acc": filled(raw_opt.zero_grad, raw_acc),
        "span acc": filled(span_opt.zero_grad, span_acc),
    }
    return steps, setups


def _time_size(
    hidden: int, layers: int, device: torch.device, opts: argparse.Namespace, sync
) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    """Per-round mean step times of every variant at one model size, the variants alternating in each
    round."""
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(opts.batch, 256, generator=g).to(device)
    y = torch.randint(0, 10, (opts.batch,), generator=g).to(device)
    steps, setups = _steps(hidden, layers, device, x, y)
    names = [v for v in VARIANTS if opts.replica or v != "replica"]
    for name in names:
        setups.get(name, lambda: None)()
        for _ in range(opts.warmup):
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(opts.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # every variant at every place in turn
        for name in order if r % 2 == 0 else order[::-1]:
            setups.get(name, lambda: None)()
            dist.barrier()
            times[name].append(sum(_timed(steps[name], sync) for _ in range(opts.steps)) / opts.steps)
    return times


def _worker(rank: int, world: int, port: int, opts: argparse.Namespace, results: dict) -> None:  # type: ignore[type-arg]
    rank_env(rank, world, port)
    torch.set_num_threads(opts.threads)
    info = init_distributed(backend=opts.backend, timeout=600)
    device = info.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for label, (hidden, layers) in opts.size_list:
        times = _time_size(hidden, layers, device, opts, sync)
        gc.collect()
        if rank == 0:
            results[label] = times
    if rank == 0:
        results["device"] = str(device)
        results["backend"] = str(dist.get_backend())
    dist.destroy_process_group()


def _pipelines(argv: list[str]) -> int | None:
    """``--pipeline`` / ``--hybrid``: run ``distributed_pipeline`` (its own flags); ``None`` for data
    parallel."""
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


def _tensor_parallel(argv: list[str]) -> int | None:
    """``--tp``: run ``distributed_tp`` (its own flags); ``None`` without it."""
    if "--tp" not in argv:
        return None
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import distributed_tp

    return distributed_tp.main([a for a in argv if a != "--tp"])


def _size_list(opts: argparse.Namespace) -> list[tuple[str, tuple[int, int]]]:
    """``(label, (hidden, layers))`` per model size: ``--hidden``/``--layers`` given make one size, else
    ``--sizes``."""
    if opts.hidden is not None or opts.layers is not None:
        hidden, layers = opts.hidden or 1024, opts.layers if opts.layers is not None else 3
        params = sum(p.numel() for p in _model(hidden, layers).parameters())
        return [(f"{params / 1e6:.{1 if params >= 1e6 else 2}f}M", (hidden, layers))]
    labels = [s.strip() for s in opts.sizes.split(",") if s.strip()]
    unknown = [s for s in labels if s not in SIZES]
    if unknown or not labels:
        sys.exit(f"--sizes {opts.sizes}: choose from {', '.join(SIZES)} (comma-separated)")
    return [(s, SIZES[s]) for s in labels]


def _report(label: str, times: dict[str, list[float]], opts: argparse.Namespace, res: dict) -> None:  # type: ignore[type-arg]
    """One size's medians and ratios (median of per-round ratios to each variant's anchor), and its RATIO
    lines."""
    hidden, layers = dict(opts.size_list)[label]
    params = sum(p.numel() for p in _model(hidden, layers).parameters())
    print(f"{label}: MLP 256-{hidden}x{layers}-10, {params / 1e6:.1f}M parameters")
    for name, ts in times.items():
        print(
            f"  {name:12s} median {statistics.median(ts) * 1e3:9.2f} ms/step  (rounds "
            f"{min(ts) * 1e3:.2f}..{max(ts) * 1e3:.2f} ms)"
        )
    for name, anchor in ANCHOR.items():
        if name not in times:
            continue
        ratio = statistics.median(times[name]) / statistics.median(times[anchor])
        paired = statistics.median(t / r for t, r in zip(times[name], times[anchor]))
        goal = "<=1.03" if name == "span loop" else "<=1.0" if name.startswith("span") else "-"
        print(
            f"  ratio {name} / {anchor}: {ratio:.3f} (median of per-round ratios {paired:.3f}; goal {goal})"
        )
        tag = name.replace(" acc", "_accumulating").replace(" loop", "_plain_loop").replace(" ", "_")
        print(
            f"RATIO distributed/{tag}_vs_raw_ddp_{label} {paired:.3f} {goal} raw DistributedDataParallel"
            f"{' accumulating (plain backward each call)' if 'acc' in name else ''}, {opts.nproc} x "
            f"{res['backend']}, {label}"
        )


def main() -> None:
    code = _sharded(sys.argv[1:])
    if code is None:
        code = _tensor_parallel(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    code = _pipelines(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="time pipelines across ranks instead (benchmarks/distributed_pipeline.py)",
    )
    p.add_argument(
        "--hybrid",
        action="store_true",
        help="time the 2x2 hybrid against DDP x4 instead (benchmarks/distributed_pipeline.py)",
    )
    p.add_argument(
        "--shard",
        action="store_true",
        help="time span(shard=True) against raw fully_shard instead (benchmarks/distributed_sharded.py)",
    )
    p.add_argument(
        "--tp",
        action="store_true",
        help="time span(model, tp=2) against raw parallelize_module instead (benchmarks/distributed_tp.py)",
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", default=None, help="gloo (default on CPU) or nccl")
    p.add_argument(
        "--sizes",
        default=",".join(SIZES),
        help=f"model sizes to time, comma-separated from {', '.join(SIZES)}",
    )
    p.add_argument("--hidden", type=int, default=None, help="one MLP of this width instead of --sizes")
    p.add_argument("--layers", type=int, default=None, help="its hidden layers (default 3)")
    p.add_argument("--batch", type=int, default=64, help="rows per rank")
    p.add_argument("--steps", type=int, default=5, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=12, help="rounds; each times every variant, order rotating")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--replica", action="store_true", help="also time the bare DataParallelReplica (no accumulation)"
    )
    p.add_argument(
        "--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="intra-op threads per process"
    )
    add_quick(p, None, hidden=64, layers=1, batch=8, steps=1, rounds=2, warmup=1)
    opts = p.parse_args()
    if opts.backend == "nccl" and opts.nproc > torch.cuda.device_count():
        sys.exit(f"--nproc {opts.nproc} > {torch.cuda.device_count()} visible GPUs")
    opts.size_list = _size_list(opts)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(opts.nproc, free_port(), opts, results), nprocs=opts.nproc)
        res = dict(results)
    print(
        f"{opts.nproc} x {res['backend']} on {res['device']}, batch {opts.batch}/rank, {opts.threads} "
        f"thread(s)/process, {opts.rounds} alternating rounds of {opts.steps} steps per size"
    )
    for label, _ in opts.size_list:
        _report(label, res[label], opts, res)


if __name__ == "__main__":
    main()

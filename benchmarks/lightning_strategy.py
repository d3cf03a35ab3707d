"""torchspan's Lightning strategy against Lightning's own DDP strategy: ms per training step on the same
ranks.

Each rank of a gloo job (``--nproc``, default 2, spawned here) runs alternating rounds: one ``L.Trainer.fit``
with ``strategy="ddp"`` (Lightning's ``DDPStrategy``: a ``DistributedSampler``, ``--batch`` rows per rank) and
one with ``torchspan.lightning.SpanStrategy()`` (the same rows per rank, cut from a global batch of ``--batch
* nproc``), order rotating, the same LightningModule (an MLP, class-weighted cross-entropy in
``training_step``). A callback times the steps after ``--warmup`` (Trainer setup excluded). Printed: each
strategy's median ms/step and the median of the per-round ratios span / ddp, as a ``RATIO`` line for
``torchspan bench``.

Then, in this one process (``--local-rounds``, 0 skips it): plain Lightning on one device
(``Trainer(devices=1)``, the global batch ``--batch * nproc`` rows) against ``SpanStrategy(devices=["cpu",
"cpu"], microbatches=4)``, a 2-stage local pipeline (stages in threads, ``--threads`` each), alternating
rounds, the same timing: a second ``RATIO`` line (lightning/local_pipeline_vs_single_device).

Usage::

    python benchmarks/lightning_strategy.py           # 2 x gloo, 6 rounds of 6 timed steps; local 6 rounds
    python benchmarks/lightning_strategy.py --quick   # a smoke run (torchspan bench --quick)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.multiprocessing as mp
from _quick import add_quick
from _ranks import rank_env
from torch import nn

try:
    import lightning as L
except ImportError:
    L = None


def _module(hidden: int, layers: int):  # type: ignore[no-untyped-def]
    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            blocks = [nn.Linear(256, hidden), nn.ReLU()] + [
                m for _ in range(layers - 1) for m in (nn.Linear(hidden, hidden), nn.ReLU())
            ]
            self.model = nn.Sequential(*blocks, nn.Linear(hidden, 10))
            self.criterion = nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, 10))

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.model(x)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return self.criterion(self(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return MLP()


class _Clock:
    """Seconds per step after the warm-up, read from Lightning's batch hooks."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.steps = warmup, 0.0, 0

    def hooks(self):  # type: ignore[no-untyped-def]
        clock = self

        class Hooks(L.Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_idx):  # type: ignore[no-untyped-def]
                if batch_idx == clock.warmup:
                    clock.start = time.perf_counter()

            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
                clock.steps = batch_idx + 1 - clock.warmup

        return Hooks()

    def per_step(self) -> float:
        return (time.perf_counter() - self.start) / max(1, self.steps)


def _strategy(name: str) -> object:
    from torchspan.lightning import SpanStrategy

    if name == "ddp":
        return "ddp"
    if name == "single":
        return "auto"
    return SpanStrategy(devices=["cpu", "cpu"], microbatches=4) if name == "local" else SpanStrategy()


def _fit(name: str, opts: argparse.Namespace, world: int) -> float:
    from torch.utils.data import DataLoader, TensorDataset

    steps = opts.warmup + opts.steps
    g = torch.Generator().manual_seed(1)
    rows = opts.batch * world * steps
    data = TensorDataset(torch.randn(rows, 256, generator=g), torch.randint(0, 10, (rows,), generator=g))
    per_loader = (
        opts.batch if name == "ddp" else opts.batch * world
    )  # DDP: rows per rank; torchspan: the global batch
    clock = _Clock(opts.warmup)
    trainer = L.Trainer(
        strategy=_strategy(name),
        accelerator="cpu",
        devices=world if name in ("ddp", "span") else 1,
        max_steps=steps,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[clock.hooks()],
    )
    trainer.fit(_module(opts.hidden, opts.layers), DataLoader(data, batch_size=per_loader))
    if name in ("single", "local"):
        return clock.per_step()
    timed = torch.tensor([clock.per_step()])
    torch.distributed.all_reduce(
        timed, op=torch.distributed.ReduceOp.MAX
    )  # a step is as slow as its slowest rank
    return float(timed)


def _worker(rank: int, world: int, port: int, opts: argparse.Namespace, results: dict) -> None:  # type: ignore[type-arg]
    rank_env(rank, world, port)
    torch.set_num_threads(opts.threads)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)
    import torchspan

    torchspan.init_distributed(timeout=120)
    times: dict[str, list[float]] = {"ddp": [], "span": []}
    for r in range(opts.rounds):
        for name in ("ddp", "span") if r % 2 == 0 else ("span", "ddp"):
            times[name].append(_fit(name, opts, world))
    if rank == 0:
        results.update(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch", type=int, default=64, help="rows per rank")
    p.add_argument("--steps", type=int, default=6, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument(
        "--local-rounds",
        type=int,
        default=6,
        help="rounds of the local pipeline against one device (0: skip)",
    )
    add_quick(p, None, hidden=64, layers=1, batch=8, steps=1, warmup=1, rounds=2, local_rounds=2)
    opts = p.parse_args()
    if L is None:
        print("SKIP lightning/span_vs_ddp lightning is not installed (pip install -e '.[lightning]')")
        return
    from torchspan.runtime.ranks import free_port

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(opts.nproc, free_port(), opts, results), nprocs=opts.nproc)
        times = dict(results)
    print(
        f"{opts.nproc} x gloo, MLP 256-{opts.hidden}x{opts.layers}-10, batch {opts.batch}/rank, "
        f"{opts.threads} thread(s)/process, {opts.rounds} alternating rounds of {opts.steps} timed steps"
    )
    _print_times(times)
    paired = statistics.median(s / d for s, d in zip(times["span"], times["ddp"]))
    print(
        f"RATIO lightning/span_strategy_vs_ddp_strategy {paired:.3f} - Lightning's DDPStrategy, "
        f"{opts.nproc} x gloo, MLP 256-{opts.hidden}x{opts.layers}-10"
    )
    if opts.local_rounds:
        _local(opts)


def _print_times(times: dict[str, list[float]]) -> None:
    """Each variant's median step and the spread of its rounds, in milliseconds."""
    for name, ts in times.items():
        print(
            f"  {name:6s} median {statistics.median(ts) * 1e3:8.2f} ms/step (rounds "
            f"{min(ts) * 1e3:.2f}..{max(ts) * 1e3:.2f})"
        )


def _local(opts: argparse.Namespace) -> None:
    """A 2-stage local pipeline against plain Lightning on one device, alternating rounds in this process."""
    import logging

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(opts.threads)
    times: dict[str, list[float]] = {"single": [], "local": []}
    for r in range(opts.local_rounds):
        for name in ("single", "local") if r % 2 == 0 else ("local", "single"):
            times[name].append(_fit(name, opts, opts.nproc))
    print(
        f"one process, MLP 256-{opts.hidden}x{opts.layers}-10, batch {opts.batch * opts.nproc}, "
        f"{opts.threads} thread(s), {opts.local_rounds} alternating rounds of {opts.steps} timed steps"
    )
    _print_times(times)
    paired = statistics.median(s / d for s, d in zip(times["local"], times["single"]))
    print(
        f"RATIO lightning/local_pipeline_vs_single_device {paired:.3f} - plain Lightning on one device, "
        f"SpanStrategy(devices=['cpu', 'cpu'], microbatches=4), MLP 256-{opts.hidden}x{opts.layers}-10"
    )


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()

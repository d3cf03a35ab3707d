"""Local pipeline benchmark: torchspan vs torchgpipe 0.0.7 vs a plain micro-batch loop, one run.

Model: eight ``Linear(1024, 1024)`` + ``ReLU`` (16 modules), batch 256, 8 micro-batches, two
stages (8 modules each) on ``['cpu', 'cpu']``; MSE loss to a random target; one step = forward
and backward of the whole batch (gradients zeroed between steps, no optimizer).

``--size small``: 8 x ``Linear(512, 512)``, batch 64, 4 micro-batches (per-step overhead shows there).

Cases (every case timed in the same rounds, order reversed every other round; ratios are the median of
per-round ratios, what machine noise hurts least):

- ``plain``: one device, the same 8 micro-batches one after another, each loss weighted by its share.
- ``torchgpipe``: ``GPipe(model, balance=[8, 8], devices=['cpu', 'cpu'], chunks=8)`` with its
  default ``checkpoint='except_last'``, and with ``checkpoint='never'`` (like-for-like).
- ``torchspan``: ``span(model, devices=['cpu', 'cpu'], balance=[8, 8], microbatches=8)``,
  schedules gpipe, 1f1b and merged-weights, ``checkpoint='never'`` (torchspan's default) and
  ``'except_last'``; and ``workers='stage'`` (a thread per stage, intra-op threads split between them).

With a GPU it also runs ``['cpu', 'cuda:0']`` and ``['cuda:0']`` for torchspan and the plain loop.

Prints ``RATIO <name> <value> <goal> <anchor>`` lines (read by ``torchspan bench``).
Usage: ``python benchmarks/pipeline_local.py [--quick] [--rounds N] [--size default|small]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

import torchspan

BATCH, WIDTH, LAYERS, CHUNKS = 256, 1024, 8, 8
SIZES = {"default": dict(BATCH=256, WIDTH=1024, CHUNKS=8), "small": dict(BATCH=64, WIDTH=512, CHUNKS=4)}


def build(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for _ in range(LAYERS):
        mods += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*mods)


def plain_step(model: nn.Module, device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], None]:
    model = model.to(device)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        model.zero_grad(set_to_none=True)
        x, y = x.to(device), y.to(device)
        for xm, ym in zip(x.tensor_split(CHUNKS), y.tensor_split(CHUNKS)):
            (nn.functional.mse_loss(model(xm), ym) * (xm.shape[0] / BATCH)).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


def torchgpipe_step(model: nn.Module, checkpoint: str) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
    try:
        from torchgpipe import GPipe
    except ImportError:
        return None
    pipe = GPipe(
        model,
        balance=[2 * LAYERS // 2, 2 * LAYERS // 2],
        devices=["cpu", "cpu"],
        chunks=CHUNKS,
        checkpoint=checkpoint,
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        pipe.zero_grad(set_to_none=True)
        nn.functional.mse_loss(pipe(x), y).backward()

    return step


def torchspan_step(
    model: nn.Module, devices: list[str], schedule: str, checkpoint: str, workers: str = "device"
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    half = len(model) // 2
    balance = [half, len(model) - half] if len(devices) == 2 else [len(model)]
    spanned = torchspan.span(
        model,
        devices=devices,
        balance=balance,
        microbatches=CHUNKS,
        schedule=schedule,
        recompute=checkpoint,
        workers=workers,
    )
    cuda = [torch.device(d) for d in devices if d.startswith("cuda")]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        spanned.zero_grad(set_to_none=True)
        spanned.train_step(x, y, nn.functional.mse_loss)
        for d in cuda:
            torch.cuda.synchronize(d)

    return step


def measure(
    cases: dict[str, Callable[[torch.Tensor, torch.Tensor], None]], rounds: int, per_round: int
) -> dict[str, list[float]]:
    """Per-step times of every case, ``rounds`` rounds of ``per_round`` steps each; the order reverses every
    other round, so each case's round-neighbours change and machine noise hits all of them alike."""
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    for fn in cases.values():  # warm-up
        fn(x, y)
        fn(x, y)
    times: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            fn = cases[name]
            t0 = time.perf_counter()
            for _ in range(per_round):
                fn(x, y)
            times[name].append((time.perf_counter() - t0) / per_round)
    return times


def per_round(times: dict[str, list[float]], name: str, anchor: str) -> float:
    """Median over rounds of ``name``'s time / ``anchor``'s in the same round (what noise hurts least)."""
    return statistics.median(a / b for a, b in zip(times[name], times[anchor]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer rounds, batch 64 of width 256 (a smoke run for torchspan bench --quick)",
    )
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument(
        "--size",
        choices=tuple(SIZES),
        default="default",
        help="default: 8 x Linear(1024), batch 256, 8 micro-batches; small: 8 x Linear(512), batch 64, 4 "
        "micro-batches (where per-step overhead shows)",
    )
    args = p.parse_args(argv)
    globals().update(SIZES[args.size])  # the step functions read these at call time
    if args.quick:
        globals().update(BATCH=64, WIDTH=256)
    rounds = args.rounds or (3 if args.quick else 15)
    per_round_steps = 1 if args.quick else 2

    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, intra-op threads {torch.get_num_threads()}, python {sys.version.split()[0]}"
    )
    base = build()
    cases: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
        "plain": plain_step(copy.deepcopy(base), torch.device("cpu")),
        "torchspan gpipe never": torchspan_step(copy.deepcopy(base), ["cpu", "cpu"], "gpipe", "never"),
        "torchspan 1f1b never": torchspan_step(copy.deepcopy(base), ["cpu", "cpu"], "1f1b", "never"),
        "torchspan merged-weights never": torchspan_step(
            copy.deepcopy(base), ["cpu", "cpu"], "merged-weights", "never"
        ),
        "torchspan gpipe except_last": torchspan_step(
            copy.deepcopy(base), ["cpu", "cpu"], "gpipe", "except_last"
        ),
        # one thread per stage, 1 intra-op thread each: real overlap, but slower than intra-op parallelism on
        # one CPU
        "torchspan gpipe workers=stage": torchspan_step(
            copy.deepcopy(base), ["cpu", "cpu"], "gpipe", "never", "stage"
        ),
    }
    for ck in ("except_last", "never"):
        fn = torchgpipe_step(copy.deepcopy(base), ck)
        if fn is not None:
            cases[f"torchgpipe {ck}"] = fn
    if torch.cuda.is_available():  # pragma: no cover - needs a GPU
        cases["plain cuda"] = plain_step(copy.deepcopy(base), torch.device("cuda:0"))
        cases["torchspan cuda"] = torchspan_step(copy.deepcopy(base), ["cuda:0"], "gpipe", "never")
        cases["torchspan cpu+cuda"] = torchspan_step(copy.deepcopy(base), ["cpu", "cuda:0"], "gpipe", "never")
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    times = measure(cases, rounds, per_round_steps)
    t = {k: statistics.median(v) for k, v in times.items()}
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"1-minute load average: {load0:.2f} before, {load1:.2f} after (above the core count means a noisy "
        "run)"
    )
    print(
        f"\nstep time, median of {rounds} rounds x {per_round_steps} steps (batch {BATCH}, width {WIDTH}, "
        f"{CHUNKS} micro-batches):"
    )
    for name, sec in t.items():
        ratio = (
            f"   x{per_round(times, name, 'plain'):.3f} of plain (median of per-round ratios)"
            if name != "plain"
            else ""
        )
        print(f"  {name:32s} {sec * 1e3:8.1f} ms{ratio}")
    print()
    r = lambda name, anchor: per_round(times, name, anchor)  # noqa: E731
    print(
        f"RATIO torchspan_gpipe/plain_loop {r('torchspan gpipe never', 'plain'):.3f} <=1.03 plain "
        "micro-batch loop, cpu (median of per-round ratios)"
    )
    print(
        f"RATIO torchspan_stage_threads/plain_loop {r('torchspan gpipe workers=stage', 'plain'):.3f} - "
        "plain loop, cpu (workers='stage')"
    )
    print(
        f"RATIO torchspan_1f1b/plain_loop {r('torchspan 1f1b never', 'plain'):.3f} <=1.03 plain "
        "micro-batch loop, cpu (median of per-round ratios)"
    )
    print(
        f"RATIO torchspan_merged_weights/plain_loop {r('torchspan merged-weights never', 'plain'):.3f} "
        "<=1.03 plain micro-batch loop, cpu (median of per-round ratios)"
    )
    if "torchgpipe except_last" in t:
        print(
            "RATIO torchspan_default/torchgpipe_default "
            f"{r('torchspan gpipe never', 'torchgpipe except_last'):.3f} <=0.8 torchgpipe 0.0.7 defaults "
            "(torchspan recompute=never vs torchgpipe checkpoint=except_last), cpu,cpu"
        )
        print(
            "RATIO torchspan/torchgpipe_except_last "
            f"{r('torchspan gpipe except_last', 'torchgpipe except_last'):.3f} - torchgpipe 0.0.7 "
            "like-for-like checkpoint=except_last, cpu,cpu"
        )
        print(
            f"RATIO torchspan/torchgpipe_never {r('torchspan gpipe never', 'torchgpipe never'):.3f} - "
            "torchgpipe 0.0.7 like-for-like checkpoint=never, cpu,cpu"
        )
    else:
        why = "torchgpipe is not installed (pip install -c constraints.txt 'torchspan[bench]')"
        for name in (
            "torchspan_default/torchgpipe_default",
            "torchspan/torchgpipe_except_last",
            "torchspan/torchgpipe_never",
        ):
            print(f"SKIP {name} {why}")
    if "torchspan cuda" in t:  # pragma: no cover - needs a GPU
        print(
            f"RATIO torchspan_cuda/plain_cuda {r('torchspan cuda', 'plain cuda'):.3f} <=1.1 plain loop, "
            "cuda:0"
        )
        print(
            f"RATIO torchspan_cpu+cuda/plain_cuda {r('torchspan cpu+cuda', 'plain cuda'):.3f} - plain "
            "loop, cuda:0"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What calibrating an opaque loss costs: ``train_step``'s first call with a lambda loss against a later call.

``train_step`` reads what a loss module or a ``torch.nn.functional`` loss divides by; a lambda or a user's
function it calibrates on its first batch (and again when the batch structure changes): one extra no-grad
forward of every micro-batch (random state and buffers restored) and the full-batch loss compared with the
weighted micro-batch losses (``runtime.losscheck``). README states that cost as a share of one step.

One process, a small MLP (``Linear(64, w)``, ``--depth`` x ``Linear(w, w)`` + ReLU, ``Linear(w, 10)``) spanned
over ``--devices`` with ``--microbatches`` (a calibration needs more than one micro-batch), cross-entropy as
``lambda o, t: F.cross_entropy(o, t)``. Three figures, all of ``train_step`` alone (no optimizer step):

- **calibrating / calibrated** (the RATIO line): on the same span, a step whose calibration is forgotten first
  (a fresh ``LossChecks``, so it calibrates again: what a first call pays for it, with everything else
  warm) against a step that finds it remembered, alternating in every round (the order swapped every other
  round); ``extra / step`` = median per-round ``calibrating / calibrated - 1``. Each calibrating step is
  checked to have run one dry forward, each calibrated step none.
- **first call** of a fresh span with the lambda against a fresh span given ``F.cross_entropy`` itself (read,
  never calibrated; a declared ``loss_reduction=`` would still be verified by a dry forward): the same
  first-step costs but the calibration, ``(opaque first - read first) / later step``, median over ``--fresh``
  pairs (alternating order).
- **first call / later call** of a fresh span with the lambda (everything a first step pays: the calibration,
  the first metered step, allocations), for reference.

Usage::

    # width 512, depth 4, batch 128, 4 micro-batches, cpu
    python benchmarks/loss_calibration.py
    python benchmarks/loss_calibration.py --devices cpu,cpu   # 2 stages in one process
    python benchmarks/loss_calibration.py --quick             # tiny, 2 rounds (torchspan bench --quick)

Prints ``RATIO loss_calibration/calibration_vs_step <extra / step> - ...``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import torchspan
from torchspan.runtime.losscheck import LossChecks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _quick import add_quick  # noqa: E402  (benchmarks/_quick.py, beside this script)


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _span(args: argparse.Namespace, devices: list[str]) -> torchspan.Spanned:
    return torchspan.span(_model(args.width, args.depth), devices=devices, microbatches=args.microbatches)


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--devices", default="cpu", help="comma-separated, e.g. cpu or cpu,cpu")
    parser.add_argument(
        "--rounds", type=int, default=60, help="rounds of (calibrating, calibrated) on one span"
    )
    parser.add_argument(
        "--fresh", type=int, default=10, help="pairs of fresh spans timed on their first call"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's default)")
    add_quick(parser, argv, width=32, depth=2, batch=8, rounds=2, fresh=1)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = args.devices.split(",")
    loss = lambda o, t: F.cross_entropy(o, t)  # noqa: E731  (opaque: calibrated on its first batch)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 64, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); MLP "
        f"64-{args.width}x{args.depth}-10, batch {args.batch}, {args.microbatches} micro-batches on "
        f"{devices}; 1-minute load average {load:.2f}"
    )

    # 1. the same span: calibration forgotten before one step, remembered before the other
    spanned = _span(args, devices)

    def calibrating() -> None:
        spanned._loss_checks = LossChecks()  # noqa: SLF001  (forget the calibration: this step runs it again)
        spanned.train_step(x, y, loss)
        assert spanned._loss_checks.calibrations == 1, spanned._loss_checks.calibrations  # noqa: SLF001

    def calibrated() -> None:
        before = spanned._loss_checks.calibrations  # noqa: SLF001
        spanned.train_step(x, y, loss)
        assert spanned._loss_checks.calibrations == before  # noqa: SLF001

    for fn in (calibrating, calibrated, calibrated, calibrating, calibrated):
        fn()  # warm-up
    with_cal: list[float] = []
    without: list[float] = []
    ratios: list[float] = []
    for r in range(args.rounds):
        order = (calibrating, calibrated) if r % 2 else (calibrated, calibrating)
        times = {fn.__name__: _timed(fn) for fn in order}
        with_cal.append(times["calibrating"])
        without.append(times["calibrated"])
        ratios.append(times["calibrating"] / times["calibrated"])
    step = statistics.median(without)
    extra = statistics.median(ratios) - 1.0
    print(
        f"1. same span, {args.rounds} rounds: calibrating step {statistics.median(with_cal) * 1e3:.3f} ms, "
        f"calibrated step {step * 1e3:.3f} ms (medians)"
    )
    print(
        f"   calibration / step = {extra:.3f} (median per-round ratio - 1; per-round range "
        f"{min(ratios) - 1:.3f} to {max(ratios) - 1:.3f})"
    )

    # 2. fresh spans, first call: the opaque lambda against F.cross_entropy itself (read, never calibrated)
    extras: list[float] = []
    firsts: list[float] = []
    for r in range(args.fresh):
        opaque_span, read_span = _span(args, devices), _span(args, devices)

        def opaque_first(spanned: torchspan.Spanned = opaque_span) -> None:
            spanned.train_step(x, y, loss)

        def read_first(spanned: torchspan.Spanned = read_span) -> None:
            spanned.train_step(x, y, F.cross_entropy)

        order = (opaque_first, read_first) if r % 2 else (read_first, opaque_first)
        times = {fn.__name__: _timed(fn) for fn in order}
        assert opaque_span._loss_checks.calibrations == 1 and read_span._loss_checks.calibrations == 0  # noqa: SLF001
        later = statistics.median(_timed(opaque_first) for _ in range(3))
        extras.append((times["opaque_first"] - times["read_first"]) / later)
        firsts.append(times["opaque_first"] / later)
    print(
        f"2. fresh spans, {args.fresh} pairs: (opaque first call - F.cross_entropy first call) / later "
        f"step = {statistics.median(extras):.3f} (median; range {min(extras):.3f} to {max(extras):.3f})"
    )
    print(
        f"3. fresh span, opaque loss: first call / later step = {statistics.median(firsts):.3f} (median; "
        f"range {min(firsts):.3f} to {max(firsts):.3f})"
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"1-minute load average after: {load:.2f}")
    print(
        f"RATIO loss_calibration/calibration_vs_step {extra:.3f} - an opaque loss's calibration (one extra "
        f"no-grad forward, once) over one train_step, MLP width {args.width}, {args.microbatches} "
        f"micro-batches on {args.devices}"
    )


if __name__ == "__main__":
    main()

"""``torchspan verify TARGET --input-shape 32,512 [--devices cpu,cpu] [--balance 2,2] ...``: gradient parity check.

Builds the model named by TARGET (``package.module:factory`` or ``file.py:factory``), trains one
step on random data with an MSE loss to a random target twice: with ``torchspan.span`` on the
given devices, and on one device as the reference. Prints the largest absolute and relative
gradient difference per layer and PASS/FAIL (exit status 1 on FAIL).

Usage: ``torchspan verify mymodels:build --input-shape 32,512 --devices cpu,cpu --microbatches 4``.
"""

from __future__ import annotations

import argparse
import copy
import warnings
from typing import Any

import torch
from rich.table import Table
from torch.utils._pytree import tree_map

from ..layers import top_level_layers
from ..training import mse_loss
from ._common import UsageError, console, load_target, synthetic_batch


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check that span's gradients equal single-device gradients", description=__doc__)
    p.add_argument("target", metavar="TARGET", help="model factory: package.module:factory or path/to/file.py:factory")
    p.add_argument("--input-shape", required=True, help="input tensor shape, batch first, e.g. 32,512")
    p.add_argument("--input-dtype", choices=("float32", "int64"), default="float32", help="input dtype (int64: token ids)")
    p.add_argument("--vocab", type=int, default=100, help="int64 inputs are drawn from [0, VOCAB) (default 100)")
    p.add_argument("--devices", default="cpu,cpu", help="stage devices, comma separated (default cpu,cpu)")
    p.add_argument("--balance", default=None, help="layers per stage, e.g. 2,2 (default: even split)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    p.add_argument("--checkpoint", choices=("never", "except_last", "always"), default="never")
    p.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{name} {text!r} is not a comma-separated list of integers, e.g. 32,512") from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{name} {text!r} needs positive integers, e.g. 32,512")
    return values


def _random_like(out: Any) -> Any:
    """A random target shaped like the model's output (every tensor leaf replaced by normal noise)."""
    return tree_map(lambda t: torch.randn_like(t.float()) if isinstance(t, torch.Tensor) else t, out)


def run(args: argparse.Namespace) -> int:
    import torchspan

    from ..parity import check_parity

    shape = _ints(args.input_shape, "--input-shape")
    balance = _ints(args.balance, "--balance") if args.balance else None
    if args.microbatches < 1:
        raise UsageError(f"--microbatches {args.microbatches} must be >= 1")
    model = load_target(args.target)
    reference = copy.deepcopy(model)
    torch.manual_seed(args.seed)
    x = synthetic_batch(tuple(shape), getattr(torch, args.input_dtype), args.vocab)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spanned = torchspan.span(
            model,
            devices=args.devices,
            balance=balance,
            microbatches=args.microbatches,
            schedule=args.schedule,
            checkpoint=args.checkpoint,
        )
    result = check_parity(spanned, reference, x, _random_like, mse_loss, atol=args.atol, rtol=args.rtol)

    con = console()
    con.print(
        f"torchspan verify {args.target}: mode={spanned.mode}, stages="
        + "; ".join(f"{d}: {', '.join(g)}" for d, g in spanned.stages)
        + f", microbatches={args.microbatches}, schedule={args.schedule}, checkpoint={args.checkpoint}"
    )
    for w in caught:
        con.print(f"note: {w.message}")
    table = Table(title="gradient difference vs one device, per layer")
    for col in ("layer", "stage device", "params", "max abs diff", "max rel diff", "result"):
        table.add_column(col, justify="left" if col in ("layer", "stage device", "result") else "right")
    device_of = {name: dev for dev, group in spanned.stages for name in group}
    for layer, _ in top_level_layers(model):
        diffs = result.under(layer)
        worst_abs = max((d.max_abs for d in diffs), default=0.0)
        worst_rel = max((d.max_rel for d in diffs), default=0.0)
        ok = all(d.within for d in diffs)
        table.add_row(layer, device_of.get(layer, "-"), str(len(diffs)), f"{worst_abs:.3e}", f"{worst_rel:.3e}", "ok" if ok else "DIFFERENT")
    con.print(table)
    con.print(f"loss: torchspan {result.loss:.6g}, one device {result.reference_loss:.6g}")
    con.print(f"{'PASS' if result.ok else 'FAIL'} (atol={args.atol:g}, rtol={args.rtol:g})")
    return 0 if result.ok else 1

"""``torchspan verify TARGET --input-shape 32,512 [--devices cpu,cpu] [--balance 2,2] ...``: gradient parity check.

Builds the model named by TARGET (``package.module:factory`` or ``file.py:factory``), trains one
step on random data with an MSE loss to a random target twice: with ``torchspan.span`` on the
given devices, and on one device as the reference. Prints the largest absolute and relative
gradient difference per layer and PASS/FAIL (exit status 1 on FAIL).

``--strategies single,local-pipeline,dp,rank-pipeline,hybrid --nproc 2|4`` instead runs one step of
each strategy from the same weights and global batch (multi-process ones in gloo processes on
127.0.0.1) and prints each one's per-parameter differences from one device.

Usage: ``torchspan verify mymodels:build --input-shape 32,512 --devices cpu,cpu --microbatches 4``;
``torchspan verify mymodels:build --input-shape 7,16 --strategies single,dp,rank-pipeline --nproc 2``.
"""

from __future__ import annotations

import argparse
import copy
import warnings
from typing import Any

import torch
from rich.table import Table
from torch.utils._pytree import tree_map

from ..training import mse_loss
from ._common import UsageError, add_input_options, console, named_inputs, parse_dtype
from ._target import build_model, first_call, make_batch, require_data_devices


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check that span's gradients equal single-device gradients", description=__doc__)
    p.add_argument("target", metavar="TARGET", help="model factory: package.module:factory or path/to/file.py:factory")
    p.add_argument("--input-shape", help="input tensor shape, batch first, e.g. 32,512 (or named inputs with --input)")
    p.add_argument("--input-dtype", default="float32", help="input dtype, e.g. float32 or int64 (token ids in [0, --vocab))")
    add_input_options(p)
    p.add_argument("--vocab", type=int, default=100, help="int64 inputs are drawn from [0, VOCAB) (default 100)")
    p.add_argument("--devices", default="cpu,cpu", help="stage devices, comma separated (default cpu,cpu)")
    p.add_argument("--balance", default=None, help="layers per stage, e.g. 2,2 (default: even split)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    p.add_argument("--checkpoint", choices=("never", "except_last", "always"), default="never")
    p.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--strategies",
        default=None,
        metavar="LIST",
        help="compare several strategies with one device instead: any of single,local-pipeline,dp,rank-pipeline,hybrid "
        "(dp, rank-pipeline and hybrid run in --nproc gloo processes on 127.0.0.1)",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes for dp and rank-pipeline; hybrid needs 4 = 2 stages x 2 replicas (default 2)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds the processes of one --nproc run may take before they are killed (default 180)")
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

    if not args.input_shape and not args.input:
        raise UsageError("give the input: --input-shape 32,512 [--input-dtype int64], or named inputs --input input_ids=8,128:int64")
    if args.input_shape and args.input:
        raise UsageError("give either --input-shape (one positional input) or --input NAME=SHAPE (keyword inputs), not both")
    dtype = parse_dtype(args.input_dtype, "--input-dtype")
    shape = _ints(args.input_shape, "--input-shape") if args.input_shape else []
    balance = _ints(args.balance, "--balance") if args.balance else None
    if args.microbatches < 1:
        raise UsageError(f"--microbatches {args.microbatches} must be >= 1")
    require_data_devices([d for d in args.devices.split(",") if d.strip()], "--devices")
    model = build_model(args.target)
    reference = copy.deepcopy(model)
    torch.manual_seed(args.seed)
    x: Any = named_inputs(args.input, args.vocab, dtype)  # keyword inputs: the forward's own errors name them
    if x is None:
        x = make_batch(shape, dtype, args.vocab, option=f"--input-shape {args.input_shape}")
        first_call(model, x, "--input-shape/--input-dtype", vocab=args.vocab)

    if args.strategies is not None:
        from ._verify_ranks import run_strategies

        return run_strategies(args, model, x, balance, _random_like)
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
    zero = _zero_on_both_sides(model, reference)
    for layer in [name for _, group in spanned.stages for name in group]:
        diffs = result.under(layer)
        worst_abs = max((d.max_abs for d in diffs), default=0.0)
        worst_rel = max((d.max_rel for d in diffs), default=0.0)
        ok = all(d.within for d in diffs)
        flag = "ok" if ok else "DIFFERENT"
        if ok and diffs and all(d.name in zero for d in diffs):
            flag = "zero grads"
        table.add_row(layer, device_of.get(layer, "-"), str(len(diffs)), f"{worst_abs:.3e}", f"{worst_rel:.3e}", flag)
    con.print(table)
    con.print(f"loss: torchspan {result.loss:.6g}, one device {result.reference_loss:.6g}")
    trained = [n for n, p in reference.named_parameters() if p.requires_grad]
    if zero:
        con.print(
            f"warning: {len(zero)} of {len(trained)} parameter(s) got gradients that are exactly zero on both sides "
            f"({', '.join(zero[:5])}{', ...' if len(zero) > 5 else ''}): equal, but that proves nothing for them "
            "(a zero-initialised head, an unused branch, a detached path). Check the model, or verify after a training step"
        )
    if result.ok and trained and len(zero) == len(trained):
        con.print(f"INCONCLUSIVE: every gradient is exactly zero on both sides (atol={args.atol:g}, rtol={args.rtol:g})")
        return 1
    con.print(f"{'PASS' if result.ok else 'FAIL'} (atol={args.atol:g}, rtol={args.rtol:g})")
    return 0 if result.ok else 1


def _zero_on_both_sides(model: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    """Trainable parameters whose gradient is missing or exactly zero in both the spanned model and the reference."""
    ref = dict(reference.named_parameters())
    out = []
    for name, p in model.named_parameters():
        q = ref.get(name)
        if q is None or not p.requires_grad:
            continue
        if all(g is None or not bool(g.detach().ne(0).any()) for g in (p.grad, q.grad)):
            out.append(name)
    return out

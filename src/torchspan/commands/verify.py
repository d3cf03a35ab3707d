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
import math
import warnings
from typing import Any

import torch
from rich.table import Table
from torch.utils._pytree import tree_leaves, tree_map

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


def mse_to(target: Any) -> Any:
    """MSE between every floating-point tensor of an output and the same place in ``target``, summed."""

    def loss_fn(out: Any, tgt: Any) -> torch.Tensor:
        pairs = [(o, t) for o, t in zip(tree_leaves(out), tree_leaves(tgt)) if isinstance(o, torch.Tensor) and o.is_floating_point()]
        if not pairs:
            raise UsageError("the model's output has no floating-point tensor to put an MSE loss on")
        return sum((torch.nn.functional.mse_loss(o.float(), t.float()) for o, t in pairs), torch.zeros((), device=pairs[0][0].device))

    return loss_fn


def run(args: argparse.Namespace) -> int:
    import torchspan

    shape = _ints(args.input_shape, "--input-shape")
    balance = _ints(args.balance, "--balance") if args.balance else None
    if args.microbatches < 1:
        raise UsageError(f"--microbatches {args.microbatches} must be >= 1")
    model = load_target(args.target)
    reference = copy.deepcopy(model)
    torch.manual_seed(args.seed)
    x = synthetic_batch(tuple(shape), getattr(torch, args.input_dtype), args.vocab)
    ref_device = next((p.device for p in reference.parameters()), torch.device("cpu"))
    out = reference(x.to(ref_device))
    target = tree_map(lambda t: torch.randn_like(t.float()) if isinstance(t, torch.Tensor) else t, out)
    loss_fn = mse_to(target)
    ref_loss = loss_fn(out, target)
    ref_loss.backward()

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
    loss = spanned.train_step(x, target, loss_fn)

    con = console()
    con.print(
        f"torchspan verify {args.target}: mode={spanned.mode}, stages="
        + "; ".join(f"{d}: {', '.join(g)}" for d, g in spanned.stages)
        + f", microbatches={args.microbatches}, schedule={args.schedule}, checkpoint={args.checkpoint}"
    )
    for w in caught:
        con.print(f"note: {w.message}")
    ref_params = dict(reference.named_parameters())
    table = Table(title="gradient difference vs one device, per layer")
    for col in ("layer", "stage device", "params", "max abs diff", "max rel diff", "result"):
        table.add_column(col, justify="left" if col in ("layer", "stage device", "result") else "right")
    device_of = {name: dev for dev, group in spanned.stages for name in group}
    ok_all = True
    for layer, _ in model.named_children():
        worst_abs, worst_rel, n, ok = 0.0, 0.0, 0, True
        for pname, p in getattr(model, layer).named_parameters():
            ref_p = ref_params[f"{layer}.{pname}"]
            g, rg = p.grad, ref_p.grad
            n += 1
            if (g is None) != (rg is None):
                ok, worst_abs, worst_rel = False, math.inf, math.inf
                continue
            if g is None or rg is None:
                continue
            g, rg = g.detach().float().cpu(), rg.detach().float().cpu()
            diff = (g - rg).abs()
            scale = rg.abs().max().item()
            worst_abs = max(worst_abs, diff.max().item() if diff.numel() else 0.0)
            worst_rel = max(worst_rel, (diff.max().item() / scale) if scale > 0 and diff.numel() else 0.0)
            ok = ok and bool(torch.all(diff <= args.atol + args.rtol * rg.abs()))
        ok_all = ok_all and ok
        table.add_row(layer, device_of.get(layer, "-"), str(n), f"{worst_abs:.3e}", f"{worst_rel:.3e}", "ok" if ok else "DIFFERENT")
    con.print(table)
    same_loss = math.isclose(float(loss), float(ref_loss.detach()), rel_tol=max(args.rtol, 1e-6), abs_tol=args.atol)
    con.print(f"loss: torchspan {float(loss):.6g}, one device {float(ref_loss.detach()):.6g}")
    ok_all = ok_all and same_loss
    con.print(f"{'PASS' if ok_all else 'FAIL'} (atol={args.atol:g}, rtol={args.rtol:g})")
    return 0 if ok_all else 1

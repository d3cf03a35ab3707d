"""``torchspan verify TARGET --input-shape 32,512 [--devices cpu,cpu] [--balance 2,2] ...``: gradient parity
check.

Builds the model named by TARGET (``package.module:factory`` or ``file.py:factory``), trains one
step on random data with an MSE loss to a random target twice: with ``torchspan.span`` on the
given devices, and on one device as the reference. Prints the largest absolute and relative
gradient difference per layer and PASS/FAIL (exit status 1 on FAIL). A transformers model's generation cache
is turned off (``config.use_cache = False``, here and in every rank): a training step needs none.

``--strategies single,local-pipeline,dp,rank-pipeline,hybrid,fsdp --nproc-per-node 2|4`` instead runs one
step of each strategy from the same weights and global batch (multi-process ones in gloo processes on
127.0.0.1; ``fsdp`` is sharded data parallel, ``fsdp-offload`` the same with CPU offload, one process per GPU)
and prints each one's per-parameter differences from one device. ``--json`` prints the same results (per layer
and parameter, or per strategy and parameter) and the verdict as JSON; the exit status is the same.

Usage: ``torchspan verify mymodels:build --input-shape 32,512 --devices cpu,cpu --microbatches 4``;
``torchspan verify mymodels:build --input-shape 7,16 --strategies single,dp,rank-pipeline --nproc-per-node
2``.
"""

from __future__ import annotations

import argparse
import copy
import math
import warnings
from typing import Any

import torch
from rich.table import Table
from torch.utils._pytree import tree_map

from ..parity import Parity
from ..training import mse_loss
from ._common import UsageError, console, json_float, parse_dtype, print_json
from ._options import (
    add_devices_option,
    add_json_option,
    add_microbatches_option,
    add_nproc_option,
    add_recompute_option,
    add_schedule_option,
    add_seed_option,
    add_target_arguments,
)
from ._target import (
    build_model,
    caches_off,
    dropout_off,
    example_inputs,
    first_call,
    require_data_devices,
    require_inputs,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify", help="check that span's gradients equal single-device gradients", description=__doc__
    )
    add_target_arguments(p, "the model keeps its own dtype")
    add_devices_option(p, "one pipeline stage on each of these devices", default="cpu,cpu")
    p.add_argument(
        "--balance", default=None, metavar="N,N...", help="layers per stage, e.g. 2,2 (default: even split)"
    )
    add_microbatches_option(p, auto=False, default=4)
    add_schedule_option(p, default="gpipe")
    add_recompute_option(p, default="never")
    p.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    add_seed_option(p)
    p.add_argument(
        "--strategies",
        default=None,
        metavar="LIST",
        help="compare several strategies with one device instead: any of "
        "single,local-pipeline,dp,rank-pipeline,hybrid,"
        "fsdp,fsdp-offload,tp,tp-fsdp (the multi-process ones run in --nproc-per-node gloo processes on "
        "127.0.0.1; fsdp-offload needs a GPU per process; tp-fsdp needs 4)",
    )
    p.add_argument(
        "--tp-plan",
        default=None,
        metavar="PLAN",
        help="tp and tp-fsdp: MODULE=STYLE pairs (colwise, rowwise, colwise_rep, rowwise_rep, "
        "sequence_parallel), "
        "e.g. 0=colwise,2=rowwise; default: the model's own (a transformers config's base_model_tp_plan)",
    )
    add_nproc_option(
        p,
        "processes for dp, fsdp and rank-pipeline with --strategies; hybrid needs 4 = 2 stages x 2 replicas",
        default=2,
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=180.0,
        help="seconds the processes of one --nproc-per-node run may take before they are killed (default "
        "180)",
    )
    add_json_option(
        p, "the per-layer and per-parameter results (per strategy with --strategies) and the verdict"
    )
    p.set_defaults(func=run)


def _ints(text: str, name: str, example: str = "2,2") -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(
            f"{name} {text!r} is not a comma-separated list of integers, e.g. {name} {example}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{name} {text!r} needs positive integers, e.g. {name} {example}")
    return values


def _random_like(out: Any) -> Any:
    """A random target shaped like the model's output (every tensor leaf replaced by normal noise)."""
    return tree_map(lambda t: torch.randn_like(t.float()) if isinstance(t, torch.Tensor) else t, out)


def run(args: argparse.Namespace) -> int:
    """``torchspan verify``: one step with ``span`` against one device (or ``--strategies``); 0 on PASS, 1
    otherwise."""
    balance = _check_options(args)
    # a transformers model's default use_cache=True: no cache in training
    model = caches_off(build_model(args.target))
    dropped = [note] if (note := dropout_off(model)) else []
    reference = copy.deepcopy(model)
    x = _example(args, model)
    if args.strategies is not None:
        from ._verify_ranks import run_strategies

        return run_strategies(args, model, x, balance, _random_like, dropped)
    spanned, notes = _span(model, args, balance)
    notes = dropped + notes
    result = _parity(spanned, reference, x, args)
    zero = _zero_on_both_sides(model, reference)
    trained = [n for n, p in reference.named_parameters() if p.requires_grad]
    verdict = _verdict(result, zero, trained)
    rows = _layer_rows(spanned, result, zero)
    if args.json:
        print_json(_as_json(args, spanned, result, rows, zero, notes, verdict))
    else:
        _print(args, spanned, result, rows, zero, trained, notes, verdict)
    return 0 if verdict == "PASS" else 1


def _parity(spanned: Any, reference: torch.nn.Module, x: Any, args: argparse.Namespace) -> Parity:
    """``check_parity`` of one step with an MSE loss to a random target, at ``--atol``/``--rtol``."""
    from ..parity import check_parity

    return check_parity(spanned, reference, x, _random_like, mse_loss, atol=args.atol, rtol=args.rtol)


def _check_options(args: argparse.Namespace) -> list[int] | None:
    """Every check that needs no model; returns ``--balance`` parsed."""
    from ._common import parse_shape

    require_inputs(args.input_shape, args.input, "--input-dtype")
    parse_dtype(args.dtype, "--input-dtype")
    if args.input_shape:
        parse_shape(args.input_shape)
    if args.vocab < 1:
        raise UsageError(f"--vocab {args.vocab} must be >= 1 (token ids are drawn from [0, VOCAB))")
    balance = _ints(args.balance, "--balance") if args.balance else None
    if args.microbatches < 1:
        raise UsageError(f"--microbatches {args.microbatches} must be >= 1")
    for option, value, example in (("--atol", args.atol, "1e-5"), ("--rtol", args.rtol, "1e-4")):
        if (
            not math.isfinite(value) or value < 0
        ):  # inf passes every difference, nan none: either verdict is wrong
            raise UsageError(f"{option} {value!r} must be a finite number >= 0, e.g. {option} {example}")
    require_data_devices([d for d in args.devices.split(",") if d.strip()], "--devices")
    return balance


def _example(args: argparse.Namespace, model: torch.nn.Module) -> Any:
    """The seeded example batch, tried on the model first (as ``plan`` and ``run`` do: a batch the forward
    rejects, token ids past the embedding's rows, is one line naming the options)."""
    dtype = parse_dtype(args.dtype, "--input-dtype")
    torch.manual_seed(args.seed)
    x, _, _ = example_inputs(args.input_shape, args.input, dtype, args.vocab, "--input-dtype")
    first_call(
        model, x, "--input" if isinstance(x, dict) else "--input-shape/--input-dtype", vocab=args.vocab
    )
    return x


def _span(
    model: torch.nn.Module, args: argparse.Namespace, balance: list[int] | None
) -> tuple[Any, list[str]]:
    """``span`` with the pipeline options, and the warnings it gave as notes."""
    import torchspan

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spanned = torchspan.span(
            model,
            devices=args.devices,
            balance=balance,
            microbatches=args.microbatches,
            schedule=args.schedule,
            recompute=args.recompute,
        )
    return spanned, [str(w.message) for w in caught]


def _verdict(result: Parity, zero: list[str], trained: list[str]) -> str:
    """PASS, FAIL, or INCONCLUSIVE when every trained gradient is exactly zero on both sides."""
    if result.ok and trained and len(zero) == len(trained):
        return "INCONCLUSIVE"
    return "PASS" if result.ok else "FAIL"


def _layer_rows(spanned: Any, result: Parity, zero: list[str]) -> list[dict[str, Any]]:
    """Per layer in stage order: its device, parameter count, worst differences and ok / DIFFERENT / zero
    grads."""
    device_of = {name: dev for dev, group in spanned.stages for name in group}
    rows = []
    for layer in [name for _, group in spanned.stages for name in group]:
        diffs = result.under(layer)
        ok = all(d.within for d in diffs)
        flag = "ok" if ok else "DIFFERENT"
        if ok and diffs and all(d.name in zero for d in diffs):
            flag = "zero grads"
        rows.append(
            {
                "layer": layer,
                "device": device_of.get(layer, "-"),
                "parameters": len(diffs),
                "max_abs": max((d.max_abs for d in diffs), default=0.0),
                "max_rel": max((d.max_rel for d in diffs), default=0.0),
                "result": flag,
            }
        )
    return rows


def _print(
    args: argparse.Namespace,
    spanned: Any,
    result: Parity,
    rows: list[dict[str, Any]],
    zero: list[str],
    trained: list[str],
    notes: list[str],
    verdict: str,
) -> None:
    con = console()
    con.print(
        f"torchspan verify {args.target}: mode={spanned.mode}, stages="
        + "; ".join(f"{d}: {', '.join(g)}" for d, g in spanned.stages)
        + f", microbatches={args.microbatches}, schedule={args.schedule}, recompute={args.recompute}"
    )
    for note in notes:
        con.print(f"note: {note}")
    table = Table(title="gradient difference vs one device, per layer")
    for col in ("layer", "stage device", "params", "max abs diff", "max rel diff", "result"):
        table.add_column(col, justify="left" if col in ("layer", "stage device", "result") else "right")
    for r in rows:
        table.add_row(
            r["layer"],
            r["device"],
            str(r["parameters"]),
            f"{r['max_abs']:.3e}",
            f"{r['max_rel']:.3e}",
            r["result"],
        )
    con.print(table)
    con.print(f"loss: torchspan {result.loss:.6g}, one device {result.reference_loss:.6g}")
    if zero:
        con.print(
            f"warning: {len(zero)} of {len(trained)} parameter(s) got gradients that are exactly zero on "
            f"both sides ({', '.join(zero[:5])}{', ...' if len(zero) > 5 else ''}): equal, but that proves "
            "nothing for them (a zero-initialised head, an unused branch, a detached path). Check the "
            "model, or verify after a training step"
        )
    if verdict == "INCONCLUSIVE":
        con.print(
            f"INCONCLUSIVE: every gradient is exactly zero on both sides (atol={args.atol:g}, "
            f"rtol={args.rtol:g})"
        )
        return
    con.print(f"{verdict} (atol={args.atol:g}, rtol={args.rtol:g})")


def _as_json(
    args: argparse.Namespace,
    spanned: Any,
    result: Parity,
    rows: list[dict[str, Any]],
    zero: list[str],
    notes: list[str],
    verdict: str,
) -> dict[str, Any]:
    return {
        "target": args.target,
        "mode": spanned.mode,
        "stages": [{"device": d, "layers": list(g)} for d, g in spanned.stages],
        "microbatches": args.microbatches,
        "schedule": args.schedule,
        "recompute": args.recompute,
        "seed": args.seed,
        "atol": args.atol,
        "rtol": args.rtol,
        "loss": result.loss,
        "reference_loss": result.reference_loss,
        "layers": [
            {**r, "max_abs": json_float(r["max_abs"]), "max_rel": json_float(r["max_rel"])} for r in rows
        ],
        "parameters": [g.to_dict() for g in result.grads],
        "zero_on_both_sides": zero,
        "notes": notes,
        "verdict": verdict,
    }


def _zero_on_both_sides(model: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    """Trainable parameters whose gradient is missing or exactly zero in both the spanned model and the
    reference."""
    ref = dict(reference.named_parameters())
    out = []
    for name, p in model.named_parameters():
        q = ref.get(name)
        if q is None or not p.requires_grad:
            continue
        if all(g is None or not bool(g.detach().ne(0).any()) for g in (p.grad, q.grad)):
            out.append(name)
    return out

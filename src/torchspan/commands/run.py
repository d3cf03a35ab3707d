"""``torchspan run TARGET --input-shape 32,512``: measure a plan by training ``span`` on synthetic data, predicted vs measured.

Builds the model named by TARGET (``package.module:factory`` or ``path/to/file.py:factory``), takes
a plan (``--plan plan.json`` from ``torchspan plan --out``, or plans now for ``--devices``), and
trains ``span(model, plan)`` for ``--steps`` steps on one random batch of the given shape and dtype
(integer dtypes draw token ids in [0, --vocab)). Targets are random: tensors shaped like the output
for ``--loss mse``, class indices over the output's last dimension for ``--loss ce``. Then prints the
plan's predicted ``train_step`` time and per-stage memory next to the measured figures, with ratios.

Examples::

    torchspan run examples/models.py:mlp --input-shape 64,1024 --devices cpu,cpu --steps 20
    torchspan plan examples/models.py:mlp --input-shape 64,1024 --devices cpu,cpu --out plan.json
    torchspan run examples/models.py:mlp --input-shape 64,1024 --plan plan.json --out run/ --json
    torchspan run train.py:gpt2 --input input_ids=8,128:int64 --vocab 50 --devices cpu,cpu --steps 5
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from ..training import LossNotFinite, OutOfMemoryAtStep, mse_loss, train
from ._common import (
    UsageError,
    add_memory_option,
    console,
    parse_dtype,
    parse_memory_options,
    parse_microbatches,
    parse_shape,
    print_json,
)
from ._target import add_target_arguments, build_model, example_inputs, first_call, require_data_devices
from ._plans import check_plan_devices, check_plan_layers, device_entries, first_line, load_plan, make_plan

OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
_PLANNING_OPTIONS = ("devices", "memory", "microbatches", "schedule", "checkpoint", "spread")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="train a model with span on synthetic data; predicted vs measured step time and memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_arguments(p, "a floating dtype also casts the model to it")
    p.add_argument("--plan", metavar="FILE", help="run this plan (from `torchspan plan --out FILE`) instead of planning now")
    p.add_argument("--devices", metavar="SPEC", help="plan for these devices (default auto), e.g. 'cpu,cpu' or 'cuda:0,cpu'")
    add_memory_option(p)
    p.add_argument("--microbatches", metavar="N", help="micro-batches per step (default: the planner's choice)")
    p.add_argument("--schedule", choices=("auto", "gpipe", "1f1b"), help="pipeline schedule (default: the planner's choice)")
    p.add_argument("--checkpoint", choices=("auto", "never", "except_last", "always"), help="activation checkpointing (default: the planner's choice)")
    p.add_argument(
        "--spread",
        action="store_true",
        help="one stage on every listed device even where the planner predicts fewer is faster, as the demo does "
        "(shows the pipeline on 'cpu,cpu'; searches all cuts, so meant for models of tens of layers)",
    )
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adam", help="optimizer (default adam)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument(
        "--precision",
        choices=("32", "bf16", "fp16"),
        default="32",
        help="autocast with fp32 master weights: bf16, or fp16 with a gradient scaler (default 32); unlike --dtype float16 it trains with Adam",
    )
    p.add_argument("--loss", choices=("mse", "ce"), default="mse", help="mse to random targets, or cross-entropy to random classes (default mse)")
    p.add_argument("--seed", type=int, default=0, help="seed for the synthetic batch (default 0)")
    p.add_argument("--out", metavar="DIR", help="write plan.json, run.json, timeline.png, memory.png and loss.png into DIR")
    p.add_argument("--json", action="store_true", help="print the measured and predicted figures as JSON (progress goes to stderr)")
    p.set_defaults(func=run)


# --------------------------------------------------------------------------- inputs


def _check_args(args: argparse.Namespace) -> None:
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps} must be >= 1")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr {args.lr} must be a finite number > 0, e.g. --lr 1e-3")
    if args.vocab < 1:
        raise UsageError(f"--vocab {args.vocab} must be >= 1 (token ids are drawn from [0, VOCAB))")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out!r} is a file; name a folder (it is created if missing), e.g. --out run-out")
    if args.plan:
        given = [f"--{name}" for name in _PLANNING_OPTIONS if getattr(args, name) not in (None, False)]
        if given:
            raise UsageError(
                f"--plan {args.plan} already fixes devices, micro-batches, schedule and checkpointing; drop {', '.join(given)}, "
                "or drop --plan to plan afresh with them"
            )


def _targets_and_loss(out: Any, kind: str) -> tuple[Any, Any]:
    """Random targets for the probe output ``out`` and the loss function to train with."""
    from torch.utils._pytree import tree_leaves, tree_map

    if kind == "mse":
        if not any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tree_leaves(out)):
            raise UsageError(f"--loss mse needs a floating-point tensor in the model's output; it returned {type(out).__name__} without one")
        target = tree_map(lambda t: torch.randn(t.shape) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)
        return target, mse_loss
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.dim() < 2:
        got = f"a tensor of shape {tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise UsageError(
            f"--loss ce needs the model to return one floating tensor of scores, classes in the last dimension; it returned {got}. "
            "Use --loss mse"
        )
    classes = out.shape[-1]
    target = torch.randint(0, classes, tuple(out.shape[:-1]))

    def cross_entropy(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(scores.flatten(0, -2).float(), labels.flatten())

    return target, cross_entropy


def _not_finite_advice(exc: LossNotFinite, args: argparse.Namespace) -> str:
    """Why the loss stopped being finite, and what to change: the learning rate, or fp16 weights under Adam."""
    head = f"the loss became {exc.value} at step {exc.step + 1}"
    if parse_dtype(args.dtype) == torch.float16 and args.optimizer in ("adam", "adamw"):
        return (
            f"{head}: --dtype float16 makes the parameters fp16, where {args.optimizer}'s eps (1e-8) and its squared "
            "gradients underflow to 0, so its update divides by zero at any --lr. Keep fp32 weights and compute in half "
            "precision: drop --dtype and pass --precision fp16 (or bf16; autocast with fp32 master weights), "
            "or train fp16 weights with --optimizer sgd"
        )
    return f"{head}; lower --lr (now {args.lr:g})"


# --------------------------------------------------------------------------- output


def _ratio_text(fig: dict[str, Any]) -> str:
    if fig["ratio"] is not None:
        return f"{fig['ratio']:.2f}"
    return "-" if not fig["measured"] else "n/a (predicted 0)"


def _comparison_table(comparison: dict[str, Any], optimizer_step: float) -> Table:
    from ..profiler.costs import MEMORY_KINDS
    from ..hardware import format_bytes

    table = Table(title="predicted vs measured", caption="step time: train_step (forward + backward), median of the steps after the first")
    for col in ("figure", "stage", "device", "predicted", "measured", "measured / predicted"):
        table.add_column(col, justify="left" if col in ("figure", "device") else "right")
    step = comparison["step_time"]
    predicted = f"{step['predicted'] * 1e3:.2f} ms" if step["predicted"] is not None else "-"
    table.add_row("step time", "", "", predicted, f"{step['measured'] * 1e3:.2f} ms", _ratio_text(step))
    table.add_row("optimizer step", "", "", "not planned", f"{optimizer_step * 1e3:.2f} ms", "-", end_section=True)
    for st in comparison["stages"]:
        for kind in (*MEMORY_KINDS, "total"):
            fig = st[kind]
            if kind != "total" and not fig["predicted"] and not fig["measured"]:
                continue  # e.g. no buffers, SGD without state
            table.add_row(
                kind,
                str(st["stage"]),
                st["device"],
                format_bytes(fig["predicted"]),
                format_bytes(fig["measured"]),
                _ratio_text(fig),
                end_section=kind == "total",
            )
    return table


def _write_outputs(out: Path, plan: Any, spanned: Any, memory: Any, losses: list[float], budgets: dict[str, int], result: dict[str, Any]) -> dict[str, str]:
    import json

    from .. import pictures

    out.mkdir(parents=True, exist_ok=True)
    plan.save(out / "plan.json")
    files = {"plan": out / "plan.json"}
    files["timeline"] = pictures.timeline_png(spanned.timeline(), out / "timeline.png", title=f"last step: {pictures.plan_summary(plan)}")
    files["memory"] = pictures.memory_png(memory, out / "memory.png", budgets=budgets)
    files["loss"] = pictures.loss_png(losses, out / "loss.png")
    written = {name: str(path) for name, path in files.items()}
    written["run"] = str(out / "run.json")
    (out / "run.json").write_text(json.dumps({**result, "files": written}, indent=2) + "\n", encoding="utf-8")
    return written


def run(args: argparse.Namespace) -> int:
    import torchspan

    from .. import pictures
    from ..planner.measured import compare, typical_step_time
    from ..hardware import budget_key, parse_memory

    _check_args(args)
    dtype = parse_dtype(args.dtype)
    if not args.input_shape and not args.input:
        raise UsageError("give the input: --input-shape 32,512 [--dtype int64], or named inputs --input input_ids=8,128:int64")
    if args.input_shape and args.input:
        raise UsageError("give either --input-shape (one positional input) or --input NAME=SHAPE (keyword inputs), not both")
    if args.input_shape:
        parse_shape(args.input_shape)  # a typo is reported before the model is built
    microbatches = parse_microbatches(args.microbatches) if args.microbatches is not None else "auto"
    memory = parse_memory_options(args.memory)
    given = f"--input-shape {args.input_shape}" if args.input_shape else " ".join(f"--input {item}" for item in args.input)
    argv_hint = given + (f" --dtype {args.dtype}" if args.dtype != "float32" else "")
    plan = notes = None
    if args.plan:
        plan = load_plan(args.plan, args.target, argv_hint)
        notes = check_plan_devices(plan, args.plan, args.target, argv_hint)

    if plan is not None:
        require_data_devices(
            [st.device for st in plan.stages],
            f"--plan {args.plan} has stages on",
            fix=f"re-plan for devices with memory: torchspan plan {args.target} {argv_hint} --devices cpu --out {args.plan}",
        )
    else:
        require_data_devices(device_entries(args.devices), "--devices")
    model = build_model(args.target)
    floating = dtype.is_floating_point
    if floating:
        model.to(dtype)
    torch.manual_seed(args.seed)
    x, batch, _ = example_inputs(args.input_shape, args.input, dtype, args.vocab, "--dtype")
    options = "--input" if args.input else "--input-shape/--dtype"
    target, loss_fn = _targets_and_loss(first_call(model, x, options, vocab=args.vocab), args.loss)

    out_con = console()
    con = Console(file=sys.stderr, highlight=False) if args.json else out_con
    notes = list(notes or [])
    if plan is not None:
        check_plan_layers(plan, model, args.plan, args.target, argv_hint)
        if plan.microbatches > batch:
            raise UsageError(
                f"--plan {args.plan} splits each batch into {plan.microbatches} micro-batches, but {given} has batch "
                f"{batch}; use a batch of at least {plan.microbatches}, or re-plan for this batch"
            )
        if plan.batch_size is not None and plan.batch_size != batch:
            notes.append(f"the plan was made for batch {plan.batch_size}, this run uses batch {batch}: predictions are for its batch")
    else:
        with con.status("profiling the model and planning ..."):
            plan = make_plan(model, x, args, memory, microbatches, dtype if floating else None)
        if len(plan.stages) < len(device_entries(args.devices)) and not args.spread:
            notes.append(
                f"the planner uses {len(plan.stages)} of the {len(device_entries(args.devices))} devices listed: it predicts "
                "that fastest (entries of one device share its cores and memory); --spread puts a stage on each"
            )
    try:
        spanned = torchspan.span(model, plan, precision=args.precision)
    except ValueError as exc:
        if args.plan:
            raise UsageError(f"--plan {args.plan}: {first_line(exc)}") from exc
        raise
    optimizer = OPTIMIZERS[args.optimizer](spanned.parameters(), lr=args.lr)

    n_params = sum(p.numel() for p in model.parameters())
    stages = " | ".join(f"{d}: {', '.join(g)}" for d, g in spanned.stages)
    con.print(f"torchspan run {args.target}: {n_params:,} parameters; batch {args.input_shape or ' '.join(args.input)} {args.dtype}; {args.optimizer} lr {args.lr:g}; {args.loss} loss")
    con.print(f"plan: {pictures.plan_summary(plan)}")
    con.print(f"stages: {stages}")
    for note in notes:
        con.print(f"note: {note}")

    try:
        trained = train(spanned, optimizer, lambda step: (x, target), loss_fn, args.steps, console=con, items_per_step=batch)
    except LossNotFinite as exc:
        raise UsageError(_not_finite_advice(exc, args)) from exc
    except OutOfMemoryAtStep as exc:  # pragma: no cover - needs a GPU
        raise UsageError(
            f"{exc}; re-plan with a smaller --memory budget for that device, more --microbatches or --checkpoint always"
        ) from exc
    measured_memory = spanned.memory(optimizer)
    comparison = compare(plan, measured_memory, trained.step_times)
    result: dict[str, Any] = {
        "target": args.target,
        "input_shape": [int(d) for d in x.shape] if isinstance(x, torch.Tensor) else None,
        "inputs": {k: [*map(int, v.shape), str(v.dtype).removeprefix("torch.")] for k, v in x.items()} if isinstance(x, dict) else None,
        "dtype": args.dtype,
        "steps": args.steps,
        "optimizer": args.optimizer,
        "lr": args.lr,
        "precision": args.precision,
        "loss": args.loss,
        "mode": spanned.mode,
        **comparison,
        "optimizer_step_time": typical_step_time(trained.optimizer_times),
        "samples_per_second": trained.items_per_second,
        "seconds": trained.seconds,
        "losses": trained.losses,
        "notes": notes,
        "plan": plan.to_dict(),
    }
    if args.out:
        budgets = {budget_key(dev): parse_memory(size, name=f"--memory {dev}") for dev, size in (memory or {}).items()}
        result["files"] = _write_outputs(Path(args.out), plan, spanned, measured_memory, trained.losses, budgets, result)
    if args.json:
        print_json(result)
        return 0
    losses = trained.losses
    out_con.print(_comparison_table(comparison, result["optimizer_step_time"]))
    out_con.print(
        f"loss {losses[0]:.4g} -> {losses[-1]:.4g} in {args.steps} step(s), {trained.seconds:.2f} s, "
        f"{trained.items_per_second:,.0f} samples/s"
    )
    if args.out:
        out_con.print(f"wrote {', '.join(Path(p).name for p in result['files'].values())} to {args.out}")
    return 0

"""``torchspan run TARGET --input-shape 32,512``: measure a plan by training ``span`` on synthetic data,
predicted vs measured.

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

from ..files import output_folder, write_text
from ..training import LossNotFinite, OutOfMemoryAtStep, Trained, mse_loss, train
from ._common import (
    UsageError,
    console,
    parse_dtype,
    parse_memory_options,
    parse_microbatches,
    parse_shape,
    print_json,
)
from ._options import (
    add_devices_option,
    add_json_option,
    add_memory_option,
    add_microbatches_option,
    add_out_option,
    add_precision_option,
    add_recompute_option,
    add_schedule_option,
    add_seed_option,
    add_target_arguments,
)
from ._plans import check_plan_devices, check_plan_layers, device_entries, first_line, load_plan, make_plan
from ._target import (
    build_model,
    example_inputs,
    first_call,
    model_dtype,
    require_data_devices,
    require_inputs,
)

RUN_FILES = ("plan.json", "run.json", "timeline.png", "memory.png", "loss.png")  # what --out DIR receives
OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
_PLANNING_OPTIONS = ("devices", "memory", "microbatches", "schedule", "recompute", "spread")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="train a model with span on synthetic data; predicted vs measured step time and memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_arguments(p, "a floating dtype given to an input also casts the model to it")
    p.add_argument(
        "--plan",
        metavar="FILE",
        help="run this plan (from `torchspan plan --out FILE`) instead of planning now",
    )
    add_devices_option(p, "plan for these devices (not with --plan)", default=None, default_text="auto")
    add_memory_option(p)
    add_microbatches_option(p, auto=True, default=None)
    add_schedule_option(p, default=None)
    add_recompute_option(p, default=None)
    p.add_argument(
        "--spread",
        action="store_true",
        help="one stage on every listed device even where the planner predicts fewer is faster, as the demo "
        "does "
        "(shows the pipeline on 'cpu,cpu'; searches all cuts, so meant for models of tens of layers)",
    )
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adam", help="optimizer (default adam)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    add_precision_option(p, "; unlike --input-dtype float16 it trains with Adam")
    p.add_argument(
        "--loss",
        choices=("mse", "ce"),
        default="mse",
        help="mse to random targets, or cross-entropy to random classes (default mse)",
    )
    add_seed_option(p)
    add_out_option(p, "DIR", "plan.json, run.json, timeline.png, memory.png and loss.png")
    add_json_option(p, "the measured and predicted figures", " (progress goes to stderr)")
    p.set_defaults(func=run)


# --------------------------------------------------------------------------- inputs


def _check_args(args: argparse.Namespace) -> None:
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps} must be >= 1")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr {args.lr} must be a finite number > 0, e.g. --lr 1e-3")
    if args.vocab < 1:
        raise UsageError(f"--vocab {args.vocab} must be >= 1 (token ids are drawn from [0, VOCAB))")
    if args.out is not None:  # before the model is built or trained: results are never lost to a bad --out
        output_folder(args.out, name="--out", files=RUN_FILES)
    if args.plan:
        given = [f"--{name}" for name in _PLANNING_OPTIONS if getattr(args, name) not in (None, False)]
        if given:
            raise UsageError(
                f"--plan {args.plan} already fixes devices, micro-batches, schedule and recompute; drop "
                f"{', '.join(given)}, or drop --plan to plan afresh with them"
            )


def _targets_and_loss(out: Any, kind: str) -> tuple[Any, Any]:
    """Random targets for the probe output ``out`` and the loss function to train with."""
    from torch.utils._pytree import tree_leaves, tree_map

    if kind == "mse":
        if not any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tree_leaves(out)):
            raise UsageError(
                "--loss mse needs a floating-point tensor in the model's output; it returned "
                f"{type(out).__name__} without one"
            )
        target = tree_map(
            lambda t: torch.randn(t.shape) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
            out,
        )
        return target, mse_loss
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.dim() < 2:
        got = (
            f"a tensor of shape {tuple(out.shape)} {out.dtype}"
            if isinstance(out, torch.Tensor)
            else type(out).__name__
        )
        raise UsageError(
            "--loss ce needs the model to return one floating tensor of scores, classes in the last "
            f"dimension; it returned {got}. Use --loss mse"
        )
    classes = out.shape[-1]
    target = torch.randint(0, classes, tuple(out.shape[:-1]))

    def cross_entropy(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(scores.flatten(0, -2).float(), labels.flatten())

    return target, cross_entropy


def _not_finite_advice(exc: LossNotFinite, args: argparse.Namespace) -> str:
    """Why the loss stopped being finite, and what to change: the learning rate, or fp16 weights under
    Adam."""
    head = f"the loss became {exc.value} at step {exc.step + 1}"
    if parse_dtype(args.dtype) == torch.float16 and args.optimizer in ("adam", "adamw"):
        return (
            f"{head}: --dtype float16 makes the parameters fp16, where {args.optimizer}'s eps (1e-8) and "
            "its squared gradients underflow to 0, so its update divides by zero at any --lr. Keep fp32 "
            "weights and compute in half precision: drop --dtype and pass --precision fp16 (or bf16; "
            "autocast with fp32 master weights), or train fp16 weights with --optimizer sgd"
        )
    return f"{head}; lower --lr (now {args.lr:g})"


# --------------------------------------------------------------------------- output


def _ratio_text(fig: dict[str, Any]) -> str:
    if fig["ratio"] is not None:
        return f"{fig['ratio']:.2f}"
    return "-" if not fig["measured"] else "n/a (predicted 0)"


def _comparison_table(comparison: dict[str, Any], optimizer_step: float) -> Table:
    from ..hardware import format_bytes
    from ..profiler.costs import MEMORY_KINDS

    table = Table(
        title="predicted vs measured",
        caption="step time: train_step (forward + backward), median of the steps after the first",
    )
    for col in ("figure", "stage", "device", "predicted", "measured", "measured / predicted"):
        table.add_column(col, justify="left" if col in ("figure", "device") else "right")
    step = comparison["step_time"]
    predicted = f"{step['predicted'] * 1e3:.2f} ms" if step["predicted"] is not None else "-"
    table.add_row("step time", "", "", predicted, f"{step['measured'] * 1e3:.2f} ms", _ratio_text(step))
    table.add_row(
        "optimizer step", "", "", "not planned", f"{optimizer_step * 1e3:.2f} ms", "-", end_section=True
    )
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


def _write_outputs(
    out: Path,
    plan: Any,
    spanned: Any,
    memory: Any,
    losses: list[float],
    budgets: dict[str, int],
    result: dict[str, Any],
) -> dict[str, str]:
    import json

    from .. import pictures

    out.mkdir(parents=True, exist_ok=True)
    plan.save(out / "plan.json")
    files = {"plan": out / "plan.json"}
    files["timeline"] = pictures.timeline_png(
        spanned.timeline(), out / "timeline.png", title=f"last step: {pictures.plan_summary(plan)}"
    )
    files["memory"] = pictures.memory_png(memory, out / "memory.png", budgets=budgets)
    files["loss"] = pictures.loss_png(losses, out / "loss.png")
    written = {name: str(path) for name, path in files.items()}
    written["run"] = str(out / "run.json")
    write_text(out / "run.json", json.dumps({**result, "files": written}, indent=2) + "\n", name="--out")
    return written


def run(args: argparse.Namespace) -> int:
    """``torchspan run``: plan (or load ``--plan``), train ``span(model, plan)``, print predicted vs
    measured."""
    microbatches, memory = _check_inputs(args)
    plan, notes = _given_plan(args)
    model, x, batch, target, loss_fn = _model_and_batch(args)
    out_con = console()
    con = console(sys.stderr) if args.json else out_con
    if plan is not None:
        notes += _fit_given_plan(plan, model, batch, args)
    else:
        plan, more = _plan_now(model, x, args, memory, microbatches, con)
        notes += more
    spanned = _span(model, plan, args)
    optimizer = OPTIMIZERS[args.optimizer](spanned.parameters(), lr=args.lr)
    _print_setup(con, args, model, plan, spanned, notes)
    trained = _train(spanned, optimizer, x, target, loss_fn, batch, args, con)
    measured_memory = spanned.memory(optimizer)
    result = _result(args, x, spanned, plan, measured_memory, trained, notes)
    if args.out:
        result["files"] = _write_outputs(
            Path(args.out), plan, spanned, measured_memory, trained.losses, _budgets(memory), result
        )
    if args.json:
        print_json(result)
        return 0
    _print_result(out_con, result, trained, args)
    return 0


# --------------------------------------------------------------------------- run's steps


def _given_inputs(args: argparse.Namespace) -> str:
    """The input options as given (``--input-shape 4,16`` or ``--input a=4,16 ...``)."""
    return (
        f"--input-shape {args.input_shape}"
        if args.input_shape
        else " ".join(f"--input {item}" for item in args.input)
    )


def _argv_hint(args: argparse.Namespace) -> str:
    """The input options to repeat in a ``torchspan plan`` command that re-creates the plan."""
    return _given_inputs(args) + (f" --dtype {args.dtype}" if args.dtype != "float32" else "")


def _check_inputs(args: argparse.Namespace) -> tuple[int | str, dict[str, str] | None]:
    """Every check that needs no model: options, inputs, micro-batches and budgets; returns the last two
    parsed."""
    _check_args(args)
    parse_dtype(args.dtype)
    require_inputs(args.input_shape, args.input, "--dtype")
    if args.input_shape:
        parse_shape(args.input_shape)  # a typo is reported before the model is built
    microbatches = parse_microbatches(args.microbatches) if args.microbatches is not None else "auto"
    return microbatches, parse_memory_options(args.memory)


def _given_plan(args: argparse.Namespace) -> tuple[Any, list[str]]:
    """The ``--plan`` file checked against this machine, and notes about it (``(None, [])`` without
    ``--plan``); refuses devices that hold no data, given or planned."""
    if not args.plan:
        require_data_devices(device_entries(args.devices), "--devices")
        return None, []
    hint = _argv_hint(args)
    plan = load_plan(args.plan, args.target, hint)
    notes = check_plan_devices(plan, args.plan, args.target, hint)
    require_data_devices(
        [st.device for st in plan.stages],
        f"--plan {args.plan} has stages on",
        fix=f"re-plan for devices with memory: torchspan plan {args.target} {hint} --devices cpu --out "
        f"{args.plan}",
    )
    return plan, list(notes)


def _model_and_batch(args: argparse.Namespace) -> tuple[torch.nn.Module, Any, int, Any, Any]:
    """The model (cast to a floating ``--dtype``), its seeded example batch, the batch size, random targets
    and the loss."""
    dtype = parse_dtype(args.dtype)
    model = build_model(args.target)
    torch.manual_seed(args.seed)
    x, batch, _ = example_inputs(args.input_shape, args.input, dtype, args.vocab, "--dtype")
    cast = model_dtype(dtype, x)  # integer inputs only: the model keeps the dtype it was built in
    if cast is not None:
        model.to(cast)
    options = "--input" if args.input else "--input-shape/--dtype"
    target, loss_fn = _targets_and_loss(first_call(model, x, options, vocab=args.vocab), args.loss)
    return model, x, batch, target, loss_fn


def _fit_given_plan(plan: Any, model: torch.nn.Module, batch: int, args: argparse.Namespace) -> list[str]:
    """Refuse a ``--plan`` made for another model or for fewer rows than its micro-batches; note another batch
    size."""
    check_plan_layers(plan, model, args.plan, args.target, _argv_hint(args))
    if plan.microbatches > batch:
        raise UsageError(
            f"--plan {args.plan} splits each batch into {plan.microbatches} micro-batches, but "
            f"{_given_inputs(args)} has batch {batch}; use a batch of at least {plan.microbatches}, or "
            "re-plan for this batch"
        )
    if plan.batch_size is not None and plan.batch_size != batch:
        return [
            f"the plan was made for batch {plan.batch_size}, this run uses batch {batch}: predictions are "
            "for its batch"
        ]
    return []


def _plan_now(
    model: torch.nn.Module,
    x: Any,
    args: argparse.Namespace,
    memory: Any,
    microbatches: int | str,
    con: Console,
) -> tuple[Any, list[str]]:
    """A plan made now for ``--devices`` (``--spread``: a stage on each), and a note when it leaves devices
    out."""
    dtype = model_dtype(parse_dtype(args.dtype), x)
    with con.status("profiling the model and planning ..."):
        plan = make_plan(model, x, args, memory, microbatches, dtype)
    listed = len(device_entries(args.devices))
    if len(plan.stages) < listed and not args.spread:
        return plan, [
            f"the planner uses {len(plan.stages)} of the {listed} devices listed: it predicts "
            "that fastest (entries of one device share its cores and memory); --spread puts a stage on each"
        ]
    return plan, []


def _span(model: torch.nn.Module, plan: Any, args: argparse.Namespace) -> Any:
    """``span(model, plan)`` with ``--precision``; a plan ``span`` refuses names ``--plan``."""
    import torchspan

    try:
        return torchspan.span(model, plan, precision=args.precision)
    except ValueError as exc:
        if args.plan:
            raise UsageError(f"--plan {args.plan}: {first_line(exc)}") from exc
        raise


def _print_setup(
    con: Console, args: argparse.Namespace, model: torch.nn.Module, plan: Any, spanned: Any, notes: list[str]
) -> None:
    from .. import pictures

    n_params = sum(p.numel() for p in model.parameters())
    stages = " | ".join(f"{d}: {', '.join(g)}" for d, g in spanned.stages)
    con.print(
        f"torchspan run {args.target}: {n_params:,} parameters; batch "
        f"{args.input_shape or ' '.join(args.input)} {args.dtype}; {args.optimizer} lr {args.lr:g}; "
        f"{args.loss} loss"
    )
    con.print(
        f"plan: {pictures.plan_caption(plan)}"
    )  # a second line names a runner-up within measurement noise
    con.print(f"stages: {stages}")
    for note in notes:
        con.print(f"note: {note}")


def _train(
    spanned: Any,
    optimizer: Any,
    x: Any,
    target: Any,
    loss_fn: Any,
    batch: int,
    args: argparse.Namespace,
    con: Console,
) -> Trained:
    """``training.train`` on the one batch for ``--steps``; a loss that is not finite or a full device becomes
    advice."""
    try:
        return train(
            spanned,
            optimizer,
            lambda step: (x, target),
            loss_fn,
            args.steps,
            console=con,
            items_per_step=batch,
        )
    except LossNotFinite as exc:
        raise UsageError(_not_finite_advice(exc, args)) from exc
    except OutOfMemoryAtStep as exc:  # pragma: no cover - needs a GPU
        raise UsageError(
            f"{exc}; re-plan with a smaller --memory budget for that device, more --microbatches or "
            "--recompute always"
        ) from exc


def _result(
    args: argparse.Namespace,
    x: Any,
    spanned: Any,
    plan: Any,
    measured_memory: Any,
    trained: Trained,
    notes: list[str],
) -> dict[str, Any]:
    """What ``--json`` prints and ``run.json`` holds: the options, predicted vs measured, speed, losses, notes
    and the plan."""
    from ..planner.measured import compare, typical_step_time

    return {
        "target": args.target,
        "input_shape": [int(d) for d in x.shape] if isinstance(x, torch.Tensor) else None,
        "inputs": {k: [*map(int, v.shape), str(v.dtype).removeprefix("torch.")] for k, v in x.items()}
        if isinstance(x, dict)
        else None,
        "dtype": args.dtype,
        "steps": args.steps,
        "optimizer": args.optimizer,
        "lr": args.lr,
        "precision": args.precision,
        "loss": args.loss,
        "mode": spanned.mode,
        **compare(plan, measured_memory, trained.step_times),
        "optimizer_step_time": typical_step_time(trained.optimizer_times),
        "samples_per_second": trained.items_per_second,
        "seconds": trained.seconds,
        "losses": trained.losses,
        "notes": notes,
        "plan": plan.to_dict(),
    }


def _budgets(memory: dict[str, str] | None) -> dict[str, int]:
    """``--memory`` budgets in bytes under the plan's device names (``CPU=1GiB`` -> ``{"cpu": 2**30}``)."""
    from ..hardware import budget_key, parse_memory

    return {
        budget_key(dev): parse_memory(size, name=f"--memory {dev}") for dev, size in (memory or {}).items()
    }


def _print_result(con: Console, result: dict[str, Any], trained: Trained, args: argparse.Namespace) -> None:
    losses = trained.losses
    con.print(_comparison_table(result, result["optimizer_step_time"]))
    con.print(
        f"loss {losses[0]:.4g} -> {losses[-1]:.4g} in {args.steps} step(s), {trained.seconds:.2f} s, "
        f"{trained.items_per_second:,.0f} samples/s"
    )
    if args.out:
        con.print(f"wrote {', '.join(Path(p).name for p in result['files'].values())} to {args.out}")

"""``torchspan run TARGET --input-shape 32,512``: train a model with ``span`` on synthetic data, predicted vs measured.

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
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from ._common import (
    UsageError,
    add_memory_option,
    console,
    load_target,
    parse_dtype,
    parse_memory_options,
    parse_microbatches,
    parse_shape,
    print_json,
    synthetic_batch,
)
from .verify import mse_to

OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
_PLANNING_OPTIONS = ("devices", "memory", "microbatches", "schedule", "checkpoint", "spread")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="train a model with span on synthetic data; predicted vs measured step time and memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="TARGET", help="package.module:factory or path/to/file.py:factory returning the model")
    p.add_argument("--input-shape", required=True, metavar="B,D...", help="shape of one training batch, batch first, e.g. 32,512")
    p.add_argument("--dtype", default="float32", help="input dtype (default float32); a floating dtype also casts the model to it")
    p.add_argument("--vocab", type=int, default=2, help="integer inputs are token ids drawn from [0, VOCAB) (default 2)")
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _probe_output(model: torch.nn.Module, x: torch.Tensor, args: argparse.Namespace) -> Any:
    """One forward without gradients on the model's own device: checks the input and gives the output's shape."""
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            return model(x.to(device))
    except Exception as exc:
        ids = f" (token ids in [0, {args.vocab}))" if not x.is_floating_point() else ""
        options = "--input-shape/--dtype" + ("/--vocab" if ids else "")
        raise UsageError(
            f"the model rejects a batch of shape {','.join(map(str, x.shape))} {args.dtype}{ids}: {_first_line(exc)}; "
            f"set {options} to what its forward expects"
        ) from exc
    finally:
        for m, training in modes.items():
            m.training = training


def _targets_and_loss(out: Any, kind: str) -> tuple[Any, Any]:
    """Random targets for the probe output ``out`` and the loss function to train with."""
    from torch.utils._pytree import tree_leaves, tree_map

    if kind == "mse":
        if not any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tree_leaves(out)):
            raise UsageError(f"--loss mse needs a floating-point tensor in the model's output; it returned {type(out).__name__} without one")
        target = tree_map(lambda t: torch.randn(t.shape) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)
        return target, mse_to(target)
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


# --------------------------------------------------------------------------- plan


def _load_plan(path: str, target: str, argv_hint: str) -> Any:
    from ..planner import Plan

    out = path if path.endswith(".json") else "plan.json"
    replan = f"re-create it: torchspan plan {target} {argv_hint} --out {out}"
    if not Path(path).is_file():
        raise UsageError(f"--plan {path!r} does not exist; write one with torchspan plan {target} {argv_hint} --out {path}")
    try:
        return Plan.load(path)
    except (ValueError, TypeError, KeyError) as exc:
        raise UsageError(f"--plan {path} is not a torchspan plan ({_first_line(exc)}); {replan}") from exc


def _check_plan_devices(plan: Any, path: str, target: str, argv_hint: str) -> list[str]:
    """Raise if a stage's device is absent here; return notes for described (catalog) devices that map to local ones."""
    from ..hardware import devices as find_devices
    from ..hardware import resolve_device

    notes = []
    for i, st in enumerate(plan.stages):
        try:
            resolve_device(st.device, name=f"plan stage {i} device")
        except ValueError:
            visible = ", ".join(dict.fromkeys(str(d.device) for d in find_devices("auto")))
            made_for = f"{st.device} ({st.device_name})" if st.device_name else st.device
            raise UsageError(
                f"--plan {path} puts stage {i} on {made_for}, which this machine does not have (visible: {visible}); "
                f"re-plan for this machine: torchspan plan {target} {argv_hint} --devices auto --out {path}, "
                f"or run without --plan and pass --devices"
            ) from None
        if "(described)" in st.device_name:
            notes.append(f"stage {i} was planned for a described {st.device_name}; it runs on this machine's {st.device}")
    return notes


def _check_plan_layers(plan: Any, model: torch.nn.Module, path: str, target: str, argv_hint: str) -> None:
    names = [n for n, _ in model.named_children()]
    if set(plan.layers) != set(names):
        extra = [n for n in plan.layers if n not in names]
        missing = [n for n in names if n not in plan.layers]
        parts = []
        if extra:
            parts.append(f"places layer(s) {', '.join(extra[:5])} the model lacks")
        if missing:
            parts.append(f"does not place its layer(s) {', '.join(missing[:5])}")
        raise UsageError(
            f"--plan {path} was made for another model: it {' and '.join(parts)} ({target} has {len(names)} top-level layers); "
            f"re-create it: torchspan plan {target} {argv_hint} --out {path}"
        )


def _device_entries(spec: str | None) -> list[str]:
    return [d for d in (spec or "").split(",") if d.strip()]


def _make_plan(model: torch.nn.Module, x: torch.Tensor, args: argparse.Namespace, memory: Any, microbatches: int | str, dtype: Any) -> Any:
    """``torchspan.plan`` for the device options; with ``--spread``, the fastest plan using every listed device."""
    from ..demo.placement import spread_plan
    from ..hardware import devices as find_devices
    from ..planner import plan as make_plan
    from ..profiler import profile

    devices = args.devices or "auto"
    schedule, checkpoint = args.schedule or "auto", args.checkpoint or "auto"
    if not args.spread:
        return make_plan(
            model, x, devices=devices, memory=memory, microbatches=microbatches, schedule=schedule, checkpoint=checkpoint,
            optimizer=args.optimizer, dtype=dtype,
        )  # fmt: skip
    devs = find_devices(devices, memory)
    if len(devs) < 2:
        raise UsageError(f"--spread needs at least two devices; --devices {devices!r} gives {len(devs)}. Try --devices cpu,cpu")
    prof = profile(model, x, devs, optimizer=args.optimizer, dtype=dtype)
    wide = spread_plan(prof, microbatches=microbatches, schedule=schedule, checkpoint=checkpoint)
    if wide is None:
        raise UsageError(
            f"--spread: no placement with one stage on each of the {len(devs)} devices fits "
            f"(the model has {len(prof.layers)} layers; budgets: --memory); raise the budgets, list fewer devices, or drop --spread"
        )
    return wide


# --------------------------------------------------------------------------- training


def _synchronize(devices: list[torch.device]) -> None:
    from .._timing import synchronize

    for d in devices:
        synchronize(d)


def _train(spanned: Any, optimizer: Any, x: Any, target: Any, loss_fn: Any, args: argparse.Namespace, con: Console) -> dict[str, Any]:
    """``--steps`` training steps with a progress bar; returns losses and per-step times."""
    from ..progress import TrainingProgress

    devs = [torch.device(d) for d in dict.fromkeys(spanned.devices)]
    batch = x.shape[0]
    losses: list[float] = []
    step_times: list[float] = []
    optimizer_times: list[float] = []
    t_start = time.perf_counter()
    with TrainingProgress(con, args.steps, speed_unit="samples/s") as bar:
        for step in range(args.steps):
            optimizer.zero_grad(set_to_none=True)
            _synchronize(devs)
            t0 = time.perf_counter()
            try:
                loss = spanned.train_step(x, target, loss_fn)
            except torch.OutOfMemoryError as exc:  # pragma: no cover - needs a GPU
                raise UsageError(
                    f"out of device memory at step {step}: {_first_line(exc)}; re-plan with a smaller --memory budget "
                    "for that device, more --microbatches or --checkpoint always"
                ) from exc
            value = float(loss)
            _synchronize(devs)
            t1 = time.perf_counter()
            optimizer.step()
            _synchronize(devs)
            optimizer_times.append(time.perf_counter() - t1)
            step_times.append(t1 - t0)
            if not math.isfinite(value):
                raise UsageError(f"the loss became {value} at step {step + 1}; lower --lr (now {args.lr:g})")
            losses.append(value)
            elapsed = time.perf_counter() - t_start
            show_memory = step == 0 or step % 5 == 4 or step == args.steps - 1
            bar.step(loss=value, speed=batch * (step + 1) / elapsed, memory=spanned.memory(optimizer) if show_memory else None)
    seconds = time.perf_counter() - t_start
    return {
        "losses": losses,
        "step_times": step_times,
        "optimizer_times": optimizer_times,
        "seconds": seconds,
        "samples_per_second": batch * args.steps / seconds,
    }


# --------------------------------------------------------------------------- output


def _ratio_text(fig: dict[str, Any]) -> str:
    if fig["ratio"] is not None:
        return f"{fig['ratio']:.2f}"
    return "-" if not fig["measured"] else "n/a (predicted 0)"


def _comparison_table(comparison: dict[str, Any], optimizer_step: float) -> Table:
    from ..accuracy import MEMORY_KINDS
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

    from .. import report

    out.mkdir(parents=True, exist_ok=True)
    plan.save(out / "plan.json")
    files = {"plan": out / "plan.json"}
    files["timeline"] = report.timeline_png(spanned.timeline(), out / "timeline.png", title=f"last step: {report.plan_summary(plan)}")
    files["memory"] = report.memory_png(memory, out / "memory.png", budgets=budgets)
    files["loss"] = report.loss_png(losses, out / "loss.png")
    written = {name: str(path) for name, path in files.items()}
    written["run"] = str(out / "run.json")
    (out / "run.json").write_text(json.dumps({**result, "files": written}, indent=2) + "\n", encoding="utf-8")
    return written


def run(args: argparse.Namespace) -> int:
    import torchspan

    from .. import report
    from ..accuracy import compare, typical_step_time
    from ..hardware import budget_key, parse_memory

    _check_args(args)
    shape = parse_shape(args.input_shape)
    dtype = parse_dtype(args.dtype)
    microbatches = parse_microbatches(args.microbatches) if args.microbatches is not None else "auto"
    memory = parse_memory_options(args.memory)
    argv_hint = f"--input-shape {args.input_shape}" + (f" --dtype {args.dtype}" if args.dtype != "float32" else "")
    plan = notes = None
    if args.plan:
        plan = _load_plan(args.plan, args.target, argv_hint)
        notes = _check_plan_devices(plan, args.plan, args.target, argv_hint)

    model = load_target(args.target)
    floating = dtype.is_floating_point
    if floating:
        model.to(dtype)
    torch.manual_seed(args.seed)
    x = synthetic_batch(shape, dtype, args.vocab)
    target, loss_fn = _targets_and_loss(_probe_output(model, x, args), args.loss)

    out_con = console()
    con = Console(file=sys.stderr, highlight=False) if args.json else out_con
    notes = list(notes or [])
    if plan is not None:
        _check_plan_layers(plan, model, args.plan, args.target, argv_hint)
        if plan.microbatches > shape[0]:
            raise UsageError(
                f"--plan {args.plan} splits each batch into {plan.microbatches} micro-batches, but --input-shape has batch "
                f"{shape[0]}; use a batch of at least {plan.microbatches}, or re-plan for this batch"
            )
        if plan.batch_size is not None and plan.batch_size != shape[0]:
            notes.append(f"the plan was made for batch {plan.batch_size}, this run uses batch {shape[0]}: predictions are for its batch")
    else:
        with con.status("profiling the model and planning ..."):
            plan = _make_plan(model, x, args, memory, microbatches, dtype if floating else None)
        if len(plan.stages) < len(_device_entries(args.devices)) and not args.spread:
            notes.append(
                f"the planner uses {len(plan.stages)} of the {len(_device_entries(args.devices))} devices listed: it predicts "
                "that fastest (entries of one device share its cores and memory); --spread puts a stage on each"
            )
    try:
        spanned = torchspan.span(model, plan)
    except ValueError as exc:
        if args.plan:
            raise UsageError(f"--plan {args.plan}: {_first_line(exc)}") from exc
        raise
    optimizer = OPTIMIZERS[args.optimizer](spanned.parameters(), lr=args.lr)

    n_params = sum(p.numel() for p in model.parameters())
    stages = " | ".join(f"{d}: {', '.join(g)}" for d, g in spanned.stages)
    con.print(f"torchspan run {args.target}: {n_params:,} parameters; batch {args.input_shape} {args.dtype}; {args.optimizer} lr {args.lr:g}; {args.loss} loss")
    con.print(f"plan: {report.plan_summary(plan)}")
    con.print(f"stages: {stages}")
    for note in notes:
        con.print(f"note: {note}")

    trained = _train(spanned, optimizer, x, target, loss_fn, args, con)
    measured_memory = spanned.memory(optimizer)
    comparison = compare(plan, measured_memory, trained["step_times"])
    result: dict[str, Any] = {
        "target": args.target,
        "input_shape": list(shape),
        "dtype": args.dtype,
        "steps": args.steps,
        "optimizer": args.optimizer,
        "lr": args.lr,
        "loss": args.loss,
        "mode": spanned.mode,
        **comparison,
        "optimizer_step_time": typical_step_time(trained["optimizer_times"]),
        "samples_per_second": trained["samples_per_second"],
        "seconds": trained["seconds"],
        "losses": trained["losses"],
        "notes": notes,
        "plan": plan.to_dict(),
    }
    if args.out:
        budgets = {budget_key(dev): parse_memory(size, name=f"--memory {dev}") for dev, size in (memory or {}).items()}
        result["files"] = _write_outputs(Path(args.out), plan, spanned, measured_memory, trained["losses"], budgets, result)
    if args.json:
        print_json(result)
        return 0
    losses = trained["losses"]
    out_con.print(_comparison_table(comparison, result["optimizer_step_time"]))
    out_con.print(
        f"loss {losses[0]:.4g} -> {losses[-1]:.4g} in {args.steps} step(s), {trained['seconds']:.2f} s, "
        f"{trained['samples_per_second']:,.0f} samples/s"
    )
    if args.out:
        out_con.print(f"wrote {', '.join(Path(p).name for p in result['files'].values())} to {args.out}")
    return 0

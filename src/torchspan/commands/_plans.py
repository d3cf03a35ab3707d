"""The plan a command runs: a ``--plan FILE`` checked against this machine and the model, or one made now.

Shared by commands that run a plan (``torchspan run``); every failure is a ``UsageError`` that
names the option and says how to re-create the plan.

Usage: ``plan = load_plan(args.plan, args.target, "--input-shape 32,512")``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ..files import describe
from ..layers import model_layers
from ._common import UsageError

__all__ = [
    "load_plan",
    "check_plan_devices",
    "check_plan_layers",
    "make_plan",
    "device_entries",
    "first_line",
]


def first_line(exc: BaseException) -> str:
    """The first line of an error's text (its type name when empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_plan(path: str, target: str, argv_hint: str) -> Any:
    """The plan in ``path``; a missing or unreadable file is a ``UsageError`` saying how to re-create it."""
    from ..planner import Plan

    out = path if path.endswith(".json") else "plan.json"
    replan = f"re-create it: torchspan plan {target} {argv_hint} --out {out}"
    found = describe(path)
    if found.startswith("missing"):
        raise UsageError(
            f"--plan {path!r} does not exist; write one with torchspan plan {target} {argv_hint} --out {path}"
        )
    if found != "a regular file":
        raise UsageError(
            f"--plan {path!r} is {found}, not a plan file; name the JSON file `torchspan plan --out` "
            f"wrote, or {replan}"
        )
    try:
        return Plan.load(path)
    except (ValueError, TypeError, KeyError) as exc:
        raise UsageError(f"--plan {path} is not a torchspan plan ({first_line(exc)}); {replan}") from exc


def check_plan_devices(plan: Any, path: str, target: str, argv_hint: str) -> list[str]:
    """Raise if a stage's device is absent here; return notes for described (catalog) devices that map to
    local ones."""
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
                f"--plan {path} puts stage {i} on {made_for}, which this machine does not have (visible: "
                f"{visible}); re-plan for this machine: torchspan plan {target} {argv_hint} --devices auto "
                f"--out {path}, or run without --plan and pass --devices"
            ) from None
        if "(described)" in st.device_name:
            notes.append(
                f"stage {i} was planned for a described {st.device_name}; it runs on this machine's "
                f"{st.device}"
            )
    return notes


def check_plan_layers(plan: Any, model: torch.nn.Module, path: str, target: str, argv_hint: str) -> None:
    """Raise unless the plan places exactly the model's layers (``model_layers``: blocks by qualified name;
    the first step's recording checks their execution order)."""
    names = model_layers(model).names()
    if set(plan.layers) != set(names):
        extra = [n for n in plan.layers if n not in names]
        missing = [n for n in names if n not in plan.layers]
        parts = []
        if extra:
            parts.append(f"places layer(s) {', '.join(extra[:5])} the model lacks")
        if missing:
            parts.append(f"does not place its layer(s) {', '.join(missing[:5])}")
        raise UsageError(
            f"--plan {path} was made for another model: it {' and '.join(parts)} ({target} has "
            f"{len(names)} layers); re-create it: torchspan plan {target} {argv_hint} --out {path}"
        )


def device_entries(spec: str | None) -> list[str]:
    """The entries of a ``--devices`` spec: ``"cpu,cpu"`` -> ``["cpu", "cpu"]``."""
    return [d for d in (spec or "").split(",") if d.strip()]


def make_plan(
    model: torch.nn.Module, x: Any, args: argparse.Namespace, memory: Any, microbatches: int | str, dtype: Any
) -> Any:
    """``torchspan.plan`` for the device options; with ``--spread``, the fastest plan using every listed
    device."""
    from ..hardware import devices as find_devices
    from ..planner import plan as plan_now
    from ..planner.spread import spread_plan
    from ..profiler import profile

    devices = args.devices or "auto"
    schedule, recompute = args.schedule or "auto", args.recompute or "auto"
    if not args.spread:
        return plan_now(
            model,
            x,
            devices=devices,
            memory=memory,
            microbatches=microbatches,
            schedule=schedule,
            recompute=recompute,
            optimizer=args.optimizer,
            dtype=dtype,
        )
    devs = find_devices(devices, memory)
    if len(devs) < 2:
        raise UsageError(
            f"--spread needs at least two devices; --devices {devices!r} gives {len(devs)}. Try --devices "
            "cpu,cpu"
        )
    prof = profile(model, x, devs, optimizer=args.optimizer, dtype=dtype)
    wide = spread_plan(prof, microbatches=microbatches, schedule=schedule, recompute=recompute)
    if wide is None:
        raise UsageError(
            f"--spread: no placement with one stage on each of the {len(devs)} devices fits "
            f"(the model has {len(prof.layers)} layers; budgets: --memory); raise the budgets, list fewer "
            "devices, or drop --spread"
        )
    return wide

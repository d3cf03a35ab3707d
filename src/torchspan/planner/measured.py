"""Predicted vs measured: a plan's step time and per-stage memory against what a run measured.

The plan predicts the time of ``train_step`` (forward and backward of every micro-batch; the
optimizer step is not modelled) and, per stage, bytes of parameters, gradients, optimizer state,
saved activations (peak) and buffers. ``spanned.memory(optimizer)`` measures the same kinds.
The plan's transient ``workspace_bytes`` is nothing the runtime meters, so totals leave it out.

Usage::

    times = [...]                                    # seconds of each train_step call
    result = compare(plan, spanned.memory(optimizer), times)
    result["step_time"]["ratio"], result["stages"][0]["activations"]["measured"]
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from ..profiler.costs import MEMORY_KINDS
from .plans import Plan

__all__ = ["PLAN_FIELDS", "compare", "ratio", "typical_step_time"]

# each memory kind (as spanned.memory() spells it) -> the StagePlan field with its prediction
PLAN_FIELDS: dict[str, str] = {
    "params": "param_bytes",
    "grads": "grad_bytes",
    "optimizer": "optimizer_bytes",
    "activations": "activation_bytes",
    "buffers": "buffer_bytes",
}


def ratio(measured: float | None, predicted: float | None) -> float | None:
    """``measured / predicted``; ``None`` when either is missing or the prediction is not positive."""
    if measured is None or predicted is None or predicted <= 0:
        return None
    return measured / predicted


def typical_step_time(times: Sequence[float]) -> float:
    """Median of the steps after the first (the first pays one-time costs); the only step if there is one.

    Usage: ``typical_step_time([0.9, 0.11, 0.1, 0.12]) == 0.11``.
    """
    if not times:
        raise ValueError("times is empty; time at least one step")
    return statistics.median(times[1:]) if len(times) > 1 else times[0]


def _figure(predicted: float | None, measured: float | None) -> dict[str, Any]:
    return {"predicted": predicted, "measured": measured, "ratio": ratio(measured, predicted)}


def compare(plan: Plan, memory: Sequence[Mapping[str, Any]], step_times: Sequence[float]) -> dict[str, Any]:
    """Plan figures next to measured ones, with ``measured / predicted`` ratios.

    ``plan``: the ``torchspan.Plan`` that ran; ``memory``: ``spanned.memory(optimizer)`` (one
    entry per stage, in the plan's stage order); ``step_times``: seconds per ``train_step``.
    Returns ``{"step_time": {...}, "stages": [{"stage", "device", "layers", <kind>: {...}, "total": {...},
    "workspace_predicted"}]}`` where each figure is ``{"predicted", "measured", "ratio"}``.
    """
    if len(memory) != len(plan.stages):
        raise ValueError(
            f"memory has {len(memory)} stage(s) but the plan has {len(plan.stages)}; pass spanned.memory() "
            "of the Spanned built from this plan"
        )
    step = _figure(plan.predicted_step_time, typical_step_time(step_times))
    step["steps_measured"] = max(len(step_times) - 1, 1)
    stages = []
    for i, (sp, ms) in enumerate(zip(plan.stages, memory)):
        entry: dict[str, Any] = {
            "stage": i,
            "device": str(ms.get("device", sp.device)),
            "layers": list(sp.layers),
        }
        total_p = total_m = 0
        for kind in MEMORY_KINDS:
            field_name = PLAN_FIELDS[kind]
            predicted = int(getattr(sp, field_name))
            measured = int(ms.get(kind) or 0)
            entry[kind] = _figure(predicted, measured)
            total_p += predicted
            total_m += measured
        entry["total"] = _figure(total_p, total_m)
        entry["workspace_predicted"] = int(sp.workspace_bytes)
        stages.append(entry)
    return {"step_time": step, "stages": stages}

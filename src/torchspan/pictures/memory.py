"""The memory picture: stacked bars per device or stage by kind, with each budget as a red line.

The kinds are ``MEMORY_KINDS`` of ``torchspan.profiler.costs``, the one vocabulary of profile, plan,
run and pictures; ``normalize_memory`` accepts the slightly different spellings each of them uses.

Usage: ``memory_png(spanned.memory(), "memory.png", budgets={"cuda:0": 8 << 30})``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..hardware import format_bytes
from ..profiler.costs import MEMORY_KINDS
from .canvas import check_path, pyplot, save, unit_for

__all__ = ["memory_png", "normalize_memory", "MEMORY_KINDS", "MEMORY_COLORS"]

MEMORY_COLORS = {
    "params": "#4C78A8",
    "grads": "#F58518",
    "optimizer": "#54A24B",
    "activations": "#E45756",
    "buffers": "#72B7B2",
}
# Accepted spellings of each memory kind (runtime, planner and user dicts differ slightly).
_MEMORY_ALIASES = {
    "params": ("params", "param_bytes", "parameters", "param", "parameter_bytes", "weights"),
    "grads": ("grads", "grad_bytes", "gradients", "grad", "gradient_bytes"),
    "optimizer": ("optimizer", "optimizer_bytes", "optim", "optimizer_state", "opt"),
    "activations": (
        "activations",
        "activation_bytes",
        "peak_activations",
        "peak_activation_bytes",
        "activation",
        "acts",
    ),
    "buffers": ("buffers", "buffer_bytes", "buffer"),
}


def _as_mapping(obj: Any) -> Mapping[str, Any]:
    if isinstance(obj, Mapping):
        return obj
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(obj)
    return vars(obj)


def _kind_bytes(entry: Mapping[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    lowered = {str(k).lower(): v for k, v in entry.items()}
    for kind in MEMORY_KINDS:
        aliases = _MEMORY_ALIASES[kind]
        for alias in aliases:
            value = lowered.get(alias)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if value < 0 or not math.isfinite(value):
                    raise ValueError(f"memory {kind}={value!r} is not a byte count >= 0")
                out[kind] = int(value)
                break
        else:
            out[kind] = 0
    return out


def _label(entry: Mapping[str, Any], fallback: str) -> str:
    stage, device = entry.get("stage"), entry.get("device")
    if stage is not None and device is not None:
        return f"stage {stage}\n{device}"
    if device is not None:
        return str(device)
    if stage is not None:
        return f"stage {stage}"
    return fallback


def normalize_memory(memory: Any) -> dict[str, dict[str, int]]:
    """Memory figures as ``{label: {"params", "grads", "optimizer", "activations": bytes}}``.

    Accepts ``{label: {kind: bytes}}`` (kinds may be spelled ``param_bytes``, ``peak_activations``…),
    a list of per-stage dicts/dataclasses carrying ``stage``/``device`` and byte fields, or an object
    with ``to_dict()`` returning either. Usage: ``normalize_memory(spanned.memory())``.
    """
    if memory is None:
        raise ValueError("memory=None; pass spanned.memory() or {'cpu': {'params': 1024, ...}}")
    if hasattr(memory, "to_dict") and not isinstance(memory, Mapping):
        memory = memory.to_dict()
    rows: dict[str, dict[str, int]] = {}
    if isinstance(memory, Mapping):
        for inner in ("stages", "per_stage", "devices", "per_device"):
            if inner in memory and not isinstance(memory[inner], (int, float)):
                return normalize_memory(memory[inner])
        numeric = [k for k, v in memory.items() if isinstance(v, (int, float))]
        if len(numeric) == len(memory):
            rows["device"] = _kind_bytes(memory)
        elif numeric:
            raise ValueError(
                f"memory mixes numbers and tables under keys {sorted(map(str, memory))}; "
                "pass {label: {kind: bytes}} or a list of per-stage entries"
            )
        else:
            for key, value in memory.items():
                rows[str(key)] = _kind_bytes(_as_mapping(value))
    elif isinstance(memory, Sequence) and not isinstance(memory, (str, bytes)):
        for i, item in enumerate(memory):
            entry = _as_mapping(item)
            rows[_label(entry, f"#{i}")] = _kind_bytes(entry)
    else:
        raise ValueError(
            f"memory={memory!r} ({type(memory).__name__}) is not a table of bytes; pass spanned.memory()"
        )
    if not rows:
        raise ValueError("memory is empty; pass at least one device or stage")
    return rows


def _budget_for(label: str, budgets: Mapping[str, int] | None) -> int | None:
    if not budgets:
        return None
    if label in budgets:
        return budgets[label]
    device = label.split("\n")[-1]
    return budgets.get(device)


def memory_png(
    memory: Any,
    path: str | os.PathLike[str],
    *,
    budgets: Mapping[str, int | None] | None = None,
    title: str | None = None,
    dpi: int = 110,
) -> Path:
    """Stacked bars of memory per device/stage by kind (params, grads, optimizer, activations).

    ``budgets`` maps a device (``"cpu"``, ``"cuda:0"``) or a label to bytes; each budget shows as a
    red line over its bar. Usage: ``memory_png(spanned.memory(), "memory.png", budgets={"cuda:0": 8 << 30})``.
    """
    rows = normalize_memory(memory)
    clean_budgets = {k: int(v) for k, v in (budgets or {}).items() if v is not None}
    check_path(path)  # before drawing: a folder or device at path is refused
    plt = pyplot()
    labels = list(rows)
    totals = [sum(rows[label].values()) for label in labels]
    limits = [_budget_for(label, clean_budgets) for label in labels]
    top = max([*totals, *(b for b in limits if b is not None), 1])
    unit, scale = unit_for(top)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(labels) + 2), 4))
    bottom = [0.0] * len(labels)
    for kind in MEMORY_KINDS:
        vals = [rows[label][kind] / scale for label in labels]
        ax.bar(range(len(labels)), vals, bottom=bottom, color=MEMORY_COLORS[kind], label=kind, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, (total, limit) in enumerate(zip(totals, limits)):
        ax.text(
            i,
            total / scale,
            format_bytes(total),
            ha="center",
            va="top" if limit is not None and abs(limit - total) < top * 0.06 else "bottom",
            fontsize=8,
        )
        if limit is not None:
            ax.hlines(limit / scale, i - 0.4, i + 0.4, colors="#D62728", linestyles="--", linewidth=1.5)
            ax.text(
                i,
                limit / scale,
                f"budget {format_bytes(limit)}",
                color="#D62728",
                fontsize=7,
                ha="center",
                va="bottom",
            )
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(0, top / scale * 1.3)
    ax.legend(fontsize=8, frameon=False, loc="upper left", ncol=2)
    ax.set_title(title or "memory per device (params, grads, optimizer state, peak activations)", fontsize=10)
    ax.grid(axis="y", alpha=0.25)
    return save(fig, path, dpi)

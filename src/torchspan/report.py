"""Pictures of what happened: pipeline timeline, memory per device, loss curve, and a report page.

Usage::

    from torchspan import report
    report.timeline_png(spanned.timeline(), "timeline.png")
    report.memory_png(spanned.memory(), "memory.png", budgets={"cpu": 2**30})
    report.loss_png(losses, "loss.png")
    report.write_report("out/", plan=plan, devices=devs, events=spanned.timeline(),
                        memory=spanned.memory(), losses=losses)

Everything draws with matplotlib's non-interactive Agg backend, so it works on headless machines.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .hardware import format_bytes
from .runtime.record import KINDS, Event

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from .hardware import Device
    from .planner.plans import Plan

__all__ = [
    "timeline_png",
    "memory_png",
    "loss_png",
    "write_report",
    "timeline_problems",
    "normalize_memory",
    "MEMORY_KINDS",
    "ReportFiles",
    "plan_rows",
    "plan_summary",
    "device_rows",
    "PLAN_COLUMNS",
    "DEVICE_COLUMNS",
]

COLORS = {
    "forward": "#4C78A8",
    "backward": "#F58518",
    "transfer": "#9D9D9D",
    "recompute": "#B279A2",
}
MEMORY_KINDS = ("params", "grads", "optimizer", "activations")
MEMORY_COLORS = {"params": "#4C78A8", "grads": "#F58518", "optimizer": "#54A24B", "activations": "#E45756"}
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
}
_COMPUTE = ("forward", "backward", "recompute")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Figure, path: str | os.PathLike[str], dpi: int) -> Path:
    out = Path(path)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, bbox_inches="tight")
    _pyplot().close(fig)
    return out


# --------------------------------------------------------------------------- timeline


def _check_events(events: Iterable[Event], name: str = "events") -> list[Event]:
    out = list(events)
    for i, e in enumerate(out):
        if not isinstance(e, Event):
            raise ValueError(
                f"{name}[{i}] is {type(e).__name__}, not a torchspan.timeline.Event; "
                "pass spanned.timeline() (or Event objects you built)"
            )
        if e.kind not in KINDS:
            raise ValueError(f"{name}[{i}].kind={e.kind!r} is not one of {', '.join(KINDS)}")
        if not (math.isfinite(e.start) and math.isfinite(e.end)) or e.end < e.start:
            raise ValueError(f"{name}[{i}] has start={e.start!r}, end={e.end!r}; an event needs finite start <= end")
    return out


def _lanes(events: Sequence[Event]) -> list[tuple[int, str]]:
    """Lanes in stage order: one per (stage, device) pair that appears."""
    return sorted({(e.stage, e.device) for e in events})


def _select_step(events: Sequence[Event], step: int | None) -> list[Event]:
    if not events:
        return []
    steps = sorted({e.step for e in events})
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ValueError(f"step={step!r} has no events; the timeline holds steps {steps}")
    return [e for e in events if e.step == step]


def timeline_problems(events: Iterable[Event], *, tolerance: float = 1e-6) -> list[str]:
    """Consistency problems in a recorded timeline (an empty list means it is consistent).

    Checks, per step: compute blocks (forward/backward/recompute) of one lane never overlap;
    every micro-batch that has a backward in a stage ran its forward there first; a stage never
    starts a micro-batch's forward before the previous stage finished that micro-batch's forward.

    Usage: ``assert not report.timeline_problems(spanned.timeline())``.
    """
    evs = _check_events(events)
    problems: list[str] = []
    by_step: dict[int, list[Event]] = {}
    for e in evs:
        by_step.setdefault(e.step, []).append(e)
    for step, step_events in sorted(by_step.items()):
        for lane in _lanes(step_events):
            blocks = sorted((e for e in step_events if (e.stage, e.device) == lane and e.kind in _COMPUTE), key=lambda e: e.start)
            for a, b in zip(blocks, blocks[1:]):
                if b.start < a.end - tolerance:
                    problems.append(
                        f"step {step}, stage {lane[0]} on {lane[1]}: {a.kind} of micro-batch {a.microbatch} "
                        f"({a.start:.6f}-{a.end:.6f}s) overlaps {b.kind} of micro-batch {b.microbatch} "
                        f"({b.start:.6f}-{b.end:.6f}s)"
                    )
        firsts: dict[tuple[int, int, str], Event] = {}
        for e in sorted(step_events, key=lambda e: e.start):
            firsts.setdefault((e.stage, e.microbatch, e.kind), e)
        for (stage, mb, kind), e in firsts.items():
            if kind == "backward":
                fwd = firsts.get((stage, mb, "forward"))
                if fwd is None:
                    problems.append(f"step {step}, stage {stage}: micro-batch {mb} has a backward but no forward")
                elif e.start < fwd.end - tolerance:
                    problems.append(
                        f"step {step}, stage {stage}: backward of micro-batch {mb} starts at {e.start:.6f}s, "
                        f"before its forward ends at {fwd.end:.6f}s"
                    )
            if kind == "forward" and stage > 0:
                prev = firsts.get((stage - 1, mb, "forward"))
                if prev is not None and e.start < prev.end - tolerance:
                    problems.append(
                        f"step {step}, stage {stage}: forward of micro-batch {mb} starts at {e.start:.6f}s, "
                        f"before stage {stage - 1} finished it at {prev.end:.6f}s"
                    )
    return problems


def timeline_png(
    events: Iterable[Event],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    title: str | None = None,
    label_microbatches: bool = True,
    dpi: int = 110,
) -> Path:
    """Draw one step of a pipeline timeline: a lane per stage/device, a block per event.

    Forward, backward and recompute blocks fill the lane; transfers are thin grey bars at the
    lane's foot (on GPUs they overlap compute). ``step=None`` draws the last recorded step.
    Usage: ``timeline_png(spanned.timeline(), "timeline.png", title="1F1B, 2 stages")``.
    """
    evs = _select_step(_check_events(events), step)
    if not evs:
        raise ValueError("events is empty; run at least one spanned.train_step() before drawing its timeline")
    plt = _pyplot()
    from matplotlib.patches import Patch

    lanes = _lanes(evs)
    row = {lane: i for i, lane in enumerate(lanes)}
    t0 = min(e.start for e in evs)
    span_ms = max((max(e.end for e in evs) - t0) * 1e3, 1e-6)
    fig, ax = plt.subplots(figsize=(10, 0.8 + 0.75 * len(lanes)))
    for e in evs:
        y = row[(e.stage, e.device)]
        x = (e.start - t0) * 1e3
        w = max(e.duration * 1e3, span_ms * 1e-3)
        if e.kind == "transfer":
            ax.broken_barh([(x, w)], (y + 0.28, 0.14), facecolors=COLORS["transfer"], edgecolor="none")
            continue
        hatch = "//" if e.kind == "recompute" else None
        ax.broken_barh([(x, w)], (y - 0.36, 0.64), facecolors=COLORS[e.kind], edgecolor="white", linewidth=0.6, hatch=hatch)
        if label_microbatches and w > span_ms * 0.018:
            ax.text(x + w / 2, y - 0.04, str(e.microbatch), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"stage {s}\n{d}" for s, d in lanes])
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time within the step (ms)")
    ax.grid(axis="x", alpha=0.25)
    kinds = [k for k in KINDS if any(e.kind == k for e in evs)]
    ax.legend(
        handles=[Patch(facecolor=COLORS[k], label=k, hatch="//" if k == "recompute" else None) for k in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 if len(lanes) < 3 else -0.2),
        ncol=len(kinds),
        frameon=False,
        fontsize=8,
    )
    mbs = len({e.microbatch for e in evs})
    ax.set_title(title or f"pipeline timeline, step {evs[0].step} ({len(lanes)} lane(s), {mbs} micro-batch(es); numbers are micro-batches)", fontsize=10)
    return _save(fig, path, dpi)


# --------------------------------------------------------------------------- memory


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
    for kind, aliases in _MEMORY_ALIASES.items():
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
        raise ValueError(f"memory={memory!r} ({type(memory).__name__}) is not a table of bytes; pass spanned.memory()")
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
    plt = _pyplot()
    labels = list(rows)
    totals = [sum(rows[label].values()) for label in labels]
    limits = [_budget_for(label, clean_budgets) for label in labels]
    top = max([*totals, *(b for b in limits if b is not None), 1])
    unit, scale = _unit_for(top)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(labels) + 2), 4))
    bottom = [0.0] * len(labels)
    for kind in MEMORY_KINDS:
        vals = [rows[label][kind] / scale for label in labels]
        ax.bar(range(len(labels)), vals, bottom=bottom, color=MEMORY_COLORS[kind], label=kind, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, (total, limit) in enumerate(zip(totals, limits)):
        ax.text(i, total / scale, format_bytes(total), ha="center", va="top" if limit is not None and abs(limit - total) < top * 0.06 else "bottom", fontsize=8)
        if limit is not None:
            ax.hlines(limit / scale, i - 0.4, i + 0.4, colors="#D62728", linestyles="--", linewidth=1.5)
            ax.text(i, limit / scale, f"budget {format_bytes(limit)}", color="#D62728", fontsize=7, ha="center", va="bottom")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(0, top / scale * 1.3)
    ax.legend(fontsize=8, frameon=False, loc="upper left", ncol=2)
    ax.set_title(title or "memory per device (params, grads, optimizer state, peak activations)", fontsize=10)
    ax.grid(axis="y", alpha=0.25)
    return _save(fig, path, dpi)


def _unit_for(nbytes: float) -> tuple[str, float]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return unit, float(scale)
    return "B", 1.0


# --------------------------------------------------------------------------- loss


def loss_png(
    losses: Sequence[float],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    smoothing: float = 0.9,
    dpi: int = 110,
) -> Path:
    """Loss per step with an exponential moving average over it.

    Usage: ``loss_png([4.2, 3.9, 3.1], "loss.png")``. ``smoothing`` in [0, 1): 0 draws no average.
    """
    values = [float(v) for v in losses]
    if not values:
        raise ValueError("losses is empty; record at least one loss value per training step")
    if any(not math.isfinite(v) for v in values):
        bad = next(i for i, v in enumerate(values) if not math.isfinite(v))
        raise ValueError(f"losses[{bad}]={values[bad]!r} is not finite; training diverged, lower the learning rate")
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing={smoothing!r} must be in [0, 1)")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    steps = range(1, len(values) + 1)
    ax.plot(steps, values, color="#4C78A8", alpha=0.35 if smoothing else 1.0, linewidth=1, label="loss")
    if smoothing and len(values) > 2:
        ema, acc = [], values[0]
        for v in values:
            acc = smoothing * acc + (1 - smoothing) * v
            ema.append(acc)
        ax.plot(steps, ema, color="#4C78A8", linewidth=2, label="moving average")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.25)
    ax.legend(frameon=False, fontsize=8)
    ax.set_title(title or f"training loss: {values[0]:.3f} -> {values[-1]:.3f}", fontsize=10)
    return _save(fig, path, dpi)


# --------------------------------------------------------------------------- report page


@dataclass
class ReportFiles:
    """Paths written by :func:`write_report` (``None`` where the input was not given)."""

    report: Path
    timeline: Path | None = None
    memory: Path | None = None
    loss: Path | None = None
    extra: dict[str, Path] = field(default_factory=dict)


def _md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    def cell(v: str) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines.extend("| " + " | ".join(cell(c) for c in r) + " |" for r in rows)
    return lines


PLAN_COLUMNS = ("stage", "device", "layers", "params", "grads", "optim", "activ.", "fwd ms", "bwd ms")
DEVICE_COLUMNS = ("device", "name", "total", "free", "budget")


def plan_summary(plan: Plan) -> str:
    """One line: stages, micro-batches, schedule, checkpointing and predicted step time."""
    head = (
        f"{len(plan.stages)} stage(s), {plan.microbatches} micro-batch(es), schedule {plan.schedule}, "
        f"checkpoint {plan.checkpoint}"
    )
    if plan.predicted_step_time is not None:
        head += f", predicted step {plan.predicted_step_time * 1e3:.1f} ms"
    return head


def plan_rows(plan: Plan) -> list[tuple[str, ...]]:
    """One row of text per stage, in ``PLAN_COLUMNS`` order (for Markdown and rich tables)."""
    rows = []
    for i, s in enumerate(plan.stages):
        names = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]} ({len(s.layers)})"
        rows.append(
            (
                str(i),
                s.device,
                names,
                format_bytes(s.param_bytes),
                format_bytes(s.grad_bytes),
                format_bytes(s.optimizer_bytes),
                format_bytes(s.activation_bytes),
                f"{s.forward_time * 1e3:.2f}",
                f"{s.backward_time * 1e3:.2f}",
            )
        )
    return rows


def device_rows(devs: Sequence[Device]) -> list[tuple[str, ...]]:
    """One row of text per device, in ``DEVICE_COLUMNS`` order."""
    return [
        (str(d.device), d.name, format_bytes(d.total_memory), format_bytes(d.free_memory), format_bytes(d.budget))
        for d in devs
    ]


def _plan_section(plan: Plan) -> list[str]:
    lines = ["## Plan", "", plan_summary(plan), ""]
    lines += _md_table(PLAN_COLUMNS, plan_rows(plan))
    lines += [f"- note: {n}" for n in plan.notes]
    return lines + [""]


def _devices_section(devs: Sequence[Device]) -> list[str]:
    return ["## Devices", "", *_md_table(DEVICE_COLUMNS, device_rows(devs)), ""]


def write_report(
    out_dir: str | os.PathLike[str],
    *,
    title: str = "torchspan run",
    plan: Plan | None = None,
    devices: Sequence[Device] | None = None,
    events: Iterable[Event] | None = None,
    memory: Any = None,
    losses: Sequence[float] | None = None,
    budgets: Mapping[str, int | None] | None = None,
    summary: Mapping[str, Any] | None = None,
    sample: str | None = None,
) -> ReportFiles:
    """Write the pictures and ``report.md`` (pictures, plan table, device table) into ``out_dir``.

    Each picture is drawn when its input is given: ``events`` → ``timeline.png``, ``memory`` →
    ``memory.png``, ``losses`` → ``loss.png``. ``summary`` adds a key/value table; ``sample`` a
    text block. Usage: ``write_report("torchspan-demo", plan=plan, events=spanned.timeline(), losses=losses)``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = ReportFiles(report=out / "report.md")
    if losses is not None:
        files.loss = loss_png(losses, out / "loss.png")
    if events is not None:
        files.timeline = timeline_png(events, out / "timeline.png")
    if memory is not None:
        files.memory = memory_png(memory, out / "memory.png", budgets=budgets)

    lines = [f"# {title}", ""]
    if summary:
        lines += _md_table(("", ""), ((str(k), str(v)) for k, v in summary.items())) + [""]
    if files.loss:
        lines += ["## Loss", "", f"![loss curve]({files.loss.name})", ""]
    if files.timeline:
        lines += [
            "## Pipeline timeline (last step)",
            "",
            "One lane per stage and device; blue forward, orange backward, grey transfer, hatched recompute; "
            "numbers are micro-batches.",
            "",
            f"![pipeline timeline]({files.timeline.name})",
            "",
        ]
    if files.memory:
        lines += ["## Memory per device", "", f"![memory per device]({files.memory.name})", ""]
    if plan is not None:
        lines += _plan_section(plan)
    if devices:
        lines += _devices_section(devices)
    if sample is not None:
        fence = "```"
        while fence in sample:
            fence += "`"
        lines += ["## Sample", "", fence + "text", sample, fence, ""]
    files.report.write_text("\n".join(lines), encoding="utf-8")
    return files

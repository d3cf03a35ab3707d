"""What the demo says about what it ran and why: one list of plain lines for the console and ``report.md``.

Usage: ``lines = why_lines(setup, placement)``; ``check_lines(check, one, span_ms)``;
``next_lines(placement)``; ``guide_line()`` (``guide_line(processes=2)`` for the data-parallel demo), the
closing line naming the guide.
"""

from __future__ import annotations

from ..planner.plans import Plan
from .placement import Placement, ms
from .spanning import DemoDevices, GradientCheck, OneDevice

__all__ = ["describe", "why_lines", "check_lines", "next_lines", "spans", "guide", "guide_line", "GUIDES"]

# The guide in torchspan's repository that explains what each demo showed.
GUIDES = {"one process": "docs/one-process.md", "processes": "docs/processes.md"}


def spans(plan: Plan) -> bool:
    """Whether ``plan`` splits anything: several stages, or several micro-batches."""
    return len(plan.stages) > 1 or plan.microbatches > 1


def describe(plan: Plan) -> str:
    """``2-stage pipeline over cpu, cpu (4 micro-batches, 1f1b)`` or ``one stage on cpu (1 micro-batch)``."""
    where = ", ".join(s.device for s in plan.stages)
    mbs = f"{plan.microbatches} micro-batch{'es' if plan.microbatches > 1 else ''}"
    if len(plan.stages) == 1:
        return f"one stage on {where} ({mbs})"
    return f"{len(plan.stages)}-stage pipeline over {where} ({mbs}, {plan.schedule})"


def _machine(setup: DemoDevices) -> str:
    kinds = ", ".join(f"{d.device} ({d.name})" for d in setup.found)
    return f"This machine: {kinds}" + ("." if setup.has_accelerator else ", no GPU.")


def why_lines(setup: DemoDevices, placement: Placement) -> list[str]:
    """Which devices, what ``torchspan.plan`` chose there, what the demo ran instead and why."""
    chosen, plan = placement.chosen, placement.plan
    lines = [f"{_machine(setup)} The demo plans over {setup.reason}."]
    alone = f"torchspan.plan chose {describe(chosen)}, predicted {ms(chosen)} per step"
    if not placement.spread:
        lines.append(f"{alone}: the demo ran that.")
        if not spans(plan):
            lines.append(
                "Nothing was spanned: one stage with one micro-batch is plain PyTorch. "
                "Run `torchspan demo` (two stages even on a CPU-only machine) or `torchspan demo --devices "
                "cpu,cpu` to see a span."
            )
        return lines
    shared = len({str(d.device) for d in setup.used}) < len(setup.used)
    if shared and len(chosen.stages) == 1:
        alone += (
            ": stages on one device share its cores, so one stage is fastest and nothing would be spanned"
        )
    lines.append(alone + ".")
    lines.append(
        f"To show what torchspan does, the demo ran a {describe(plan)} instead (predicted {ms(plan)} per "
        "step): the model split into stages, micro-batches flowing through them, and one device's "
        "gradients (checked below)."
        + (
            " Stages on the same cores take turns, so here it cannot be faster than one device; on "
            "separate devices they overlap."
            if shared
            else ""
        )
    )
    return lines


def check_lines(
    check: GradientCheck | None, one: OneDevice | None, span_losses: list[float], span_ms: float
) -> list[str]:
    """The exact-gradient check and plain PyTorch on one device beside the span."""
    lines = [] if check is None else [check.line()]
    if one is not None and one.losses:
        n = min(len(one.losses), len(span_losses))
        lines.append(
            f"plain PyTorch on {one.device} beside it, from the same weights on the same batches: the "
            f"first {n} losses differ by at most {one.largest_difference(span_losses):.3e}; "
            f"{one.ms_per_step:.1f} ms per step on one device, {span_ms:.1f} ms per step spanned."
        )
    return lines


def next_lines(placement: Placement) -> list[str]:
    """Commands to run next, each after a comment saying what it shows."""
    devices = [s.device for s in placement.plan.stages]
    more = ["cpu"] * 3 if set(devices) == {"cpu"} else [*devices, "cpu"]
    return [
        f"# {len(more)} stages, GPipe: every forward before the backwards",
        f"torchspan demo --devices {','.join(more)} --schedule gpipe",
        "# data parallel: 2 processes, one exact replica each",
        "torchspan demo --nproc-per-node 2",
        "# every strategy's gradients against one device, for a model of examples/models.py",
        "torchspan verify examples/models.py:mlp --input-shape 7,1024 --strategies "
        "single,local-pipeline,dp,rank-pipeline --nproc-per-node 2",
    ]


def guide(processes: int = 1, tp: int | None = None) -> str:
    """The guide that explains what the demo just showed (one process, or ``processes`` of them, tensor
    parallel with ``tp``), and what it covers."""
    if tp:
        return (
            f"{GUIDES['processes']} in torchspan's repository, its tensor-parallel section (each layer "
            "split over processes: tp_plan=, sharded replicas beside it, sequence parallel, plans that "
            "choose it)."
        )
    if processes > 1:
        return (
            f"{GUIDES['processes']} in torchspan's repository (data parallel over processes: launching, "
            "exact replicas, each rank's rows, checkpoints)."
        )
    return (
        f"{GUIDES['one process']} in torchspan's repository (a model spanned in one process: stages, "
        "micro-batches, schedules, the exact-gradient check)."
    )


def guide_line(processes: int = 1, tp: int | None = None) -> str:
    """The demo's closing line: ``What you saw: docs/one-process.md ...``."""
    return f"What you saw: {guide(processes, tp)}"

"""Recorded timelines checked: every item an ``Event`` of a known kind, and a step consistent in itself.

Usage: ``assert not timeline_problems(spanned.timeline())``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from ..runtime.record import KINDS, Event

__all__ = ["check_events", "select_step", "lanes", "timeline_problems", "COMPUTE_KINDS"]

COMPUTE_KINDS = ("forward", "backward", "recompute", "backward_weight")


def check_events(events: Iterable[Event], name: str = "events") -> list[Event]:
    """``events`` as a list, each checked: an ``Event`` with a kind of ``KINDS`` and finite ``start <=
    end``."""
    out = list(events)
    for i, e in enumerate(out):
        if not isinstance(e, Event):
            raise ValueError(
                f"{name}[{i}] is {type(e).__name__}, not a torchspan.runtime.record.Event; "
                "pass spanned.timeline() (or Event objects you built)"
            )
        if e.kind not in KINDS:
            raise ValueError(f"{name}[{i}].kind={e.kind!r} is not one of {', '.join(KINDS)}")
        if not (math.isfinite(e.start) and math.isfinite(e.end)) or e.end < e.start:
            raise ValueError(
                f"{name}[{i}] has start={e.start!r}, end={e.end!r}; an event needs finite start <= end"
            )
    return out


def lanes(events: Sequence[Event]) -> list[tuple[int, str]]:
    """Lanes in stage order: one per (stage, device) pair that appears."""
    return sorted({(e.stage, e.device) for e in events})


def select_step(events: Sequence[Event], step: int | None) -> list[Event]:
    """The events of ``step`` (the last recorded one when None)."""
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
    evs = check_events(events)
    problems: list[str] = []
    by_step: dict[int, list[Event]] = {}
    for e in evs:
        by_step.setdefault(e.step, []).append(e)
    for step, step_events in sorted(by_step.items()):
        for lane in lanes(step_events):
            blocks = sorted(
                (e for e in step_events if (e.stage, e.device) == lane and e.kind in COMPUTE_KINDS),
                key=lambda e: e.start,
            )
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
                    problems.append(
                        f"step {step}, stage {stage}: micro-batch {mb} has a backward but no forward"
                    )
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

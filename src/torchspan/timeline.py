"""Timeline events: what ran where and when, recorded by the runtime on every step.

Usage: ``events = spanned.timeline()``; ``torchspan.report.timeline_png(events, "t.png")``.
Times are seconds from the start of the step (``time.perf_counter`` based; on CUDA the runtime
records after the work is known complete so the blocks are real).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Event", "KINDS"]

KINDS = ("forward", "backward", "transfer", "recompute")


@dataclass(frozen=True)
class Event:
    """One block of work: ``kind`` of micro-batch ``microbatch`` in ``stage`` on ``device``."""

    step: int
    stage: int
    device: str
    microbatch: int
    kind: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

"""The pipeline timeline picture: one lane per stage and device, one block per event of a step.

Usage: ``timeline_png(spanned.timeline(), "timeline.png", title="1F1B, 2 stages")``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ..runtime.record import KINDS, Event
from .canvas import check_path, pyplot, save
from .events import check_events, select_step
from .events import lanes as lanes_of

__all__ = ["timeline_png", "COLORS"]

COLORS = {
    "forward": "#4C78A8",
    "backward": "#F58518",
    "transfer": "#9D9D9D",
    "recompute": "#B279A2",
    "backward_weight": "#E45756",  # zero-bubble: the weights' gradients, run later
}


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

    Forward, backward, weight-gradient (zero-bubble) and recompute blocks fill the lane; transfers are thin
    grey bars at the lane's foot (on GPUs they overlap compute). ``step=None`` draws the last recorded step.
    Usage: ``timeline_png(spanned.timeline(), "timeline.png", title="1F1B, 2 stages")``.
    """
    evs = select_step(check_events(events), step)
    if not evs:
        raise ValueError("events is empty; run at least one spanned.train_step() before drawing its timeline")
    check_path(path)  # before drawing: a folder or device at path is refused
    plt = pyplot()
    from matplotlib.patches import Patch

    lanes = lanes_of(evs)
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
        ax.broken_barh(
            [(x, w)],
            (y - 0.36, 0.64),
            facecolors=COLORS[e.kind],
            edgecolor="white",
            linewidth=0.6,
            hatch=hatch,
        )
        if label_microbatches and w > span_ms * 0.018:
            ax.text(
                x + w / 2, y - 0.04, str(e.microbatch), ha="center", va="center", fontsize=7, color="white"
            )
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"stage {s}\n{d}" for s, d in lanes])
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time within the step (ms)")
    ax.grid(axis="x", alpha=0.25)
    kinds = [k for k in KINDS if any(e.kind == k for e in evs)]
    ax.legend(
        handles=[
            Patch(facecolor=COLORS[k], label=k, hatch="//" if k == "recompute" else None) for k in kinds
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 if len(lanes) < 3 else -0.2),
        ncol=len(kinds),
        frameon=False,
        fontsize=8,
    )
    mbs = len({e.microbatch for e in evs})
    ax.set_title(
        title
        or f"pipeline timeline, step {evs[0].step} ({len(lanes)} lane(s), {mbs} micro-batch(es); numbers "
        "are micro-batches)",
        fontsize=10,
    )
    return save(fig, path, dpi)

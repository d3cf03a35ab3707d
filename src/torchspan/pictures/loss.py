"""The loss picture: loss per step with an exponential moving average over it.

Usage: ``loss_png([4.2, 3.9, 3.1], "loss.png")``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from .canvas import check_path, pyplot, save

__all__ = ["loss_png"]


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
        raise ValueError(
            f"losses[{bad}]={values[bad]!r} is not finite; training diverged, lower the learning rate"
        )
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing={smoothing!r} must be in [0, 1)")
    check_path(path)  # before drawing: a folder or device at path is refused
    plt = pyplot()
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
    return save(fig, path, dpi)

"""The matplotlib side shared by the pictures: the headless Agg backend, saving, byte units.

Usage: ``plt = pyplot(); fig, ax = plt.subplots(); save(fig, "out/x.png", dpi=110)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["pyplot", "save", "unit_for"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (works on headless machines)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save(fig: Figure, path: str | os.PathLike[str], dpi: int) -> Path:
    """Write ``fig`` to ``path`` (creating its folder) and close it."""
    out = Path(path)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, bbox_inches="tight")
    pyplot().close(fig)
    return out


def unit_for(nbytes: float) -> tuple[str, float]:
    """The largest binary unit not above ``nbytes``: ``("MiB", 2**20)`` for 5 MiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return unit, float(scale)
    return "B", 1.0

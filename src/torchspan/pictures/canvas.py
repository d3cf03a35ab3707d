"""The matplotlib side shared by the pictures: the headless Agg backend, saving, byte units.

Usage: ``plt = pyplot(); fig, ax = plt.subplots(); save(fig, "out/x.png", dpi=110)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..files import atomic_open, output_file

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["check_path", "pyplot", "save", "unit_for"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (works on headless machines)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def check_path(path: str | os.PathLike[str]) -> None:
    """Refuse ``path`` before drawing when a picture cannot be written there
    (``torchspan.files.output_file``); a missing folder is created."""
    output_file(path, name="path", make_parent=True, example="picture.png")


def save(fig: Figure, path: str | os.PathLike[str], dpi: int) -> Path:
    """Write ``fig`` to ``path`` atomically (``torchspan.files``: into a link's target; a folder or device
    there is refused), creating its folder, and close it. The format follows the suffix (``.png`` when there
    is none)."""
    out = Path(path)
    try:
        with atomic_open(out, "wb", name="path", make_parent=True) as fh:
            fig.savefig(fh, format=out.suffix.lstrip(".").lower() or "png", dpi=dpi, bbox_inches="tight")
    finally:
        pyplot().close(fig)
    return out


def unit_for(nbytes: float) -> tuple[str, float]:
    """The largest binary unit not above ``nbytes``: ``("MiB", 2**20)`` for 5 MiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return unit, float(scale)
    return "B", 1.0

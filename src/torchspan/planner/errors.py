"""``PlanError``: no placement fits the memory budgets.

Usage::

    try:
        plan = torchspan.plan(model, x, devices="cuda:0", memory={"cuda:0": "2GiB"})
    except torchspan.PlanError as err:
        print(err)              # needed vs available per device, and what would make it fit
        err.needed, err.available, err.suggestions
"""

from __future__ import annotations

__all__ = ["PlanError"]


class PlanError(ValueError):
    """No plan fits. ``needed``/``available`` map device → bytes; ``suggestions`` are fixes with numbers."""

    def __init__(
        self,
        message: str,
        *,
        needed: dict[str, int] | None = None,
        available: dict[str, int | None] | None = None,
        suggestions: list[str] | None = None,
    ) -> None:
        self.needed = dict(needed or {})
        self.available = dict(available or {})
        self.suggestions = list(suggestions or [])
        text = message
        if self.suggestions:
            text += "\nWhat would make it fit:\n" + "\n".join(f"  - {s}" for s in self.suggestions)
        super().__init__(text)

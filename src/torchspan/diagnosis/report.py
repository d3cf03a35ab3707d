"""Findings and reports: what the doctor found, how bad it is, and how to fix it.

Usage::

    report = torchspan.doctor(model, x, target=y, loss_fn=criterion)
    if not report.ok:
        print(report)                 # plain text
    report.to_dict()                  # JSON-ready
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TensorArg", "Finding", "Report", "SEVERITIES", "name_list"]

SEVERITIES = ("error", "warning", "info")
_SHOW = 6  # names listed per group before "+N more"


def name_list(items: list[str]) -> str:
    """``a, b, c, d, e, f (+2 more)``: the first few names of a finding's detail line."""
    more = f" (+{len(items) - _SHOW} more)" if len(items) > _SHOW else ""
    return ", ".join(items[:_SHOW]) + more


@dataclass
class TensorArg:
    """One tensor taking part in a device disagreement.

    ``label`` is the argument name (``"input"``, ``"weight"``, ``"tensors[1]"``); ``kind`` is one of
    ``parameter``, ``buffer``, ``attribute`` (a plain tensor attribute of a module), ``unregistered
    parameter`` (such an attribute that requires grad: `nn.Parameter(t).cuda()`), ``optimizer
    state``, ``activation``, ``variable``, ``gradient``, ``tensor``; ``name`` is the qualified name
    (``model.net2.weight``) or variable name; ``origin`` says where an activation came from.
    """

    label: str
    device: str
    shape: tuple[int, ...]
    dtype: str
    kind: str = "tensor"
    name: str | None = None
    origin: str | None = None
    odd: bool = False

    @property
    def what(self) -> str:
        """``"parameter model.net2.weight"``: kind, qualified name and origin when known."""
        return (
            self.kind + (f" {self.name}" if self.name else "") + (f", {self.origin}" if self.origin else "")
        )

    def describe(self) -> str:
        """``"weight  meta (5, 10) float32  parameter model.net2.weight"``."""
        what = self.what
        if self.dtype == "?":  # known only by device (e.g. from an autograd engine message)
            return f"{self.label}: {self.device} - {what}"
        shape = "(" + ", ".join(str(s) for s in self.shape) + ("," if len(self.shape) == 1 else "") + ")"
        return f"{self.label}: {self.device} {shape} {self.dtype} - {what}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "device": self.device,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "kind": self.kind,
            "name": self.name,
            "origin": self.origin,
            "odd": self.odd,
        }


@dataclass
class Finding:
    """One problem (or risk) with a severity, where it is, and a concrete fix.

    ``code`` is a stable identifier (e.g. ``"loss-buffer-device"``) that tests and tools can
    match on; ``title`` is one line; ``details`` are extra lines (grouped names, the op's
    arguments); ``where`` is a module path or qualified name when there is one.
    """

    code: str
    severity: str
    title: str
    fix: str
    where: str | None = None
    details: list[str] = field(default_factory=list)
    tensors: list[TensorArg] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"Finding severity={self.severity!r} is not one of {', '.join(SEVERITIES)}")

    def format(self) -> str:
        """Plain multi-line text for terminals without colour and for logs."""
        lines = [f"[{self.severity}] {self.title}"]
        if self.where:
            lines.append(f"    where: {self.where}")
        lines.extend(f"    {d}" for d in self.details)
        for t in self.tensors:
            lines.append(f"    {'!' if t.odd else ' '} {t.describe()}")
        lines.append(f"    fix: {self.fix}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "severity": self.severity,
            "title": self.title,
            "where": self.where,
            "details": list(self.details),
            "tensors": [t.to_dict() for t in self.tensors],
            "fix": self.fix,
        }


@dataclass
class Report:
    """The doctor's findings, most severe first.

    ``ran`` tells whether a forward (and backward) actually ran under the watcher;
    ``ops_checked`` counts the ops the watcher looked at. ``ok`` is True when there is no error.
    """

    findings: list[Finding] = field(default_factory=list)
    ran: bool = False
    ops_checked: int = 0

    def add(self, findings: Finding | Iterable[Finding]) -> None:
        """Append one finding or several, keeping errors before warnings before info."""
        if isinstance(findings, Finding):
            findings = [findings]
        self.findings.extend(findings)
        self.findings.sort(key=lambda f: SEVERITIES.index(f.severity))

    def merge(self, findings: Iterable[Finding]) -> None:
        """Add the findings whose ``(code, where)`` is not reported yet (once each)."""
        have = {(f.code, f.where) for f in self.findings}
        new = []
        for f in findings:
            if (f.code, f.where) not in have:
                have.add((f.code, f.where))
                new.append(f)
        self.add(new)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def codes(self) -> list[str]:
        """The finding codes in order, e.g. ``["loss-buffer-device", "model-split"]``."""
        return [f.code for f in self.findings]

    def summary(self) -> str:
        e, w = len(self.errors), len(self.warnings)
        ran = f"; ran forward/backward under the watcher ({self.ops_checked} ops checked)" if self.ran else ""
        if not self.findings:
            return f"no device problem found{ran}"
        return f"{e} error(s), {w} warning(s){ran}"

    def format(self) -> str:
        """Plain text: a summary line, then each finding."""
        parts = [f"torchspan doctor: {self.summary()}"]
        parts.extend(f.format() for f in self.findings)
        return "\n".join(parts)

    __str__ = format

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "ran": self.ran,
            "ops_checked": self.ops_checked,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "findings": [f.to_dict() for f in self.findings],
        }

    def render(self, console: Any) -> None:
        """Print with rich formatting (colours, a table per finding) on ``console``."""
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text

        colour = {"error": "red", "warning": "yellow", "info": "cyan"}
        console.print(Text(f"torchspan doctor: {self.summary()}", style="bold"))
        for f in self.findings:
            body = Table.grid(padding=(0, 1))
            body.add_column(style="dim", no_wrap=True)
            body.add_column()
            if f.where:
                body.add_row("where", Text(f.where, style="bold"))  # every cell a Text: no markup
            for d in f.details:
                body.add_row("", Text(d))
            if f.tensors:
                args = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
                for col in ("arg", "device", "shape", "dtype", "what"):
                    args.add_column(col)
                for t in f.tensors:
                    style = "bold red" if t.odd else ""
                    # Text, not str: a console with markup would read `x[0]` or `dict[str, Tensor]` as styles
                    args.add_row(
                        Text(t.label),
                        Text(t.device, style=style),
                        Text(str(tuple(t.shape))),
                        Text(t.dtype),
                        Text(t.what),
                    )
                body.add_row("tensors", args)
            body.add_row("fix", Text(f.fix, style="green"))
            c = colour.get(f.severity, "white")
            console.print(
                Panel(
                    body,
                    title=Text(f"{f.severity}: {f.title}", style=f"bold {c}"),
                    border_style=c,
                    title_align="left",
                )
            )

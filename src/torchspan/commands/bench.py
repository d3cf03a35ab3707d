"""``torchspan bench [--quick] [--dir DIR] [--only NAME ...] [--json]``: every benchmark, one ratio table.

Runs each script ``benchmarks/*.py`` (names starting with ``_`` are helpers and skipped) in its own
process, passing ``--quick`` when asked, and collects the lines it prints of the form::

    RATIO <name> <value> <goal> [anchor words...]
    SKIP <name> <why...>

``<value>`` is torchspan's figure over its anchor's (a float), ``<goal>`` is ``<=0.8``, ``>=1.3``
(``<``, ``>`` too) or ``-`` for none, and the rest of the line names the anchor. Each script
measures anchor and torchspan in the same run, so the ratios are comparable on any machine. A
``SKIP`` line names a comparison the script could not make (e.g. its anchor is not installed); the
table shows it as skipped, with the reason.

Usage: ``torchspan bench --quick``; in Python, ``main(["bench", "--quick"])``.
"""

from __future__ import annotations

import argparse
import math
import operator
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ._common import UsageError, console, print_json
from ._options import add_json_option

__all__ = [
    "Ratio",
    "ScriptResult",
    "parse_ratios",
    "parse_skips",
    "goal_met",
    "find_scripts",
    "run_benchmarks",
    "machine_description",
]

_SKIP_RE = re.compile(r"^SKIP\s+(\S+)\s*(.*)$")
_RATIO_RE = re.compile(r"^RATIO\s+(\S+)\s+(\S+)\s+(\S+)(?:\s+(.*))?$")
_GOAL_RE = re.compile(r"^(<=|>=|<|>)\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)x?$")
_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}


@dataclass
class Ratio:
    """One ``RATIO`` line: ``value`` of ``name`` against ``anchor`` with its ``goal``."""

    name: str
    value: float
    goal: str
    anchor: str = ""

    @property
    def met(self) -> bool | None:
        return goal_met(self.value, self.goal)


@dataclass
class ScriptResult:
    """What one benchmark script did: its ratios, exit status, seconds and the tail of its output."""

    script: str
    returncode: int
    seconds: float
    ratios: list[Ratio] = field(default_factory=list)
    tail: str = ""
    skipped: dict[str, str] = field(default_factory=dict)  # comparison -> why the script could not make it

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and bool(self.ratios)


def goal_met(value: float, goal: str) -> bool | None:
    """``goal_met(0.7, "<=0.8") is True``; ``None`` when there is no goal (``"-"``)."""
    if goal in ("-", ""):
        return None
    m = _GOAL_RE.match(goal.strip())
    if m is None:
        raise ValueError(f"goal={goal!r} is not a goal; write <=0.8, >=1.3, <1, >1 or '-' for none")
    return _OPS[m.group(1)](value, float(m.group(2)))


def parse_ratios(text: str) -> list[Ratio]:
    """Every well-formed ``RATIO`` line in ``text``; lines whose first word is not ``RATIO`` are ignored.

    A line that starts with ``RATIO`` but is malformed raises ``ValueError`` quoting it, so a
    benchmark cannot silently drop a figure.
    """
    out: list[Ratio] = []
    for raw in text.splitlines():
        line = raw.strip()
        if line.split(maxsplit=1)[:1] != ["RATIO"]:
            continue
        m = _RATIO_RE.match(line)
        if m is None:
            raise ValueError(f"benchmark line {line!r} is not 'RATIO <name> <value> <goal> [anchor...]'")
        name, value_text, goal, anchor = m.groups()
        try:
            value = float(value_text)
        except ValueError:
            raise ValueError(f"benchmark line {line!r}: value {value_text!r} is not a number") from None
        goal_met(value, goal)  # validates the goal
        out.append(Ratio(name, value, goal, (anchor or "").strip()))
    return out


def parse_skips(text: str) -> dict[str, str]:
    """``SKIP <name> <why...>`` lines: the comparisons a script skipped and why (``{"a/b": "b is not
    installed"}``)."""
    found = (_SKIP_RE.match(line.strip()) for line in text.splitlines())
    return {m.group(1): m.group(2).strip() or "skipped by the script" for m in found if m}


def default_benchmarks_dir() -> Path:
    """``./benchmarks`` when it exists, else the ``benchmarks/`` next to torchspan's source checkout."""
    here = Path.cwd() / "benchmarks"
    if here.is_dir():
        return here
    return Path(__file__).resolve().parents[3] / "benchmarks"


def find_scripts(directory: Path, only: Sequence[str] | None = None) -> list[Path]:
    """Benchmark scripts in ``directory`` (``*.py`` not starting with ``_``), sorted; ``only`` filters by
    stem."""
    if not directory.is_dir():
        raise UsageError(
            f"--dir {str(directory)!r} is not a folder; point it at torchspan's benchmarks/ folder"
        )
    scripts = sorted(p for p in directory.glob("*.py") if not p.name.startswith("_"))
    if only:
        stems = {p.stem: p for p in scripts}
        unknown = [n for n in only if n.removesuffix(".py") not in stems]
        if unknown:
            raise UsageError(
                f"--only {', '.join(unknown)}: no such benchmark in {directory}; choose from "
                f"{', '.join(stems) or '(none)'}"
            )
        scripts = [stems[n.removesuffix(".py")] for n in only]
    return scripts


Runner = Callable[[list[str], Path, float], "subprocess.CompletedProcess[str]"]


def _subprocess_runner(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def run_benchmarks(
    scripts: Sequence[Path],
    *,
    quick: bool = False,
    timeout: float = 600.0,
    runner: Runner = _subprocess_runner,
    on_start: Callable[[Path], None] | None = None,
) -> list[ScriptResult]:
    """Run each script with this Python (``--quick`` if asked) and parse its ``RATIO`` lines."""
    results = []
    for script in scripts:
        if on_start:
            on_start(script)
        script = (
            script.resolve()
        )  # the script runs from the folder above benchmarks/: a relative --dir would not reach it
        cmd = [sys.executable, str(script)] + (["--quick"] if quick else [])
        t0 = time.perf_counter()
        try:
            proc = runner(cmd, script.parent.parent, timeout)
        except subprocess.TimeoutExpired:
            results.append(
                ScriptResult(
                    script.stem, 124, time.perf_counter() - t0, tail=f"timed out after {timeout:.0f} s"
                )
            )
            continue
        seconds = time.perf_counter() - t0
        output = (proc.stdout or "") + ("\n" + proc.stderr if proc.stderr else "")
        tail = "\n".join(output.strip().splitlines()[-3:])
        try:
            ratios = parse_ratios(proc.stdout or "")
        except ValueError as exc:
            results.append(ScriptResult(script.stem, proc.returncode or 1, seconds, tail=str(exc)))
            continue
        results.append(
            ScriptResult(script.stem, proc.returncode, seconds, ratios, tail, parse_skips(proc.stdout or ""))
        )
    return results


def machine_description() -> str:
    """One line: CPU, core count, accelerators, Python and PyTorch versions."""
    import torch

    from ..hardware import devices

    parts = [d.name if d.kind == "cpu" else f"{d.device}: {d.name}" for d in devices("auto")]
    return (
        f"{'; '.join(parts)} | Python {platform.python_version()} | torch {torch.__version__} | "
        f"{platform.system()} {platform.machine()}"
    )


def _fmt_value(value: float) -> str:
    return f"{value:.3f}" if math.isfinite(value) else str(value)


def render(results: Sequence[ScriptResult], machine: str, quick: bool) -> Table:
    """The ratio table: one row per ratio, or per script that gave none."""
    caption = f"machine: {machine}"
    if quick:  # a new user must not read a smoke run's figures as the benchmarks' results
        caption += (
            "\n--quick: tiny sizes and the fewest steps, to show that every benchmark runs; its figures "
            "are not measurements (run without --quick for those)"
        )
    table = Table(
        title=f"torchspan bench{' --quick' if quick else ''}", caption=caption, caption_justify="left"
    )
    for col, justify in (
        ("benchmark", "left"),
        ("ratio", "left"),
        ("value", "right"),
        ("goal", "right"),
        ("met", "center"),
        ("anchor", "left"),
        ("s", "right"),
    ):
        # Ratio names are identifiers people grep for: fold them rather than cut them short.
        table.add_column(
            col,
            justify=justify,
            overflow="fold" if col == "ratio" else "ellipsis",
            no_wrap=col in ("value", "goal", "met", "s"),
        )  # type: ignore[arg-type]
    for r in results:
        if not r.ratios:
            why = f"failed (exit {r.returncode})" if r.returncode else "printed no RATIO lines"
            table.add_row(
                r.script,
                Text(why, style="red"),
                "-",
                "-",
                "-",
                Text(r.tail.splitlines()[-1] if r.tail else ""),
                f"{r.seconds:.0f}",
            )
            continue
        for i, q in enumerate(r.ratios):
            met = {True: Text("yes", style="green"), False: Text("no", style="red"), None: Text("-")}[q.met]
            table.add_row(
                r.script if i == 0 else "",
                Text(q.name),
                _fmt_value(q.value),
                q.goal,
                met,
                Text(q.anchor),
                f"{r.seconds:.0f}" if i == 0 else "",
            )
        for (
            name,
            why,
        ) in (
            r.skipped.items()
        ):  # the reason is the script's text (e.g. pip install 'torchspan[bench]'): never markup
            table.add_row("", Text(name), "-", "-", Text("skipped", style="yellow"), Text(why), "")
    return table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run the benchmarks and print their ratios against the anchors",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="short runs (each script's --quick)")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="benchmarks folder (default: ./benchmarks, else the source checkout's)",
    )
    p.add_argument(
        "--only", action="append", metavar="NAME", help="run only this benchmark (script stem; repeatable)"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per script (default 600)")
    add_json_option(p, "the ratios and each script's outcome")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout!r} must be > 0 seconds")
    directory = args.dir if args.dir is not None else default_benchmarks_dir()
    scripts = find_scripts(directory, args.only)
    if not scripts:
        raise UsageError(f"no benchmark scripts (*.py) in {directory}; pass --dir to the benchmarks folder")
    out = console()
    if args.json:
        results = run_benchmarks(scripts, quick=args.quick, timeout=args.timeout)
    else:
        with out.status("") as status:
            results = run_benchmarks(
                scripts,
                quick=args.quick,
                timeout=args.timeout,
                on_start=lambda s: status.update(
                    f"running {escape(s.name)}{' --quick' if args.quick else ''} ..."
                ),  # status text is markup
            )
    machine = machine_description()
    if args.json:
        rows = []
        for r in results:
            row = dict(asdict(r), ok=r.ok)
            row["ratios"] = [dict(asdict(q), met=q.met) for q in r.ratios]
            rows.append(row)
        print_json({"machine": machine, "quick": args.quick, "results": rows})
    else:
        out.print(render(results, machine, args.quick))
    return 0 if all(r.ok for r in results) else 1

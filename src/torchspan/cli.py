"""The ``torchspan`` command line: ``torchspan devices|doctor|plan|run|verify|demo|bench|launch``.

Each subcommand lives in ``torchspan.commands.<name>`` and
exposes ``register(subparsers)``, which adds its parser and sets ``func(args) -> int``. Tests call
``main([...])`` directly.

Usage: ``torchspan devices --json``; in Python, ``main(["devices", "cpu"])``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from . import __version__
from .commands._common import UsageError, join_negative_values

# Order is the order shown in --help.
COMMANDS = ("devices", "doctor", "plan", "run", "verify", "demo", "bench", "launch")

__all__ = ["COMMANDS", "UsageError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchspan",
        description="Train one PyTorch model across every device a machine has.",
    )
    parser.add_argument("--version", action="version", version=f"torchspan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"torchspan.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"torchspan.commands.{name}":
                continue  # command not shipped in this build
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default: ``sys.argv[1:]``) and return the exit status."""
    parser = build_parser()
    argv = join_negative_values(
        parser, sys.argv[1:] if argv is None else argv
    )  # `--input-shape -8,16` reaches its check
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand, as its own errors do (argparse would say `torchspan: error:`)
        print(
            f"torchspan {args.command or ''}".rstrip()
            + f": error: unrecognized arguments: {' '.join(extra)}; see torchspan {args.command or ''} "
            "--help".rstrip(),
            file=sys.stderr,
        )
        return 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    previous = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # UsageError is a ValueError
        # Library errors already name the argument, the value and the fix.
        print(f"torchspan {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # pragma: no cover - interactive
        print("torchspan: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = previous


def _show_warning(
    message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    print(f"torchspan: warning: {message}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

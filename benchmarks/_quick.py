"""``--quick`` for the benchmark scripts: ``torchspan bench --quick`` passes it to each (names starting with
``_``, like this helper, are not run as benchmarks).

Usage, in a script's ``main(argv)`` before ``parse_args``::

    # --quick: these defaults instead; options given explicitly still win
    add_quick(parser, argv, steps=2, width=32)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def add_quick(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, **values: Any) -> None:
    """Add ``--quick`` to ``parser``; when it is on the command line, ``values`` become the defaults (tiny
    sizes, the fewest steps: a run that shows the script works, not a measurement)."""
    shown = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in values.items())
    parser.add_argument(
        "--quick", action="store_true", help=f"a smoke run for torchspan bench --quick: {shown} unless given"
    )
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**values)

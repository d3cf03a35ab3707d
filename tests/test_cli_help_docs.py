"""docs/cli.md and torchspan's own argparse parser (``torchspan.cli.build_parser()``) agree.

- ``torchspan --help``: every command it lists has a section ``## torchspan NAME`` in docs/cli.md, in the same
  order, and no section names a command that does not exist; the top-level options (``--help``, ``--version``)
  are named before the first section.
- ``torchspan NAME --help``: every option string of the command (aliases and old spellings too) is named in
its
  section; every option shown by ``--help`` appears there as ``--help`` writes it (``--memory DEV=SIZE``,
  ``--schedule {auto,gpipe,...}``), so a changed metavar or choice shows here; every positional is named.
- docs/cli.md names no option that does not exist: every ``--word`` in a command's section is an option of
that
  command, and every ``--word`` before the first section an option of some command or of ``torchspan`` itself.

When an option changes, print the option lists as the parser has them and paste the command's list into its
section: ``python tests/test_cli_help_docs.py [NAME ...]``.

Usage: ``python -m pytest -q tests/test_cli_help_docs.py`` (a second).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

from torchspan.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
CLI_MD = ROOT / "docs" / "cli.md"
OPTION = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")  # `--memory`, `--nproc_per_node`; not a bare `--`


def commands(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    """Each command's parser, in the order ``torchspan --help`` lists them."""
    parser = parser or build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def shown(action: argparse.Action) -> bool:
    return action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)


def arguments(sub: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """``(invocation, help)`` for each argument ``--help`` shows: ``("--memory DEV=SIZE", "memory budget
    ...")``."""
    fmt = sub._get_formatter()
    return [
        (fmt._format_action_invocation(a), fmt._expand_help(a) if a.help else "")
        for a in sub._actions
        if shown(a)
    ]


def option_lines(sub: argparse.ArgumentParser) -> list[str]:
    """The command's arguments as docs/cli.md lists them: ``- `--memory DEV=SIZE`: memory budget ...``."""
    return [f"- `{invocation}`: {help_text}" for invocation, help_text in arguments(sub)]


def sections(text: str) -> tuple[str, dict[str, str]]:
    """docs/cli.md's text before the first command section, and each ``## torchspan NAME`` section's text."""
    parts = re.split(r"^## torchspan (\S+)\s*$", text, flags=re.M)
    return parts[0], dict(zip(parts[1::2], parts[2::2]))


TEXT = CLI_MD.read_text(encoding="utf-8")
INTRO, SECTIONS = sections(TEXT)
COMMAND_PARSERS = commands()


def test_help_lists_the_commands_cli_md_documents() -> None:
    """``torchspan --help`` and docs/cli.md name the same commands, in the same order."""
    parser = build_parser()
    helped = re.findall(r"^    (\w+)\s", parser.format_help(), re.M)
    assert helped == list(COMMAND_PARSERS) == [c for c in COMMANDS if c in COMMAND_PARSERS], helped
    assert list(SECTIONS) == list(COMMAND_PARSERS), (
        f"docs/cli.md's sections {list(SECTIONS)} are not torchspan's commands {list(COMMAND_PARSERS)}"
    )
    for name in COMMAND_PARSERS:
        assert f"`torchspan {name}`" in INTRO, (
            f"docs/cli.md's table of commands leaves out `torchspan {name}`"
        )


def test_top_level_options_are_named() -> None:
    for action in build_parser()._actions:
        for option in action.option_strings:
            if option.startswith("--"):
                assert option in INTRO, (
                    f"docs/cli.md does not name `torchspan {option}` before its first section"
                )


@pytest.mark.parametrize("name", list(COMMAND_PARSERS))
def test_every_option_of_the_command_is_documented(name: str) -> None:
    sub, section = COMMAND_PARSERS[name], SECTIONS.get(name, "")
    named = set(OPTION.findall(section))
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                assert option in named, f"docs/cli.md's `torchspan {name}` section does not name {option}"
    for invocation, _ in arguments(sub):
        assert f"`{invocation}`" in section, (
            f"docs/cli.md's `torchspan {name}` section lacks `{invocation}` as `torchspan {name} --help` "
            f"writes it; regenerate its list with `python tests/test_cli_help_docs.py {name}`"
        )


@pytest.mark.parametrize("name", list(COMMAND_PARSERS))
def test_the_section_names_no_option_the_command_lacks(name: str) -> None:
    sub, section = COMMAND_PARSERS[name], SECTIONS.get(name, "")
    real = {o for a in sub._actions for o in a.option_strings}
    unknown = sorted(set(OPTION.findall(section)) - real)
    assert not unknown, (
        f"docs/cli.md's `torchspan {name}` section names {unknown}, which `torchspan {name}` does not take"
    )


def test_the_intro_names_no_option_that_does_not_exist() -> None:
    real = {o for a in build_parser()._actions for o in a.option_strings}
    real |= {o for sub in COMMAND_PARSERS.values() for a in sub._actions for o in a.option_strings}
    unknown = sorted(set(OPTION.findall(INTRO)) - real)
    assert not unknown, f"docs/cli.md names {unknown}, which no torchspan command takes"


def test_the_checks_are_not_blind() -> None:
    """The sections hold option lists, and an option that does not exist would be caught."""
    assert sum(len(arguments(s)) for s in COMMAND_PARSERS.values()) >= 50
    assert OPTION.findall("a `--made-up` option, then `--` and script-args") == ["--made-up"]


if __name__ == "__main__":  # print the option lists to paste into docs/cli.md
    for name, sub in commands().items():
        if len(sys.argv) > 1 and name not in sys.argv[1:]:
            continue
        print(f"## torchspan {name}\n\nOptions:\n")
        print("\n".join(option_lines(sub)))
        print()

"""One CLI vocabulary: an option name means the same thing, with the same choices, type and help, in every
command.

Built from ``torchspan.cli.build_parser()`` alone (nothing runs), so a new command or option that
drifts from the others fails here.
"""

from __future__ import annotations

import argparse

import pytest

from torchspan import cli
from torchspan.schedule import PRECISIONS, RECOMPUTE_MODES, SCHEDULES

TARGET_COMMANDS = ("plan", "run", "verify")
INPUT_OPTIONS = ("--input-shape", "--input", "--input-dtype", "--vocab")
# every command that prints a result; launch runs the user's script, which prints its own
RESULT_COMMANDS = ("devices", "doctor", "plan", "run", "verify", "demo", "bench")


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


COMMANDS = _commands()


def _option(command: str, name: str) -> argparse.Action | None:
    return next((a for a in COMMANDS[command]._actions if name in a.option_strings), None)


def _having(name: str) -> dict[str, argparse.Action]:
    return {c: a for c in COMMANDS if (a := _option(c, name)) is not None}


def _same(actions: dict[str, argparse.Action], *fields: str) -> None:
    for field in fields:
        values = {c: getattr(a, field) for c, a in actions.items()}
        assert len({repr(v) for v in values.values()}) == 1, f"{field} differs: {values}"


def test_every_command_is_built() -> None:
    assert set(COMMANDS) == set(cli.COMMANDS)


@pytest.mark.parametrize("name", INPUT_OPTIONS)
def test_target_commands_share_the_input_options(name: str) -> None:
    actions = {c: _option(c, name) for c in TARGET_COMMANDS}
    assert all(a is not None for a in actions.values()), actions
    _same(actions, "option_strings", "dest", "default", "type", "metavar", "nargs", "choices")  # type: ignore[arg-type]
    if name != "--input-dtype":  # its help ends with what the dtype does to the model in that command
        _same(actions, "help")  # type: ignore[arg-type]
    else:
        heads = {c: a.help.split("; ")[:2] for c, a in actions.items()}  # type: ignore[union-attr]
        assert len({repr(h) for h in heads.values()}) == 1, heads


def test_input_dtype_keeps_dtype_as_an_alias_and_vocab_has_one_default() -> None:
    for command in TARGET_COMMANDS:
        dtype = _option(command, "--input-dtype")
        assert dtype is _option(command, "--dtype") and dtype is not None and dtype.default == "float32"
        vocab = _option(command, "--vocab")
        assert (
            vocab is not None
            and vocab.default == 2
            and vocab.type is int
            and "(default 2)" in (vocab.help or "")
        )


def test_every_command_that_prints_a_result_has_json() -> None:
    missing = [c for c in RESULT_COMMANDS if _option(c, "--json") is None]
    assert not missing, f"no --json: {missing}"
    for command in RESULT_COMMANDS:
        action = _option(command, "--json")
        assert isinstance(action, argparse._StoreTrueAction) and (action.help or "").startswith("print ")


def test_schedule_recompute_and_precision_choices_are_the_library_constants() -> None:
    for name, names in (
        ("--schedule", SCHEDULES),
        ("--recompute", RECOMPUTE_MODES),
        ("--precision", PRECISIONS),
    ):
        actions = _having(name)
        assert actions, name
        for command, action in actions.items():
            choices = tuple(action.choices or ())
            planned = action.default in (None, "auto")  # the planner chooses: "auto" is offered first
            assert choices == (("auto", *names) if planned and name != "--precision" else names), (
                command,
                name,
                choices,
            )
            assert "default" in (action.help or ""), (command, name)
    assert set(_having("--schedule")) == {"plan", "run", "verify", "demo"}
    assert set(_having("--recompute")) == {"plan", "run", "verify"}


def test_checkpoint_is_a_hidden_alias_of_recompute() -> None:
    for command, recompute in _having("--recompute").items():
        alias = _option(command, "--checkpoint")
        assert alias is not None, command
        assert alias.dest == recompute.dest == "recompute" and alias.help == argparse.SUPPRESS
        assert alias.choices == recompute.choices, command
    args = COMMANDS["plan"].parse_args(["m:f", "--input-shape", "4,8", "--checkpoint", "always"])
    assert args.recompute == "always"
    args = COMMANDS["verify"].parse_args(["m:f", "--input-shape", "4,8"])
    assert args.recompute == "never"  # the hidden alias does not replace the default


def test_devices_read_alike() -> None:
    actions = _having("--devices")
    assert set(actions) == {"plan", "run", "verify", "demo"}
    _same(actions, "metavar", "type", "option_strings")
    for command, action in actions.items():
        help_text = action.help or ""
        assert (
            action.metavar == "SPEC" and ": a device spec, e.g. " in help_text and "(default " in help_text
        ), (command, help_text)


def test_microbatches_is_an_int_or_auto_where_a_search_chooses() -> None:
    actions = _having("--microbatches")
    assert set(actions) == {"plan", "run", "verify", "demo"}
    for command, action in actions.items():
        help_text = action.help or ""
        assert help_text.startswith("micro-batches per step: an integer >= 1") and "(default " in help_text, (
            command,
            help_text,
        )
        if command == "verify":  # span runs a fixed count: no search to choose it
            assert action.type is int and action.metavar == "N" and "auto" not in help_text
        else:
            assert (
                action.type is None
                and action.metavar == "N|auto"
                and "or auto for the planner's choice" in help_text
            )


def test_process_counts_are_nproc_per_node_with_the_old_spelling_kept() -> None:
    actions = _having("--nproc-per-node")
    assert set(actions) == {"verify", "demo", "launch"}
    assert {a.dest for a in actions.values()} == {"nproc_per_node"}
    assert _option("verify", "--nproc") is actions["verify"] and _option("demo", "--nproc") is actions["demo"]
    assert _option("launch", "--nproc_per_node") is actions["launch"]
    args = COMMANDS["verify"].parse_args(["m:f", "--input-shape", "4,8", "--nproc", "4"])
    assert args.nproc_per_node == 4


def test_out_says_file_or_folder() -> None:
    actions = _having("--out")
    kinds = {c: a.metavar for c, a in actions.items()}
    assert kinds == {"plan": "FILE", "run": "DIR", "demo": "DIR"}
    for command, action in actions.items():
        where = "to the file FILE" if action.metavar == "FILE" else "into the folder DIR"
        assert where in (action.help or ""), (command, action.help)


def test_options_with_a_default_say_it() -> None:
    quiet = (
        argparse._HelpAction,
        argparse._VersionAction,
        argparse._StoreTrueAction,
        argparse._StoreConstAction,
    )
    missing = []
    for command, parser in COMMANDS.items():
        for action in parser._actions:
            if isinstance(action, quiet) or not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            if action.default not in (None, argparse.SUPPRESS) and "default" not in (action.help or ""):
                missing.append(f"{command} {action.option_strings[0]} (default {action.default!r})")
    assert not missing, missing


def test_help_holds_no_notes_about_the_code() -> None:
    for command, parser in COMMANDS.items():
        texts = [parser.description or "", *(a.help or "" for a in parser._actions)]
        for text in texts:
            for word in ("measure.py", "the module is named", "torchspan.commands", "lives in"):
                assert word not in text, (command, word, text[:120])

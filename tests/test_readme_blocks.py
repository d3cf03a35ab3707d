"""README.md's code blocks run as written, or in the form they declare, so they cannot drift.

Every ```python block is written to a file in a fresh temporary folder and run in a subprocess with a timeout:

- as ``python block.py`` by default;
- a block with a comment ``# NAME.py: run with: CMD, or CMD`` runs each CMD, each in a fresh folder, saved as the
  file the command names: ``python NAME.py`` or ``torchspan launch --nproc-per-node N NAME.py``;
- a block with a comment ``# needs a GPU`` / ``# needs N GPUs`` is skipped, with that reason, where fewer are present;
- a block that imports transformers (or Lightning) is skipped where it is not installed (the ``hf`` or
  ``lightning`` extra);
- a line ``print(...)`` followed by a comment line ``# TEXT`` says what it prints: TEXT must be in the output.

Every ``$ torchspan ...`` line of the other blocks (and ``torchspan ...`` lines of ``bash`` blocks other than the
set-up commands) must parse with torchspan's own command-line parser: the command and its options exist and their
values parse. Nothing of it runs.

Usage: ``python -m pytest -q tests/test_readme_blocks.py`` (about a minute; the launched blocks are marked slow).
"""

from __future__ import annotations

import contextlib
import io
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from torchspan.cli import build_parser
from torchspan.commands._common import join_negative_values

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TIMEOUT = 240  # seconds per command; a hang fails the test instead of blocking CI


@dataclass(frozen=True)
class Block:
    line: int  # README line of the opening fence
    lang: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.lang or 'text'}@README.md:{self.line}"


def readme_blocks(text: str) -> list[Block]:
    """Every fenced block of ``text`` (indented ones inside list items too), dedented."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start, body = m.group(1), m.group(2), i, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        blocks.append(Block(start + 1, lang, "\n".join(body) + "\n"))
        i += 1
    return blocks


BLOCKS = readme_blocks(README.read_text(encoding="utf-8"))
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def commands(block: Block) -> list[list[str]]:
    """How the block says it runs: ``[["python", "train.py"], ["torchspan", "launch", ...]]``; default ``python block.py``."""
    for line in block.text.splitlines():
        m = re.match(r"^#.*\brun with:\s*(.+)$", line.strip())
        if m:
            forms = [shlex.split(c) for c in re.split(r",?\s+or\s+", m.group(1).strip().rstrip("."))]
            for argv in forms:
                assert argv[-1].endswith(".py") and (argv[0] == "python" or argv[:2] == ["torchspan", "launch"]), (
                    f"README.md:{block.line}: `run with:` names {' '.join(argv)!r}; use `python NAME.py` or "
                    "`torchspan launch --nproc-per-node N NAME.py`"
                )
            return forms
    return [["python", "block.py"]]


def gpus_needed(block: Block) -> int:
    m = re.search(r"^\s*#.*\bneeds (a|\d+) GPUs?\b", block.text, re.M)
    return 0 if m is None else 1 if m.group(1) == "a" else int(m.group(1))


def expected_prints(block: Block) -> list[str]:
    """The text a ``# ...`` comment line right after a top-level ``print(...)`` line says it prints."""
    lines = block.text.splitlines()
    return [nxt[1:].strip() for line, nxt in zip(lines, lines[1:]) if line.startswith("print(") and nxt.startswith("# ")]


def _argv(command: list[str], file: Path) -> list[str]:
    if command[0] == "python":
        return [sys.executable, str(file)]
    return [sys.executable, "-m", "torchspan.cli", *command[1:-1], str(file)]


def run_block(block: Block, command: list[str], folder: Path) -> subprocess.CompletedProcess[str]:
    """Write the block to ``folder/NAME.py`` and run it the way ``command`` says; fails on a non-zero exit."""
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / command[-1]
    file.write_text(block.text, encoding="utf-8")
    env = {**os.environ, "TORCHSPAN_TIMEOUT": "120", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(_argv(command, file), cwd=folder, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"README.md:{block.line} `{' '.join(command)}` exited {proc.returncode}:\n{tail}"
    return proc


def _marks(block: Block) -> list[pytest.MarkDecorator]:
    slow = "transformers" in block.text or any(c[0] == "torchspan" for c in commands(block))
    return [pytest.mark.slow] if slow else []


CASES = [pytest.param(b, c, id=f"{b.id}:{' '.join(c)}", marks=_marks(b)) for b in PYTHON for c in commands(b)]


@pytest.mark.parametrize(("block", "command"), CASES)
def test_readme_python_block_runs(block: Block, command: list[str], tmp_path: Path) -> None:
    need = gpus_needed(block)
    if need > torch.cuda.device_count():
        pytest.skip(f"README.md:{block.line} needs {need} GPU(s); {torch.cuda.device_count()} here")
    if re.search(r"^\s*import .*\btransformers\b", block.text, re.M) and importlib.util.find_spec("transformers") is None:
        pytest.skip(f"README.md:{block.line} needs transformers: pip install -c constraints.txt -e '.[hf]'")
    if re.search(r"^\s*(import|from) lightning\b", block.text, re.M) and importlib.util.find_spec("lightning") is None:
        pytest.skip(f"README.md:{block.line} needs Lightning: pip install -c constraints.txt -e '.[lightning]'")
    proc = run_block(block, command, tmp_path)
    for text in expected_prints(block):
        assert text in proc.stdout, f"README.md:{block.line} says it prints {text!r}; it printed:\n{proc.stdout[-2000:]}"


def test_every_python_block_is_checked() -> None:
    """The blocks this file runs are README's python blocks, and there are some (the extraction did not go blind)."""
    assert len(PYTHON) >= 8 and all("import" in b.text for b in PYTHON), [b.id for b in PYTHON if "import" not in b.text]


def test_train_py_says_when_it_resumes(tmp_path: Path) -> None:
    """The README's train.py, run a second time, resumes from ckpt.pt and says so (it printed nothing)."""
    (block,) = [b for b in PYTHON if ["python", "train.py"] in commands(b)]
    first = run_block(block, ["python", "train.py"], tmp_path)
    assert "epoch 3" in first.stdout and (tmp_path / "ckpt.pt").exists()
    again = run_block(block, ["python", "train.py"], tmp_path)
    assert "ckpt.pt" in again.stdout and "resum" in again.stdout, again.stdout


# --------------------------------------------------------------------------- shell blocks


def shell_commands() -> list[tuple[Block, str]]:
    """``$ torchspan ...`` lines of every non-python block, and ``torchspan ...`` lines of bash blocks."""
    found = []
    for block in BLOCKS:
        if block.lang == "python":
            continue
        for line in block.text.splitlines():
            line = line.strip()
            if line.startswith("$ torchspan "):
                found.append((block, line[2:]))
            elif block.lang == "bash" and line.startswith("torchspan "):
                found.append((block, line))
    return found


SHELL = shell_commands()


@pytest.mark.parametrize(("block", "line"), [pytest.param(b, s, id=f"{b.id}:{s.split()[1]}") for b, s in SHELL])
def test_readme_shell_command_parses(block: Block, line: str) -> None:
    argv = shlex.split(line, comments=True)[1:]
    parser = build_parser()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args, extra = parser.parse_known_args(join_negative_values(parser, argv))
        except SystemExit as exc:
            pytest.fail(f"README.md:{block.line} `{line}` does not parse (exit {exc.code}): {err.getvalue().strip()}")
    assert not extra, f"README.md:{block.line} `{line}`: unknown arguments {extra}"
    assert getattr(args, "func", None) is not None, f"README.md:{block.line} `{line}`: no such command"


def test_shell_commands_are_found() -> None:
    names = {s.split()[1] for _, s in SHELL}
    assert {"devices", "doctor", "plan", "verify", "launch"} <= names, names

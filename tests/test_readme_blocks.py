"""The code blocks of README.md and the guides in docs/ run as written, or in the form they declare, so they
cannot drift.

The files are README.md and every docs/*.md except docs/ARCHITECTURE.md (its blocks are diagrams, not code). A
block's id names its file and the line of its opening fence: ``python@docs/processes.md:42``.

Every ```python block is written to a file in a fresh temporary folder and run in a subprocess with a timeout:

- as ``python block.py`` by default;
- a block with a comment ``# NAME.py: run with: CMD, or CMD`` runs each CMD, each in a fresh folder, saved as
the
  file the command names: ``python NAME.py`` or ``torchspan launch --nproc-per-node N NAME.py``;
- a block with a comment ``# needs a GPU`` / ``# needs N GPUs`` is skipped, with that reason, where fewer are
present;
- a block that imports transformers (or Lightning) is skipped where it is not installed (the ``hf`` or
  ``lightning`` extra);
- a line ``print(...)`` followed by a comment line ``# TEXT`` says what it prints: TEXT must be in the output.

Every ``$ torchspan ...`` line of the other blocks (and ``torchspan ...`` lines of ``bash`` blocks other than
the set-up commands) must parse with torchspan's own command-line parser: the command and its options exist
and their values parse. Nothing of it runs.

Every relative link of those files (``[text](path#anchor)``) names a file that exists, and an anchor names a
heading of that file.

Usage: ``python -m pytest -q tests/test_readme_blocks.py`` (a few minutes; the launched blocks are marked
slow).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
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
NOT_RUN = {"docs/ARCHITECTURE.md"}  # diagrams and layout, no runnable blocks
DOCS = [
    README,
    *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.relative_to(ROOT).as_posix() not in NOT_RUN),
]
TIMEOUT = 240  # seconds per command; a hang fails the test instead of blocking CI


@dataclass(frozen=True)
class Block:
    line: int  # line of the opening fence in ``file``
    lang: str
    text: str
    file: str = "README.md"  # relative to the repository root

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def id(self) -> str:
        return f"{self.lang or 'text'}@{self.where}"


def readme_blocks(text: str, file: str = "README.md") -> list[Block]:
    """Every fenced block of ``text`` (indented ones inside list items too), dedented; ``file`` names where it
    is."""
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
        blocks.append(Block(start + 1, lang, "\n".join(body) + "\n", file))
        i += 1
    return blocks


BLOCKS = [
    b
    for path in DOCS
    for b in readme_blocks(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())
]
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def commands(block: Block) -> list[list[str]]:
    """How the block says it runs: ``[["python", "train.py"], ["torchspan", "launch", ...]]``; default
    ``python block.py``."""
    for line in block.text.splitlines():
        m = re.match(r"^#.*\brun with:\s*(.+)$", line.strip())
        if m:
            forms = [shlex.split(c) for c in re.split(r",?\s+or\s+", m.group(1).strip().rstrip("."))]
            for argv in forms:
                assert argv[-1].endswith(".py") and (
                    argv[0] == "python" or argv[:2] == ["torchspan", "launch"]
                ), (
                    f"{block.where}: `run with:` names {' '.join(argv)!r}; use `python NAME.py` or "
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
    return [
        nxt[1:].strip()
        for line, nxt in zip(lines, lines[1:])
        if line.startswith("print(") and nxt.startswith("# ")
    ]


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
    proc = subprocess.run(
        _argv(command, file), cwd=folder, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"{block.where} `{' '.join(command)}` exited {proc.returncode}:\n{tail}"
    return proc


def _marks(block: Block) -> list[pytest.MarkDecorator]:
    slow = "transformers" in block.text or any(c[0] == "torchspan" for c in commands(block))
    return [pytest.mark.slow] if slow else []


CASES = [pytest.param(b, c, id=f"{b.id}:{' '.join(c)}", marks=_marks(b)) for b in PYTHON for c in commands(b)]


@pytest.mark.parametrize(("block", "command"), CASES)
def test_readme_python_block_runs(block: Block, command: list[str], tmp_path: Path) -> None:
    need = gpus_needed(block)
    if need > torch.cuda.device_count():
        pytest.skip(f"{block.where} needs {need} GPU(s); {torch.cuda.device_count()} here")
    if (
        re.search(r"^\s*import .*\btransformers\b", block.text, re.M)
        and importlib.util.find_spec("transformers") is None
    ):
        pytest.skip(f"{block.where} needs transformers: pip install -c constraints.txt -e '.[hf]'")
    if (
        re.search(r"^\s*(import|from) lightning\b", block.text, re.M)
        and importlib.util.find_spec("lightning") is None
    ):
        pytest.skip(f"{block.where} needs Lightning: pip install -c constraints.txt -e '.[lightning]'")
    proc = run_block(block, command, tmp_path)
    for text in expected_prints(block):
        assert text in proc.stdout, (
            f"{block.where} says it prints {text!r}; it printed:\n{proc.stdout[-2000:]}"
        )


def test_every_python_block_is_checked() -> None:
    """The blocks this file runs are README's and the guides' python blocks, and there are some in each file
    that teaches code (the extraction did not go blind)."""
    assert len(PYTHON) >= 8 and all("import" in b.text for b in PYTHON), [
        b.id for b in PYTHON if "import" not in b.text
    ]
    files = {b.file for b in PYTHON}
    assert {"README.md", "docs/one-process.md", "docs/processes.md", "docs/trainers.md"} <= files, sorted(
        files
    )
    assert not NOT_RUN & files and "docs/cli.md" in {b.file for b in BLOCKS}, sorted(files)


def test_train_py_says_when_it_resumes(tmp_path: Path) -> None:
    """The guides' train.py, run a second time, resumes from ckpt.pt and says so (it printed nothing)."""
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


@pytest.mark.parametrize(
    ("block", "line"), [pytest.param(b, s, id=f"{b.id}:{s.split()[1]}") for b, s in SHELL]
)
def test_readme_shell_command_parses(block: Block, line: str) -> None:
    argv = shlex.split(line, comments=True)[1:]
    parser = build_parser()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args, extra = parser.parse_known_args(join_negative_values(parser, argv))
        except SystemExit as exc:
            pytest.fail(f"{block.where} `{line}` does not parse (exit {exc.code}): {err.getvalue().strip()}")
    assert not extra, f"{block.where} `{line}`: unknown arguments {extra}"
    assert getattr(args, "func", None) is not None, f"{block.where} `{line}`: no such command"


def test_shell_commands_are_found() -> None:
    names = {s.split()[1] for _, s in SHELL}
    assert {"devices", "doctor", "plan", "verify", "launch"} <= names, names


# --------------------------------------------------------------------------- links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation (backticks too) dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings (outside code blocks), with GitHub's -1, -2 for repeats."""
    found: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.+?)\s*#*\s*$", line)
        if m:
            base = anchor = slug(m.group(1))
            n = 0
            while anchor in found:
                n += 1
                anchor = f"{base}-{n}"
            found.add(anchor)
    return found


def links() -> list[tuple[str, str]]:
    """``(file, target)`` for every relative link of README.md and the guides, outside code."""
    found = []
    for path in DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"^[a-z]+:", target):
                found.append((path.relative_to(ROOT).as_posix(), target))
    return found


LINKS = links()


@pytest.mark.parametrize(("file", "target"), [pytest.param(f, t, id=f"{f}->{t}") for f, t in LINKS])
def test_relative_link_resolves(file: str, target: str) -> None:
    name, _, anchor = target.partition("#")
    path = (ROOT / file).parent / name if name else ROOT / file
    assert path.exists(), (
        f"{file} links to {target}: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} does "
        "not exist"
    )
    if anchor and path.suffix == ".md":
        assert anchor in anchors(path), (
            f"{file} links to {target}: no heading of {name or file} has the anchor #{anchor}"
        )


def test_links_are_found() -> None:
    assert any(t.startswith("docs/") for f, t in LINKS if f == "README.md"), "README links to no guide"


def test_the_demo_names_guides_that_exist() -> None:
    """`torchspan demo`'s closing line and report.md name the guide that explains what it showed."""
    from torchspan.demo.story import GUIDES, guide, guide_line

    for name in GUIDES.values():
        assert (ROOT / name).exists() and ROOT / name in DOCS, name
    assert GUIDES["one process"] in guide_line() and GUIDES["processes"] in guide_line(processes=2)
    assert guide() in guide_line() and guide(2) != guide()

"""CI runs exactly README.md's test command (one line in each, the same text)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    readme = [
        line
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("python3 -m venv") and "pytest" in line
    ]
    assert len(ci) == 1 and readme == ci, (ci, readme)
    assert (
        '-e ".[test,hf,lightning]"' in ci[0]
    )  # the real-model and trainer tests need transformers and Lightning

"""Text torchspan prints keeps its square brackets (issue 19): rich reads ``[bench]`` or ``[str, Any]`` as
markup and drops it, so every console torchspan makes prints without markup and text from users, models and
scripts reaches rich as ``Text`` (or escaped, where rich always parses: status lines).

Usage: ``pytest tests/test_markup.py``.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console

from torchspan.cli import main

SRC = Path(__file__).resolve().parents[1] / "src" / "torchspan"
HINT = "torchgpipe is not installed (pip install -c constraints.txt 'torchspan[bench]')"


def test_the_bench_skip_hint_keeps_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # issue 19: the table read `pip install -c constraints.txt 'torchspan'`: following it did not install
    # torchgpipe
    d = tmp_path / "benchmarks"
    d.mkdir()
    (d / "anchored.py").write_text(
        f"print('RATIO a/plain 1.0 <=1.1 plain loop [cpu]')\nprint(\"SKIP a/torchgpipe {HINT}\")\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--quick", "--dir", "benchmarks"]) == 0  # a relative --dir works too
    out = re.sub(r"[│\s]+", " ", capsys.readouterr().out)  # the table wraps the long reason over lines
    assert "'torchspan[bench]'" in out and "plain loop [cpu]" in out


def test_the_demo_sample_is_printed_as_the_model_wrote_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # issue 19: the sample panel dropped `[str, Any]` from what the model wrote
    from torchspan.demo import run as demo_run

    class Corpus:
        def encode(self, text: str) -> list[int]:
            return [0] * len(text)

        def decode(self, ids: list[int]) -> str:
            return "load(path: str) -> dict[str, Any]:\n    return [bold]{}[/bold]"

    monkeypatch.setattr(demo_run, "generate", lambda model, ids, n, generator=None: [0])
    cfg = demo_run.DemoConfig(sample_chars=10, prompt="def ")
    for con in (
        Console(file=io.StringIO(), width=100),
        Console(file=io.StringIO(), width=100, markup=False),
    ):  # a user's console too
        sample = demo_run._sample(torch.nn.Identity(), Corpus(), cfg, torch.Generator(), con)  # type: ignore[arg-type]
        shown = con.file.getvalue()  # type: ignore[attr-defined]
        assert "dict[str, Any]" in sample and "def load(path: str) -> dict[str, Any]:" in shown
        assert "return [bold]{}[/bold]" in shown


def test_doctor_findings_keep_argument_labels_on_any_console() -> None:
    from torchspan.diagnosis import Finding, Report, TensorArg

    report = Report()
    arg = TensorArg(
        "tensors[1]", "cuda:0", (2, 3), "torch.float32", "activation", "batch['x']", "from dict[str, Tensor]"
    )
    report.add(
        Finding(
            "x",
            "error",
            "cat of [cpu, cuda:0]",
            "move tensors[1] to cpu",
            where="model.blocks[0]",
            tensors=[arg],
        )
    )
    con = Console(file=io.StringIO(), width=160)  # markup on, as a user's console may be
    report.render(con)
    shown = con.file.getvalue()  # type: ignore[attr-defined]
    for text in (
        "tensors[1]",
        "dict[str, Tensor]",
        "cat of [cpu, cuda:0]",
        "model.blocks[0]",
        "move tensors[1] to cpu",
    ):
        assert text in shown, text


def test_the_progress_bar_shows_its_label_as_given() -> None:
    from torchspan.progress import TrainingProgress

    con = Console(file=io.StringIO(), width=160, force_terminal=False)
    with TrainingProgress(con, 2, label="train [rank 0] {x}", speed_unit="tok/s [sum]") as bar:
        bar.step(loss=1.0, speed=10.0)
    shown = con.file.getvalue()  # type: ignore[attr-defined]
    assert "train [rank 0] {x}" in shown and "tok/s [sum]" in shown


def test_every_console_torchspan_makes_prints_without_markup() -> None:
    """A guard for new code: each ``Console(`` in the package says ``markup=False``, and no string is written
    as markup."""
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"\bConsole\(((?:[^()]|\([^()]*\))*)\)", text):
            if "markup=False" not in m.group(1):
                offenders.append(f"{path.relative_to(SRC)}: Console({m.group(1)})")
        offenders += [
            f"{path.relative_to(SRC)}: {m.group(0)}" for m in re.finditer(r"\[/(?:[a-z ]+)?\]", text)
        ]
    assert offenders == []

"""``torchspan plan`` and ``torchspan run`` with named keyword inputs (``--input NAME=SHAPE[:DTYPE]``) and
``--input-dtype``, as ``verify`` takes them: a keyword-only model and a tiny GPT-2."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from torchspan.cli import main

MODELS = textwrap.dedent(
    """
    import torch
    from torch import nn

    class KeywordOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.head = nn.Linear(8, 2)

        def forward(self, *, input_ids, attention_mask):
            h = self.embed(input_ids)
            for b in self.blocks:
                h = torch.tanh(b(h))
            return self.head(h * attention_mask.unsqueeze(-1))

    def keyword_only():
        torch.manual_seed(0)
        return KeywordOnly()

    def gpt2():
        import transformers

        torch.manual_seed(0)
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0,
            use_cache=False,
        )
        return transformers.GPT2LMHeadModel(cfg)
    """
)


@pytest.fixture()
def models(tmp_path: Path) -> str:
    path = tmp_path / "models.py"
    path.write_text(MODELS)
    return str(path)


def test_plan_takes_named_integer_inputs(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        f"{models}:keyword_only",
        "--input",
        "input_ids=8,5",
        "--input",
        "attention_mask=8,5",
        "--input-dtype",
        "int64",
        "--vocab",
        "10",
        "--devices",
        "cpu,cpu",
        "--json",
    ]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert "blocks.1" in [name for st in data["stages"] for name in st["layers"]] and data["batch_size"] == 8


def test_run_takes_named_inputs_and_reports_them(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "run",
        f"{models}:keyword_only",
        "--input",
        "input_ids=8,5:int64",
        "--input",
        "attention_mask=8,5:bool",
        "--vocab",
        "10",
        "--devices",
        "cpu",
        "--steps",
        "2",
        "--json",
    ]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"] == {"input_ids": [8, 5, "int64"], "attention_mask": [8, 5, "bool"]}
    assert data["input_shape"] is None and len(data["losses"]) == 2


@pytest.mark.parametrize("command", ["plan", "run"])
def test_input_errors_are_one_line(command: str, models: str, capsys: pytest.CaptureFixture[str]) -> None:
    target = f"{models}:keyword_only"
    assert main([command, target, "--input", "input_ids", "--devices", "cpu"]) == 2
    assert "NAME=SHAPE" in capsys.readouterr().err
    assert main([command, target, "--devices", "cpu"]) == 2
    assert "give the input" in capsys.readouterr().err
    assert (
        main([command, target, "--input-shape", "8,5", "--input", "input_ids=8,5:int64", "--devices", "cpu"])
        == 2
    )
    assert "not both" in capsys.readouterr().err
    assert main([command, target, "--input", "input_ids=8,5:int64", "--devices", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "the model rejects the keyword inputs input_ids=8,5:int64" in err and "set --input" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_plan_and_run_a_gpt2_with_named_inputs(
    models: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "plan.json"
    named = ["--input", "input_ids=4,8:int64", "--input", "attention_mask=4,8:int64", "--vocab", "50"]
    assert main(["plan", f"{models}:gpt2", *named, "--devices", "cpu,cpu", "--out", str(out), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert "transformer.h.0" in [
        name for st in planned["stages"] for name in st["layers"]
    ]  # blocks as layers
    assert main(["run", f"{models}:gpt2", *named, "--plan", str(out), "--steps", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"]["input_ids"] == [4, 8, "int64"] and all(map(lambda v: v == v, data["losses"]))

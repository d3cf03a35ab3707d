"""CLI probes from fuzzing (issue 29): ``torchspan verify`` on a transformers model as its config comes
(``use_cache`` left True), token ids past the model's embedding, ``torchspan launch`` without a script or with
a rank that exits on its own. Each either works or is one line naming the option and the fix (never a raw
traceback).

The multi-process verify row spawns gloo processes once for all its strategies (those of one process count
share one spawn); the launch row starts a real two-rank job (a few seconds).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchspan import cli

pytest.importorskip("transformers")

# a Llama as transformers builds it by default: use_cache=True, so its forward returns a DynamicCache
MODELS = textwrap.dedent(
    """
    import torch, transformers

    def llama():
        cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24,
                                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                       tie_word_embeddings=True)
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg)
    """
)

EXIT_7 = textwrap.dedent(
    """
    import os, sys, time
    if os.environ["RANK"] == "1":
        time.sleep(1)
        sys.exit(7)
    time.sleep(120)
    """
)


@pytest.fixture()
def models(tmp_path: Path) -> str:
    path = tmp_path / "hf_models.py"
    path.write_text(MODELS)
    return str(path)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code if isinstance(exc.code, int) else 2
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_line_error(code: int, err: str, command: str) -> str:
    assert code == 2 and "Traceback" not in err, err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and errors[0].startswith(f"torchspan {command}: error: "), err
    return errors[0]


# (id, arguments after the model file, words the one error line must contain)
REFUSED = [
    (
        "--vocab past the embedding",
        ["--input", "input_ids=4,6:int64", "--vocab", "1000"],
        "its input embedding has 40 rows: --vocab 40 or less",
    ),
    (
        "--vocab past the embedding, strategies",
        ["--input", "input_ids=4,6:int64", "--vocab", "1000", "--strategies", "single,dp"],
        "--vocab 40 or less",
    ),
    (
        "positional ids past the embedding",
        ["--input-shape", "4,6", "--input-dtype", "int64", "--vocab", "1000"],
        "set --input-shape/--input-dtype/--vocab to what its forward expects (its input embedding has 40 "
        "rows",
    ),
]


@pytest.mark.parametrize(("name", "args", "needle"), REFUSED, ids=[r[0] for r in REFUSED])
def test_verify_refuses_in_one_line(
    name: str, args: list[str], needle: str, models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _one_line_error(*_run(["verify", f"{models}:llama", *args], capsys)[::2], "verify")
    assert needle in line, line


def test_verify_runs_a_default_config_transformers_model(
    models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(
        [
            "verify",
            f"{models}:llama",
            "--input",
            "input_ids=4,6:int64",
            "--vocab",
            "40",
            "--microbatches",
            "2",
            "--strategies",
            "single,dp,fsdp,rank-pipeline",
            "--nproc-per-node",
            "2",
        ],
        capsys,
    )
    assert code == 0 and "Traceback" not in err + out, out + err
    for strategy in ("dp", "fsdp", "rank-pipeline"):
        assert f"{strategy} (2 processes): PASS" in out, out
    code, out, err = _run(
        ["verify", f"{models}:llama", "--input", "input_ids=4,6:int64", "--vocab", "40"], capsys
    )
    assert code == 0 and "PASS" in out, out + err


def test_launch_without_a_script_says_a_script_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["launch"], ["launch", "--nproc-per-node", "2"]):
        line = _one_line_error(*_run(argv, capsys)[::2], "launch")
        assert (
            "a training script is required" in line
            and "SCRIPT.py [script args]" in line
            and "script_args" not in line
        ), line


@pytest.mark.slow
def test_launch_names_the_rank_it_stopped_after_another_exited(tmp_path: Path) -> None:
    script = tmp_path / "exit7.py"
    script.write_text(EXIT_7)
    done = subprocess.run(
        [sys.executable, "-m", "torchspan", "launch", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    report = done.stderr[done.stderr.index("torchspan launch: rank 1") :]
    assert "of exit7.py failed with exit code 7" in report.splitlines()[0], report
    assert (
        "rank 0 was stopped by the launcher after rank 1 failed" in report.splitlines()
        and "also failed" not in report
    ), report

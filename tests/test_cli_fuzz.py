"""Bad input to every subcommand: one ``torchspan <cmd>: error:`` line, exit 2 (3 for doctor's device
findings), no traceback.

Table-driven (issue 10 item 6): each row is a command line with the kind of mistake it makes and,
where the message matters, words it must contain. Rows run in-process through ``cli.main`` (a few
through the real console script at the end), each within a time bound.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from torchspan import cli

SECONDS = 30.0  # per case (2 shared cores): every one of these fails before any training or long profiling

MODELS = """
import torch
from torch import nn

def lin():
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))

def noparams():
    return nn.Sequential(nn.ReLU(), nn.Tanh())

def raises():
    raise RuntimeError("factory exploded")

def emb():
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))

not_a_model = 42
"""

DEVICE_ERROR_SCRIPT = """
import torch
from torch import nn
model = nn.Linear(3, 2).to("meta")
criterion = nn.CrossEntropyLoss(weight=torch.ones(2))
x, y = torch.randn(4, 3, device="meta"), torch.zeros(4, dtype=torch.long, device="meta")
loss = criterion(model(x), y)
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cli.build_parser()  # imports every command once, outside the cases' time bound
    d = tmp_path_factory.mktemp("fuzz")
    (d / "models.py").write_text(textwrap.dedent(MODELS))
    (d / "broken.py").write_text("def build(:\n    return None\n")
    (d / "binary.py").write_bytes(b"\x00\x01\x02 not python")
    (d / "device_error.py").write_text(textwrap.dedent(DEVICE_ERROR_SCRIPT))
    (d / "existing.txt").write_text("a file, not a folder\n")
    (d / "empty_benchmarks").mkdir()
    good = {
        "format": 1,
        "layers": ["0", "1", "2"],
        "microbatches": 1,
        "schedule": "gpipe",
        "checkpoint": "never",
        "stages": [{"device": "cpu", "layers": ["0", "1", "2"]}],
    }
    text = json.dumps(good)
    (d / "truncated.json").write_text(text[: len(text) // 2])
    (d / "not_a_plan.json").write_text(json.dumps({"hello": "world"}))
    (d / "list.json").write_text("[1, 2, 3]")
    os.mkfifo(
        d / "pipe"
    )  # files (issue 19): a FIFO and a link to a device are refused, never written through
    (d / "null_link").symlink_to("/dev/null")
    return {
        k: str(v)
        for k, v in {
            "models": d / "models.py",
            "broken": d / "broken.py",
            "binary": d / "binary.py",
            "device_error": d / "device_error.py",
            "existing": d / "existing.txt",
            "dir": d,
            "empty_benchmarks": d / "empty_benchmarks",
            "truncated": d / "truncated.json",
            "not_a_plan": d / "not_a_plan.json",
            "list": d / "list.json",
            "fifo": d / "pipe",
            "null_link": d / "null_link",
        }.items()
    }


# (command line with {placeholders} from `files`, kind of mistake, words the error must contain)
CASES: list[tuple[str, str, str]] = [
    # devices
    ("devices nvidia", "unknown device", "unknown device"),
    ("devices cuda:99", "unknown device", "cuda:99"),
    ("devices cpu,,cpu", "malformed argument", "empty entry"),
    ("devices cpu*0", "zero count", "must be >= 1"),
    ("devices a100-80gb*1000000", "huge count", "at most 128"),
    ("devices a100-80gb*300", "huge count", "at most 128"),
    ("devices cpu --memory cpu", "malformed budget", "not DEV=SIZE"),
    ("devices cpu --memory cpu=ten", "malformed budget", "not a memory size"),
    ("devices cpu --memory cpu=-1GB", "negative number", "negative"),
    ("devices cpu --memory cpu=1e999GiB", "huge number", "infinite"),
    ("devices cpu --memory cuda:3=1GB", "budget for an unlisted device", "not in the device list"),
    ("devices cpu --bogus", "unknown option", "unrecognized arguments"),
    # doctor
    ("doctor", "missing argument", "required"),
    ("doctor {dir}/nope.py", "nonexistent file", "does not exist"),
    ("doctor {dir}", "folder for a file", "is a folder"),
    ("doctor {broken}", "script with a syntax error", "not valid Python"),
    ("doctor {binary}", "binary file", "SCRIPT"),
    ("doctor {existing}", "not a python file", "not valid Python"),
    ("doctor /dev/null", "device file for a script", "SCRIPT '/dev/null' is a character device"),
    ("doctor {fifo}", "FIFO for a script", "is a FIFO"),
    ("doctor --bogus {broken}", "unknown option", "unrecognized arguments"),
    ("doctor {broken} --json", "syntax error, options after the script", "not valid Python"),
    ("doctor {device_error}", "device finding", ""),
    # plan
    ("plan {models}:lin", "missing argument", "--input-shape"),
    ("plan {models}:lin --input-shape a,b", "malformed argument", "not a shape"),
    ("plan {models}:lin --input-shape 0,16", "zero number", "not a shape"),
    ("plan {models}:lin --input-shape 100000000000,16", "huge number", "Plan a smaller batch"),
    ("plan {dir}/nope.py:lin --input-shape 4,16", "nonexistent file", "does not exist"),
    ("plan {models}:nope --input-shape 4,16", "nonexistent factory", "has no attribute"),
    ("plan no.such.module:build --input-shape 4,16", "nonexistent module", "cannot import"),
    ("plan {models}:raises --input-shape 4,16", "factory that raises", "factory exploded"),
    ("plan {models}:not_a_model --input-shape 4,16", "factory that is no factory", "not_a_model"),
    ("plan {broken}:build --input-shape 4,16", "syntax error", "SyntaxError"),
    ("plan {models}:noparams --input-shape 4,16", "model without parameters", "without parameters"),
    ("plan {models}:lin --input-shape 4,17", "wrong shape", "the model rejects a batch of shape 4,17"),
    ("plan {models}:lin --input-shape 4,16 --devices nvidia", "unknown device", "unknown device"),
    (
        "plan {models}:lin --input-shape 4,16 --devices cpu --memory cpu=lots",
        "malformed budget",
        "not a memory size",
    ),
    ("plan {models}:lin --input-shape 4,16 --microbatches -1", "negative number", "--microbatches"),
    ("plan {models}:lin --input-shape 4,16 --dtype float99", "malformed argument", "not a torch dtype"),
    ("plan {models} --input-shape 4,16", "target without factory", "TARGET"),
    ("plan {models}:lin --input-shape 4,16 --out {dir}", "folder for a file", "is a folder"),
    ("plan {models}:lin --input-shape 4,16 --out {fifo}", "FIFO for a file", "is a FIFO"),
    (
        "plan {models}:lin --input-shape 4,16 --out {null_link}",
        "link to a device for a file",
        "is a character device",
    ),
    (
        "plan {models}:lin --input-shape 4,16 --out {existing}/plan.json",
        "output under a file",
        "nothing can be created under it",
    ),
    ("plan {models}:lin --input-shape -8,16", "negative number", "--input-shape '-8,16' is not a shape"),
    ("plan {models}:lin --input-shape -8x16", "negative number", "--input-shape '-8x16' is not a shape"),
    # run
    ("run {models}:lin", "missing argument", "--input-shape"),
    ("run {models}:lin --input-shape 4,16 --steps 0", "zero number", "--steps 0"),
    ("run {models}:lin --input-shape 4,16 --steps -3", "negative number", "--steps -3"),
    ("run {models}:lin --input-shape 4,16 --lr nan", "malformed number", "--lr"),
    ("run {models}:lin --input-shape -8,16", "negative number", "--input-shape '-8,16' is not a shape"),
    ("run {models}:lin --input-shape 4,16 --lr -1e-3", "negative number", "--lr -0.001"),
    ("run {models}:lin --input-shape 100000000000,16", "huge number", "Plan a smaller batch"),
    ("run {dir}/nope.py:lin --input-shape 4,16", "nonexistent file", "does not exist"),
    ("run {models}:raises --input-shape 4,16", "factory that raises", "factory exploded"),
    ("run {broken}:build --input-shape 4,16", "syntax error", "SyntaxError"),
    ("run {models}:noparams --input-shape 4,16", "model without parameters", "without parameters"),
    (
        "run {models}:emb --input-shape 4,3",
        "float ids into an embedding",
        "the model rejects a batch of shape 4,3 float32",
    ),
    ("run {models}:lin --input-shape 4,16 --devices meta,cpu", "device without data", "meta holds shapes"),
    ("run {models}:lin --input-shape 4,16 --devices nvidia", "unknown device", "unknown device"),
    ("run {models}:lin --input-shape 4,16 --devices cpu --memory cpu=", "malformed budget", "not DEV=SIZE"),
    ("run {models}:lin --input-shape 4,16 --plan {dir}/missing.json", "nonexistent plan", "does not exist"),
    (
        "run {models}:lin --input-shape 4,16 --plan {truncated}",
        "truncated plan JSON",
        "is not a torchspan plan",
    ),
    (
        "run {models}:lin --input-shape 4,16 --plan {not_a_plan}",
        "hand-edited plan JSON",
        "is not a torchspan plan",
    ),
    ("run {models}:lin --input-shape 4,16 --plan {list}", "hand-edited plan JSON", "is not a torchspan plan"),
    ("run {models}:lin --input-shape 4,16 --out {existing}", "file for a folder", "is a file"),
    (
        "run {models}:lin --input-shape 4,16 --out {existing}/run",
        "output under a file",
        "nothing can be created under it",
    ),
    (
        "run {models}:lin --input-shape 4,16 --out {null_link}",
        "link to a device for a folder",
        "is a character device",
    ),
    (
        "run {models}:lin --input-shape 4,16 --plan /dev/null",
        "device file for a plan",
        "--plan '/dev/null' is a character device",
    ),
    ("run {models}:lin --input-shape 4,16 --plan {dir}", "folder for a plan", "is a folder, not a plan file"),
    # verify
    ("verify {models}:lin", "missing argument", "--input"),
    ("verify {models}:lin --input-shape 4,x", "malformed argument", "--input-shape"),
    ("verify {models}:lin --input-shape 4,16 --microbatches 0", "zero number", "--microbatches 0"),
    ("verify {models}:lin --input-shape 100000000000,16", "huge number", "Plan a smaller batch"),
    ("verify {dir}/nope.py:lin --input-shape 4,16", "nonexistent file", "does not exist"),
    ("verify {models}:nope --input-shape 4,16", "nonexistent factory", "has no attribute"),
    ("verify {models}:raises --input-shape 4,16", "factory that raises", "factory exploded"),
    ("verify {broken}:build --input-shape 4,16", "syntax error", "SyntaxError"),
    ("verify {models}:noparams --input-shape 4,16", "model without parameters", "without parameters"),
    ("verify {models}:lin --input-shape 4,17", "wrong shape", "the model rejects a batch of shape 4,17"),
    (
        "verify {models}:lin --input-shape 4,16 --input-dtype int64",
        "integer dtype the model cannot take",
        "int64",
    ),
    ("verify {models}:lin --input-shape 4,16 --devices meta,cpu", "device without data", "meta holds shapes"),
    ("verify {models}:lin --input-shape 4,16 --devices nvidia", "unknown device", "nvidia"),
    ("verify {models}:lin --input-shape 4,16 --balance 1,x", "malformed argument", "--balance"),
    # issue 19: accepted and a wrong verdict (inf passes everything, nan nothing); PASS with nothing
    # data-parallel run
    (
        "verify {models}:lin --input-shape 4,16 --rtol inf",
        "infinite number",
        "--rtol inf must be a finite number >= 0",
    ),
    (
        "verify {models}:lin --input-shape 4,16 --atol nan",
        "malformed number",
        "--atol nan must be a finite number >= 0",
    ),
    ("verify {models}:lin --input-shape 4,16 --atol -1e-3", "negative number", "--atol -0.001 must be"),
    (
        "verify {models}:lin --input-shape 4,16 --strategies dp --nproc 1",
        "strategy it cannot run",
        "--nproc-per-node 2",
    ),
    (
        "verify {models}:lin --input-shape 4,16 --strategies single,rank-pipeline --nproc-per-node 1",
        "strategy it cannot run",
        "rank-pipeline with --nproc-per-node 1",
    ),
    # issue 19: argparse took "-8,16" for an option ("expected one argument"); negative values reach the
    # checks
    ("verify {models}:lin --input-shape -8,16", "negative number", "--input-shape '-8,16' is not a shape"),
    (
        "verify {models}:lin --input-shape 4,16 --balance -1,2",
        "negative number",
        "--balance '-1,2' needs positive integers",
    ),
    # demo
    ("demo --steps 0 --out {dir}/demo", "zero number", "--steps 0"),
    ("demo --steps -5 --out {dir}/demo", "negative number", "--steps -5"),
    ("demo --steps many", "malformed number", "invalid int value"),
    ("demo --out {existing}", "file for a folder", "is a file"),
    ("demo --out {existing}/demo", "output under a file", "nothing can be created under it"),
    ("demo --out {fifo}", "FIFO for a folder", "is a FIFO"),
    ("demo --devices nvidia --out {dir}/demo", "unknown device", "unknown device"),
    ("demo --devices cpu --memory cpu=abc --out {dir}/demo", "malformed budget", "not a memory size"),
    ("demo --devices cpu --memory cpu=1e999GiB --out {dir}/demo", "huge number", "infinite"),
    ("demo --microbatches 0 --out {dir}/demo", "zero number", "--microbatches"),
    ("demo --schedule sideways", "malformed argument", "invalid choice"),
    # bench
    ("bench --timeout 0", "zero number", "--timeout"),
    ("bench --timeout -1", "negative number", "--timeout"),
    ("bench --timeout soon", "malformed number", "invalid float value"),
    ("bench --dir {dir}/nope", "nonexistent folder", "is not a folder"),
    ("bench --dir {existing}", "file for a folder", "is not a folder"),
    ("bench --dir {empty_benchmarks}", "empty folder", "no benchmark scripts"),
    ("bench --dir {empty_benchmarks} --only nope", "nonexistent benchmark", "no such benchmark"),
    ("bench --bogus", "unknown option", "unrecognized arguments"),
]

LAUNCH_CASES: list[tuple[str, str, str]] = [
    ("launch", "missing argument", "required"),
    ("launch {dir}/nope.py", "nonexistent file", "does not exist"),
    ("launch {dir}", "folder for a script", "is a folder, not a Python file"),
    ("launch /dev/null", "device file for a script", "is a character device"),
    ("launch --nproc-per-node 0 {device_error}", "zero number", "--nproc-per-node"),
    ("launch --nproc-per-node many {device_error}", "malformed number", "--nproc-per-node"),
    ("launch --nnodes 0 {device_error}", "zero number", "--nnodes"),
    ("launch --node-rank 5 {device_error}", "number out of range", "--node-rank"),
    ("launch --node-rank -1 {device_error}", "negative number", "--node-rank"),
    ("launch --master-port 70000 {device_error}", "huge number", "--master-port"),
    ("launch --max-restarts -1 {device_error}", "negative number", "--max-restarts"),
    ("launch --rdzv-endpoint nowhere {device_error}", "malformed argument", "HOST:PORT"),
    (
        "launch --rdzv-endpoint node0:29400 --master-port 29500 {device_error}",
        "conflicting options",
        "not both",
    ),
]
if "launch" in cli.COMMANDS:
    CASES += LAUNCH_CASES


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code if isinstance(exc.code, int) else 2
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    ("line", "kind", "needle"), CASES, ids=[f"{c[0].split()[0]}: {c[1]}: {c[0]}" for c in CASES]
)
def test_bad_input_is_one_line_error(
    line: str,
    kind: str,
    needle: str,
    files: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # nothing a failing command writes lands in the checkout
    argv = [word.format(**files) for word in line.split()]
    start = time.perf_counter()
    code, out, err = _run(argv, capsys)
    took = time.perf_counter() - start
    command = argv[0] if argv else ""
    assert "Traceback" not in err + out, err
    assert took < SECONDS, f"{line} took {took:.1f} s"
    if kind == "device finding":
        assert code == 3 and "[error]" in out and "fix:" in out
        return
    assert code == 2, (code, err)
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and errors[0].startswith(f"torchspan {command}: error: "), err
    assert needle in errors[0], errors[0]


def test_every_subcommand_has_eight_kinds_of_bad_input() -> None:
    kinds: dict[str, set[str]] = {}
    for line, kind, _ in CASES:
        kinds.setdefault(line.split()[0], set()).add(kind)
    commands = [c for c in cli.COMMANDS if c in cli.build_parser()._subparsers._group_actions[0].choices]  # type: ignore[union-attr]
    assert set(commands) <= set(kinds), set(commands) - set(kinds)
    assert {c: len(k) for c, k in kinds.items() if len(k) < 8} == {}


def _console_script() -> list[str]:
    found = shutil.which(
        "torchspan", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    )
    return [found] if found else [sys.executable, "-m", "torchspan"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["devices", "a100-80gb*1000000"], "at most 128"),
        (["doctor", "{broken}", "--json"], "not valid Python"),
    ],
)
def test_console_script_prints_one_line(argv: list[str], needle: str, files: dict[str, str]) -> None:
    proc = subprocess.run(
        [*_console_script(), *(a.format(**files) for a in argv)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(
        f"torchspan {argv[0]}: error: "
    )
    assert needle in proc.stderr


def test_negative_values_are_joined_to_their_option_only() -> None:
    from torchspan.commands._common import join_negative_values

    parser = cli.build_parser()
    assert join_negative_values(parser, ["plan", "m.py:f", "--input-shape", "-8,16", "--json"]) == [
        "plan",
        "m.py:f",
        "--input-shape=-8,16",
        "--json",
    ]
    assert join_negative_values(parser, ["run", "m.py:f", "--lr", "-1e-3", "--steps", "3"]) == [
        "run",
        "m.py:f",
        "--lr=-1e-3",
        "--steps",
        "3",
    ]
    unchanged = [
        ["plan", "m.py:f", "--json", "-8"],  # a flag takes no value: left for argparse to refuse
        ["plan", "m.py:f", "--", "--input-shape", "-8,16"],  # after -- nothing is an option
        ["launch", "train.py", "--input-shape", "-8,16"],  # the script's own arguments
        ["plan", "m.py:f", "--input-shape=-8,16"],
    ]
    for argv in unchanged:
        assert join_negative_values(parser, argv) == argv

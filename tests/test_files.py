"""Files torchspan writes and reads (issue 19, items 1 and 8): atomic writes into a link's real target,
anything but a regular file refused before any work, outputs checked before training, interrupted writes'
temporaries cleaned up, checkpoints loaded safely (weights only) with ``trusted=True`` the opt-in.

Device nodes are only ever reached through a symbolic link in ``tmp_path`` (``link -> /dev/null``): code that
replaced the link's path instead of refusing would replace the link, never the device.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from torchspan import cli
from torchspan.planner.plans import Plan, StagePlan
from torchspan.runtime.ranks import load_checkpoint, save_checkpoint

MODELS = """
from torch import nn

def lin():
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
"""


def _plan() -> Plan:
    return Plan([StagePlan("cpu", ["a"])])


def _is_char_device(path: str) -> bool:
    return stat.S_ISCHR(os.stat(path).st_mode)


@pytest.fixture()
def models(tmp_path: Path) -> str:
    path = tmp_path / "models.py"
    path.write_text(textwrap.dedent(MODELS))
    return str(path)


@pytest.fixture()
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


@pytest.fixture()
def null_link(tmp_path: Path) -> Path:
    link = tmp_path / "null.json"
    link.symlink_to("/dev/null")
    return link


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # pragma: no cover - argparse's own errors
        code = exc.code if isinstance(exc.code, int) else 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def _one_error_line(err: str, command: str) -> str:
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1 and lines[0].startswith(f"torchspan {command}: error: "), err
    return lines[0]


# --------------------------------------------------------------------------- symbolic links


def test_a_symlink_is_written_through_to_its_target(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    for name, write in (
        ("plan.json", lambda p: _plan().save(p)),
        ("ckpt.pt", lambda p: save_checkpoint(p, {"step": 3})),
    ):
        target = real / name
        target.write_text("old")
        link = tmp_path / f"link-{name}"
        link.symlink_to(target)
        write(link)
        assert link.is_symlink() and os.readlink(link) == str(target)  # still a link
        assert target.read_bytes() != b"old"  # its target holds the new contents
    assert Plan.load(tmp_path / "link-plan.json") == _plan()
    assert load_checkpoint(tmp_path / "link-ckpt.pt") == {"step": 3}
    assert sorted(p.name for p in real.iterdir()) == [
        "ckpt.pt",
        "plan.json",
    ]  # no temporary left in the real folder


def test_a_dangling_symlink_creates_its_target(tmp_path: Path) -> None:
    from torchspan.pictures import loss_png

    (tmp_path / "pics").mkdir()
    for name, write in (
        ("loss.png", lambda p: loss_png([3.0, 2.0, 1.0], p)),
        ("plan.json", lambda p: _plan().save(p)),
    ):
        link = tmp_path / name
        link.symlink_to(tmp_path / "pics" / name)
        write(link)
        assert link.is_symlink() and (tmp_path / "pics" / name).stat().st_size > 0
    assert Plan.load(tmp_path / "plan.json") == _plan()


# --------------------------------------------------------------------------- not a regular file


def test_plan_save_refuses_a_device_a_fifo_and_a_folder(tmp_path: Path, fifo: Path, null_link: Path) -> None:
    with pytest.raises(ValueError, match=r"is a character device \(where its link points: '/dev/null'\)"):
        _plan().save(null_link)
    assert null_link.is_symlink() and _is_char_device("/dev/null")
    with pytest.raises(ValueError, match="is a FIFO"):
        _plan().save(fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="is a folder"):
        _plan().save(tmp_path / "folder")


def test_checkpoints_and_pictures_refuse_what_is_not_a_regular_file(
    tmp_path: Path, fifo: Path, null_link: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchspan.pictures import loss_png

    saved: list[object] = []
    monkeypatch.setattr(torch, "save", lambda *a, **k: saved.append(a))
    for path in (fifo, null_link, tmp_path):
        with pytest.raises(ValueError, match=r"path=.* is a (FIFO|character device|folder)"):
            save_checkpoint(path, {"step": 1})
    assert saved == []  # refused before anything was serialized
    drawn: list[object] = []
    import torchspan.pictures.loss as loss_module

    monkeypatch.setattr(loss_module, "pyplot", lambda: drawn.append(1))
    with pytest.raises(ValueError, match="is a FIFO"):
        loss_png([1.0], fifo)
    assert drawn == []  # refused before drawing
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and null_link.is_symlink()


def test_output_checks_name_what_is_there() -> None:
    from torchspan.files import output_file, output_folder

    with pytest.raises(
        ValueError, match=r"^--out '/dev/null' is a character device; torchspan writes only regular files"
    ):
        output_file("/dev/null", name="--out")
    with pytest.raises(ValueError, match=r"^out='/dev/null' is a character device; name a folder"):
        output_folder("/dev/null", name="out")


def test_plan_out_fifo_refused_before_profiling(
    models: str, fifo: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchspan.commands.plan as plan_command

    monkeypatch.setattr(
        plan_command,
        "build_model",
        lambda target: pytest.fail("the model was built: --out was not checked first"),
    )
    code, err = _cli(
        ["plan", f"{models}:lin", "--input-shape", "4,16", "--devices", "cpu", "--out", str(fifo)], capsys
    )
    assert code == 2 and "--out" in _one_error_line(err, "plan") and "is a FIFO" in err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_plan_out_symlink_writes_its_target(
    models: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "plans" / "p.json"
    target.parent.mkdir()
    link = tmp_path / "plan.json"
    link.symlink_to(target)
    code, _ = _cli(
        ["plan", f"{models}:lin", "--input-shape", "4,16", "--devices", "cpu", "--out", str(link)], capsys
    )
    assert code == 0 and link.is_symlink() and Plan.load(target).layers == ["0", "1", "2"]


# --------------------------------------------------------------------------- checked before training


def test_run_out_under_a_file_is_refused_before_training(
    models: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchspan.commands.run as run_command

    (tmp_path / "results").write_text("a file")
    steps: list[int] = []
    real_train = run_command.train
    monkeypatch.setattr(run_command, "train", lambda *a, **k: steps.append(1) or real_train(*a, **k))
    argv = ["run", f"{models}:lin", "--input-shape", "4,16", "--devices", "cpu", "--steps", "2"]
    start = time.perf_counter()
    code, err = _cli([*argv, "--out", str(tmp_path / "results" / "run1")], capsys)
    line = _one_error_line(err, "run")
    assert code == 2 and steps == [] and time.perf_counter() - start < 30
    assert (
        f"--out '{tmp_path / 'results' / 'run1'}'" in line
        and "is a regular file, so nothing can be created under it" in line
    )

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "run.json").mkdir()  # a folder where run.json goes
    code, err = _cli([*argv, "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and steps == [] and "run.json" in _one_error_line(err, "run") and "is a folder" in err


def test_demo_out_under_a_file_is_refused_before_training(tmp_path: Path) -> None:
    from torchspan.demo.run import run_demo

    (tmp_path / "f").write_text("a file")
    start = time.perf_counter()
    with pytest.raises(
        ValueError, match=r"^out='.*f/report'.*is a regular file, so nothing can be created under it"
    ):
        run_demo(devices="cpu", steps=1, out=tmp_path / "f" / "report")
    assert time.perf_counter() - start < 10


# --------------------------------------------------------------------------- interrupted writes


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _host() -> str:
    import re
    import socket

    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:32] or "host"


def test_an_interrupted_writes_temporary_is_removed_by_the_next_save(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"step": 1})
    stale = tmp_path / f".ckpt.pt.torchspan.{_dead_pid()}.0badf00d.{_host()}.tmp"
    stale.write_bytes(b"\0" * 4096)  # what a killed writer leaves
    old_style = (
        tmp_path / ".ckpt.pt.k3j_9x2a.tmp"
    )  # the mkstemp name of earlier versions, from a job before this one
    old_style.write_bytes(b"\0" * 16)
    os.utime(old_style, (time.time() - 3600, time.time() - 3600))
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = tmp_path / f".ckpt.pt.torchspan.{live.pid}.0badf00d.{_host()}.tmp"  # a writer still at work
        busy.write_bytes(b"\0")
        elsewhere = (
            tmp_path / ".ckpt.pt.torchspan.1.0badf00d.other-node.tmp"
        )  # another machine's, written just now
        elsewhere.write_bytes(b"\0")
        other = tmp_path / f".other.pt.torchspan.{_dead_pid()}.0badf00d.{_host()}.tmp"  # another checkpoint's
        other.write_bytes(b"\0")
        save_checkpoint(path, {"step": 2})
        assert not stale.exists() and not old_style.exists()
        assert busy.exists() and elsewhere.exists() and other.exists()
    finally:
        live.kill()
        live.wait()
    assert load_checkpoint(path) == {"step": 2}


def test_load_removes_a_dead_writers_temporary(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"step": 1})
    stale = tmp_path / f".ckpt.pt.torchspan.{_dead_pid()}.12345678.{_host()}.tmp"
    stale.write_bytes(b"\0" * 4096)
    assert load_checkpoint(path) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


# --------------------------------------------------------------------------- safe loading


class _Marker:
    """Unpickling this calls ``os.system`` (what a crafted checkpoint would do)."""

    def __init__(self, marker: Path) -> None:
        self.command = f"touch {shlex.quote(str(marker))}"

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (self.command,))


def test_a_crafted_checkpoint_runs_no_code(tmp_path: Path) -> None:
    marker, path = tmp_path / "pwned", tmp_path / "evil.pt"
    torch.save({"model": {}, "step": _Marker(marker)}, path)
    with pytest.raises(ValueError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "system" in message
    assert f"load_checkpoint({str(path)!r}, trusted=True)" in message
    assert not marker.exists()


def test_trusted_loads_what_the_safe_loader_refuses(tmp_path: Path) -> None:
    import argparse

    path = tmp_path / "ns.pt"
    with pytest.warns(
        UserWarning, match=r"argparse.Namespace: load_checkpoint refuses such objects unless trusted=True"
    ):
        save_checkpoint(path, {"args": argparse.Namespace(lr=0.1), "step": 2})
    with pytest.raises(ValueError, match="needs argparse.Namespace.*trusted=True"):
        load_checkpoint(path)
    assert load_checkpoint(path, trusted=True)["args"].lr == 0.1  # type: ignore[index]


def test_everything_torchspan_saves_loads_safely(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 7,
        "loss": 0.25,
        "name": "run-1",
        "losses": [1.0, 0.5],
        "shape": (2, 3),
        "meta": torch.empty(2, device="meta"),
        "rng": torch.get_rng_state(),
        "torchspan_ranks": None,
        "none": None,
    }
    state.pop("torchspan_ranks")
    loads: list[bool] = []
    real_load = torch.load
    monkeypatch.setattr(
        torch, "load", lambda *a, **k: loads.append(k.get("weights_only")) or real_load(*a, **k)
    )
    save_checkpoint(tmp_path / "c.pt", state)
    back = load_checkpoint(tmp_path / "c.pt")
    assert loads == [True]
    assert back is not None and back["step"] == 7 and back["name"] == "run-1" and back["shape"] == (2, 3)
    assert back["meta"].is_meta and list(back["model"]) == list(model.state_dict())
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    fresh.load_state_dict(back["optimizer"])


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_a_damaged_checkpoint_is_named_in_one_line(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"w": torch.ones(1000), "step": 1})
    data = path.read_bytes()
    path.write_bytes(
        {"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"not a checkpoint " * 20}[damage]
    )
    for kwargs in ({}, {"trusted": True}):
        with pytest.raises(ValueError) as info:
            load_checkpoint(path, **kwargs)
        message = str(info.value)
        assert "\n" not in message and str(path) in message and "corrupt or truncated" in message, message
        assert "restore it from a copy or delete it" in message


def test_load_refuses_a_folder_or_device(tmp_path: Path, null_link: Path, fifo: Path) -> None:
    with pytest.raises(ValueError, match="is a folder, not a checkpoint file"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="is a character device, not a checkpoint file"):
        load_checkpoint(null_link)
    with pytest.raises(ValueError, match="is a FIFO"):
        load_checkpoint(fifo)  # refused, not a read that waits for a writer forever


# --------------------------------------------------------------------------- two ranks


def _ranks_worker(rank: int, world: int, port: int, folder: str) -> None:
    import torchspan
    from torchspan.runtime.ranks import init_distributed

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    init_distributed(timeout=20)
    try:  # a folder the writer cannot use: every rank refuses, none waits at a barrier for the writer
        save_checkpoint(Path(folder, "missing", "pp.pt"), {"step": 0})
        raise AssertionError("save_checkpoint into a missing folder did not raise")
    except ValueError as exc:
        assert (
            "does not exist; create it first"
            if rank == 0
            else "rank 0, which writes the checkpoint, cannot write it"
        ) in str(exc)
    torch.manual_seed(0)
    spanned = torchspan.span(
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), balance=[2, 1], microbatches=2
    )
    opt = torch.optim.Adam(spanned.parameters(), lr=0.1)
    spanned.train_step(torch.randn(6, 4), torch.randn(6, 3), nn.MSELoss())
    opt.step()
    path = Path(folder, "pp.pt")
    save_checkpoint(
        path,
        {
            "model": spanned.state_dict(),
            "optimizer": opt.state_dict(),
            "step": 1,
            "note": "pp",
            "losses": [0.5],
        },
    )
    loads: list[object] = []
    real_load = torch.load
    torch.load = lambda *a, **k: loads.append(k.get("weights_only")) or real_load(*a, **k)  # type: ignore[assignment]
    state = load_checkpoint(path)
    torch.load = real_load
    assert loads == [True], loads  # the safe loader read the per-rank layout
    assert state is not None and state["step"] == 1 and state["note"] == "pp" and state["losses"] == [0.5]
    spanned.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_a_pipeline_checkpoint_loads_safely_on_two_ranks(tmp_path: Path) -> None:
    from test_ranks_pipeline import _spawn

    from torchspan.runtime.ranks import free_port

    _spawn(_ranks_worker, 2, free_port(), str(tmp_path), deadline=60.0)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "pp.pt") == []

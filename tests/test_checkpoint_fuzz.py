"""Checkpoints that lose nothing (issue 29, the checkpoint half): each test is a defect fuzzing found.

- A checkpoint folder keeps what is not torchspan's: a user's file (``NOTES.md``, a folder of notes) and what
  ``export_safetensors(ckpt, ckpt)`` wrote there outlive later saves, and a save killed midway (its writer
  raising, interrupted right before or inside the swap, the process SIGKILLed) leaves them and the previous
  checkpoint whole.
- A load is complete or refused: a folder missing a part (``values.pt`` or a value in it, ``torchspan.json``,
  ``.metadata``, a ``.distcp`` shard, a shard cut short), a key asked for that the checkpoint lacks (one file,
  a folder, a folder ``dcp.save`` wrote) and a checkpoint with keys the model lacks (one file, a folder) each
  raise one ``ValueError`` naming the path, the key or part, and the fix; ``strict=False`` loads the keys both
  have.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from torchspan import files
from torchspan.runtime.ranks import export_safetensors, load_checkpoint, save_checkpoint

OWN = [".metadata", "__0_0.distcp", "torchspan.json", "values.pt"]
NOTE = "# my run\nlr 0.1 diverged at step 900\n"


def _mlp(layers: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    modules: list[nn.Module] = []
    for _ in range(layers):
        modules += [nn.Linear(4, 4), nn.ReLU()]
    return nn.Sequential(*modules[:-1])


def _trained(layers: int = 2, seed: int = 0) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    model = _mlp(layers, seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} changed by a load that was refused"


def _with_notes(ckpt: Path) -> None:
    (ckpt / "NOTES.md").write_text(NOTE)
    (ckpt / "notes").mkdir()
    (ckpt / "notes" / "plot.txt").write_text("loss curve")


def _notes_intact(ckpt: Path) -> None:
    assert (ckpt / "NOTES.md").read_text() == NOTE
    assert (ckpt / "notes" / "plot.txt").read_text() == "loss curve"


# ------------------------------------------------------------------------ a folder keeps what is not its own


def test_a_users_files_in_a_checkpoint_folder_outlive_saves(tmp_path: Path) -> None:
    model, opt = _trained()
    ckpt = tmp_path / "keep"
    save_checkpoint(ckpt, {"model": model, "optimizer": opt, "step": 1})
    _with_notes(ckpt)
    save_checkpoint(ckpt, {"model": model, "optimizer": opt, "step": 2})
    save_checkpoint(ckpt, {"model": model, "optimizer": opt, "step": 3})
    assert sorted(p.name for p in ckpt.iterdir()) == sorted([*OWN, "NOTES.md", "notes"])
    _notes_intact(ckpt)
    assert load_checkpoint(ckpt)["step"] == 3  # type: ignore[index]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]  # no temporary, no previous folder left


def test_an_export_into_the_checkpoint_folder_outlives_saves(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    model, opt = _trained()
    ckpt = tmp_path / "keep"
    save_checkpoint(ckpt, {"model": model, "optimizer": opt, "step": 1})
    export_safetensors(ckpt, ckpt, config={"architectures": ["MLP"], "model_type": "mlp"})
    exported = {name: (ckpt / name).read_bytes() for name in ("model.safetensors", "config.json")}
    save_checkpoint(ckpt, {"model": model, "optimizer": opt, "step": 2})
    assert sorted(p.name for p in ckpt.iterdir()) == sorted([*OWN, "config.json", "model.safetensors"])
    assert {name: (ckpt / name).read_bytes() for name in exported} == exported
    assert load_checkpoint(ckpt)["step"] == 2  # type: ignore[index]


def _writer_raises(
    ckpt: Path, model: nn.Module, opt: torch.optim.Optimizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    def half_written(self, plan, planner):  # type: ignore[no-untyped-def]
        Path(self.path, "__0_0.distcp").write_bytes(b"half a shard")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", half_written)
    with pytest.raises(RuntimeError, match="No space left on device.*nothing was replaced"):
        save_checkpoint(ckpt, {"model": model, "optimizer": opt, "step": 3})


def _interrupted_before_the_swap(
    ckpt: Path, model: nn.Module, opt: torch.optim.Optimizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(a: Path, b: Path) -> bool:
        raise KeyboardInterrupt  # the user's files are carried into the new folder, the swap never happens

    monkeypatch.setattr(files, "_exchange", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(ckpt, {"model": model, "optimizer": opt, "step": 3})


def _interrupted_between_the_renames(
    ckpt: Path, model: nn.Module, opt: torch.optim.Optimizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_rename = os.rename

    def die_between(src, dst):  # type: ignore[no-untyped-def]
        real_rename(src, dst)
        if str(dst).endswith(".old"):
            # the previous folder (with the user's files) is aside, the new one not in
            raise KeyboardInterrupt

    monkeypatch.setattr(
        files, "_exchange", lambda a, b: False
    )  # a filesystem without renameat2(RENAME_EXCHANGE)
    monkeypatch.setattr(os, "rename", die_between)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(ckpt, {"model": model, "optimizer": opt, "step": 3})
    monkeypatch.undo()
    aside = [p for p in ckpt.parent.iterdir() if p.name.endswith(".old")]
    assert not ckpt.exists() and len(aside) == 1
    aside[0].rename(
        aside[0].with_name(aside[0].name.replace(f".{os.getpid()}.", ".999999999.", 1))
    )  # as a dead writer left it


_KILLED = """
import sys, time
from pathlib import Path
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torchspan.runtime.ranks import save_checkpoint

ckpt, marker = Path(sys.argv[1]), Path(sys.argv[2])
model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

def stalled(self, plan, planner):
    Path(self.path, "__0_0.distcp").write_bytes(b"half a shard")
    marker.write_text(str(self.path))
    time.sleep(600)  # SIGKILLed here

FileSystemWriter.write_data = stalled
save_checkpoint(ckpt, {"model": model, "step": 3})
"""


def _process_killed(
    ckpt: Path, model: nn.Module, opt: torch.optim.Optimizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = ckpt.parent / "writing"
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_KILLED), str(ckpt), str(marker)])
    try:
        start = time.monotonic()
        while not marker.exists():
            assert child.poll() is None, f"the saving process ended ({child.returncode}) before it wrote"
            assert time.monotonic() - start < 120, "the saving process never reached its writer"
            time.sleep(0.1)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    temporary = Path(marker.read_text())
    marker.unlink()
    assert (
        temporary.is_dir() and temporary.parent == ckpt.parent
    )  # what the kill left; the next load removes it


KILLS = [_writer_raises, _interrupted_before_the_swap, _interrupted_between_the_renames, _process_killed]


@pytest.mark.parametrize("kill", KILLS, ids=lambda f: f.__name__.strip("_"))
def test_a_save_killed_midway_keeps_the_users_files_and_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill
) -> None:  # type: ignore[no-untyped-def]
    model, opt = _trained()
    ckpt = tmp_path / "keep"
    save_checkpoint(ckpt, {"model": model, "optimizer": opt, "step": 1})
    _with_notes(ckpt)
    save_checkpoint(ckpt, {"model": model, "optimizer": opt, "step": 2})
    kill(ckpt, model, opt, monkeypatch)
    monkeypatch.undo()
    fresh, fresh_opt = _trained(seed=1)
    state = load_checkpoint(ckpt, {"model": fresh, "optimizer": fresh_opt})  # undoes what the kill left first
    assert state is not None and state["step"] == 2
    _unchanged(fresh, _weights(model))
    _notes_intact(ckpt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]
    save_checkpoint(ckpt, {"model": model, "optimizer": opt, "step": 4})  # and the next save keeps them still
    _notes_intact(ckpt)
    assert load_checkpoint(ckpt)["step"] == 4  # type: ignore[index]


# ------------------------------------------------------------------------------- loads complete or refused


@pytest.mark.parametrize(
    "damage, message",
    [
        ("values.pt", r"values\.pt is missing.*'step'"),
        ("values without step", r"values\.pt lacks 'step', which its torchspan\.json lists"),
        ("torchspan.json", r"torchspan\.json is missing"),
        (".metadata", r"\.metadata is missing"),
        ("__0_0.distcp", r"'__0_0\.distcp'.* is missing"),
        ("truncated", r"'__0_0\.distcp' holds \d+ bytes.*lists \d+"),
    ],
)
def test_a_checkpoint_missing_a_part_is_refused(tmp_path: Path, damage: str, message: str) -> None:
    model, opt = _trained()
    ckpt = tmp_path / "keep"
    save_checkpoint(ckpt, {"model": model, "optimizer": opt, "step": 1})
    if damage == "truncated":
        shard = ckpt / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "values without step":
        torch.save({}, ckpt / "values.pt")
    else:
        (ckpt / damage).unlink()
    fresh, fresh_opt = _trained(seed=1)
    before = _weights(fresh)
    for state in ({"model": fresh, "optimizer": fresh_opt}, None):
        with pytest.raises(ValueError, match=message) as info:
            load_checkpoint(ckpt, state)
        text = str(info.value)
        assert "\n" not in text and f"load_checkpoint({str(ckpt)!r})" in text and "incomplete" in text, text
        assert "restore the folder from a copy" in text, text
    _unchanged(fresh, before)


def _file_named_net(tmp_path: Path) -> Path:
    model, opt = _trained()
    save_checkpoint(
        tmp_path / "net.pt", {"net": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}
    )
    return tmp_path / "net.pt"


def _folder_named_net(tmp_path: Path) -> Path:
    model, opt = _trained()
    save_checkpoint(tmp_path / "net", {"net": model, "optimizer": opt, "step": 1})
    return tmp_path / "net"


def _folder_dcp_wrote(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    model, opt = _trained()
    with pytest.warns(UserWarning):
        dcp.save(
            {"net": model.state_dict(), "optimizer": opt.state_dict(), "step": 1},
            checkpoint_id=tmp_path / "raw",
        )
    return tmp_path / "raw"


@pytest.mark.parametrize(
    "made", [_file_named_net, _folder_named_net, _folder_dcp_wrote], ids=lambda f: f.__name__.strip("_")
)
@pytest.mark.parametrize("asked", ["model", "epoch"])
def test_a_key_the_checkpoint_lacks_is_refused(tmp_path: Path, made, asked: str) -> None:  # type: ignore[no-untyped-def]
    path = made(tmp_path)
    fresh, fresh_opt = _trained(seed=1)
    before = _weights(fresh)
    state = (
        {"model": fresh, "optimizer": fresh_opt}
        if asked == "model"
        else {"net": fresh, "optimizer": fresh_opt, "epoch": 0}
    )
    with pytest.raises(
        ValueError, match=rf"the checkpoint has no '{asked}' \(it holds 'net', 'optimizer', 'step'\)"
    ) as info:
        load_checkpoint(path, state)
    text = str(info.value)
    assert "\n" not in text and f"load_checkpoint({str(path)!r})" in text and "name a key it holds" in text, (
        text
    )
    _unchanged(fresh, before)


@pytest.mark.parametrize("form", ["file", "folder"])
def test_keys_the_model_lacks_are_refused_unless_strict_is_false(tmp_path: Path, form: str) -> None:
    deep, deep_opt = _trained(layers=5)
    path = tmp_path / ("deep.pt" if form == "file" else "deep")
    save_checkpoint(path, {"model": deep.state_dict() if form == "file" else deep, "step": 1})
    shallow = _mlp(2, seed=1)
    before = _weights(shallow)
    with pytest.raises(
        ValueError,
        match=r"'model' has keys the model lacks \(unexpected: '4\.weight', '4\.bias', '6\.weight' and 3 "
        r"more\)",
    ) as info:
        load_checkpoint(path, {"model": shallow})
    text = str(info.value)
    assert "\n" not in text and f"load_checkpoint({str(path)!r}" in text and "strict=False" in text, text
    _unchanged(shallow, before)

    state = load_checkpoint(path, {"model": shallow}, strict=False)  # the keys both have
    assert state is not None and state["model"] is shallow and state["step"] == 1
    for key, value in shallow.state_dict().items():
        assert torch.equal(value, deep.state_dict()[key]), key

    save_checkpoint(path, {"model": shallow.state_dict() if form == "file" else shallow, "step": 2})
    wider = _mlp(
        3, seed=2
    )  # the checkpoint lacks keys of the model: refused, or left as they are with strict=False
    with pytest.raises(ValueError, match=r"lacks keys of the model \(missing: '4\.weight', '4\.bias'\)"):
        load_checkpoint(path, {"model": wider})
    kept = _weights(wider)["4.weight"]
    assert load_checkpoint(path, {"model": wider}, strict=False)["step"] == 2  # type: ignore[index]
    assert torch.equal(wider[0].weight, shallow[0].weight) and torch.equal(wider[4].weight, kept)

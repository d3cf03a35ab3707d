"""Checkpoints: written atomically (a failed save leaves the previous file whole), loaded anywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from torchspan.runtime.ranks import load_checkpoint, save_checkpoint


def test_round_trip_with_the_models_own_keys(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    path = tmp_path / "ckpt.pt"
    assert load_checkpoint(path) is None  # first start: nothing to resume
    assert save_checkpoint(path, {"model": model.state_dict(), "step": 4}) is True
    state = load_checkpoint(path)
    assert state is not None and state["step"] == 4 and list(state["model"]) == ["0.weight", "0.bias"]
    fresh = nn.Sequential(nn.Linear(3, 2))
    fresh.load_state_dict(state["model"])
    torch.testing.assert_close(fresh[0].weight, model[0].weight)


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"step": 1})

    def crash(obj: object, f: object, *args: object, **kwargs: object) -> None:
        f.write(b"half a checkpoint")  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"step": 2})
    monkeypatch.undo()
    assert load_checkpoint(path) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no temporary file left


def test_save_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist; create it first"):
        save_checkpoint(tmp_path / "missing" / "c.pt", {"step": 1})
    with pytest.raises(ValueError, match=r"writer=1 must be a rank in \[0, world size 1\)"):
        save_checkpoint(tmp_path / "c.pt", {"step": 1}, writer=1)
    with pytest.raises(TypeError, match="state=list must be a mapping"):
        save_checkpoint(tmp_path / "c.pt", [1])  # type: ignore[arg-type]
    (tmp_path / "other.pt").write_bytes(b"")
    torch.save([1, 2], tmp_path / "other.pt")
    with pytest.raises(ValueError, match="holds a list, not a checkpoint dict"):
        load_checkpoint(tmp_path / "other.pt")

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


def test_a_failed_save_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
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


def test_a_pipeline_checkpoint_is_refused_by_a_job_of_another_size(tmp_path: Path) -> None:
    path = tmp_path / "pp.pt"
    torch.save({"torchspan_ranks": [{"step": 3}, {"step": 3}], "world_size": 2}, path)
    with pytest.raises(
        ValueError, match="written by a pipeline job of 2 ranks .* this job has 1; resume it with 2 processes"
    ):
        load_checkpoint(path)


def _pipeline_checkpoint_worker(rank: int, world: int, port: int, path: str) -> None:
    import os

    from torch import nn

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
    init_distributed(timeout=30)

    def build(seed: int) -> torchspan.Spanned:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        return torchspan.span(model, balance=[2, 1], microbatches=2)

    spanned = build(0)
    opt = torch.optim.Adam(spanned.parameters(), lr=0.1)
    torch.manual_seed(5)
    spanned.train_step(torch.randn(6, 4), torch.randn(6, 3), nn.MSELoss())
    opt.step()
    save_checkpoint(path, {"model": spanned.state_dict(), "optimizer": opt.state_dict(), "step": 1})
    held = {n: p.detach().clone() for n, p in spanned.module.named_parameters() if not p.is_meta}
    assert held, "this rank holds no parameters"

    fresh = build(1)  # other weights: the checkpoint must bring this rank's stage back
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    state = load_checkpoint(path)
    assert state is not None and state["step"] == 1
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optimizer"])
    for n, p in fresh.module.named_parameters():
        if not p.is_meta:
            torch.testing.assert_close(p.detach(), held[n], rtol=0, atol=0)
    assert len(fresh_opt.state) == len(held)
    torch.distributed.barrier()  # leave together: gloo groups torn down at exit can abort a rank
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_a_pipeline_job_checkpoints_every_stage_in_one_file(tmp_path: Path) -> None:
    from test_ranks_pipeline import _spawn

    from torchspan.runtime.ranks import free_port

    path = tmp_path / "pp.pt"
    _spawn(_pipeline_checkpoint_worker, 2, free_port(), str(path))
    saved = torch.load(path, weights_only=False)
    assert saved["world_size"] == 2 and len(saved["torchspan_ranks"]) == 2
    stage1 = saved["torchspan_ranks"][1]["model"]
    assert not stage1["2.weight"].is_meta and stage1["0.weight"].is_meta  # rank 1 holds the last layer

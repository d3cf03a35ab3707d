"""A launched script that forgets ``torchspan.init_distributed()`` (issue 18, item 6).

``torchrun`` / ``torchspan launch`` set ``RANK``, ``WORLD_SIZE``, ... but open no process group.
``span``, ``shard_batch`` and ``rank_batches`` then join the job themselves (``init_distributed()``
with its defaults) instead of training one lone process per rank on a shard picked by ``RANK``; in
a DataLoader worker, where joining cannot be right, they refuse naming ``init_distributed()``.
Unit tests fake the launcher's variables; two real 2-rank gloo jobs check the training equals one
process on the whole batch (float64).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchspan
from torchspan.runtime.ranks import env as env_module
from torchspan.runtime.ranks import rank_batches, shard_batch, shard_range

LAUNCHED = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29533",
}


class Joined(Exception):
    """Raised by the fake init_distributed: the call under test tried to join the job."""


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The launcher's variables of rank 1 of 2, no process group, and an init_distributed that records its
    calls."""
    assert not dist.is_initialized()
    for key, value in LAUNCHED.items():
        monkeypatch.setenv(key, value)
    calls: list[str] = []

    def fake_init(*args: object, **kwargs: object) -> None:
        calls.append("init_distributed")
        raise Joined

    monkeypatch.setattr(env_module, "init_distributed", fake_init)
    return calls


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).double()


@pytest.mark.parametrize(
    "call",
    [
        lambda: torchspan.span(_model()),
        lambda: torchspan.span(_model(), balance=[2, 1]),
        lambda: shard_batch(torch.zeros(7, 3)),
        lambda: rank_batches(10, 4),
        lambda: shard_range(7),
    ],
    ids=["span", "span-pipeline", "shard_batch", "rank_batches", "shard_range"],
)
def test_a_launched_call_without_a_group_joins_the_job(launched: list[str], call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(Joined):
        call()
    assert launched == ["init_distributed"]


def test_explicit_ranks_and_bad_arguments_do_not_join(launched: list[str]) -> None:
    assert shard_batch(torch.arange(7), 1, 2).tolist() == [
        4,
        5,
        6,
    ]  # the caller said which rank: nothing to join
    assert rank_batches(5, 5, 0, 2) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="microbatches=0"):
        torchspan.span(_model(), microbatches=0)  # refused before any rendezvous
    assert launched == []


def test_a_world_of_one_or_no_launcher_stays_one_process(
    monkeypatch: pytest.MonkeyPatch, launched: list[str]
) -> None:
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    assert torchspan.span(_model()).mode == "sequential"
    assert shard_batch(torch.arange(3)).tolist() == [0, 1, 2]
    for key in LAUNCHED:
        monkeypatch.delenv(key)
    assert torchspan.span(_model()).mode == "sequential"
    assert launched == []


def test_a_dataloader_worker_refuses_naming_init_distributed(
    monkeypatch: pytest.MonkeyPatch, launched: list[str]
) -> None:
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())
    with pytest.raises(
        RuntimeError,
        match=r"torchspan.shard_batch ran in a DataLoader worker of rank 1 .*torchspan.init_distributed\(\)",
    ):
        shard_batch(torch.zeros(7, 3))
    assert launched == []


# ---------------------------------------------------------------------------------- real jobs
SCRIPT = """
import os
import sys
import torch
import torch.distributed as dist
from torch import nn
import torchspan

order, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).double()
g = torch.Generator().manual_seed(7)
x = torch.randn(7, 5, generator=g, dtype=torch.float64)
y = torch.randn(7, 4, generator=g, dtype=torch.float64)
if order == "shard-first":           # the data first: shard_batch joins the job
    xs, ys = torchspan.shard_batch((x, y))
    spanned = torchspan.span(model)
else:                                 # the model first: span joins the job
    spanned = torchspan.span(model)
    mine = torchspan.rank_batches(7, 7)[0]
    xs, ys = x[mine], y[mine]
opt = torch.optim.SGD(spanned.parameters(), lr=0.1)
losses = []
for _ in range(3):
    opt.zero_grad()
    losses.append(float(spanned.train_step(xs, ys, nn.MSELoss())))
    opt.step()
result = {"world": dist.get_world_size() if dist.is_initialized() else 1, "mode": spanned.mode,
          "losses": losses, "params": {k: v.detach() for k, v in model.state_dict().items()}}
if order == "span-first":            # a pipeline in the same job: every rank gets the whole batch
    torch.manual_seed(1)
    piped = torchspan.span(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).double(),
                           balance=[2, 1])
    piped.zero_grad()
    result["pipeline_loss"] = float(piped.train_step(x, y, nn.MSELoss()))
    result["pipeline_mode"] = piped.mode
    result["pipeline_grads"] = {k: p.grad for k, p in piped.module.named_parameters()
                                if p.device.type != "meta"}
torch.save(result, f"{out}.rank{os.environ['RANK']}")
"""


def _reference(x: torch.Tensor, y: torch.Tensor) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = nn.MSELoss()(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(7, 5, generator=g, dtype=torch.float64), torch.randn(
        7, 4, generator=g, dtype=torch.float64
    )


def _launch(launcher: list[str], order: str, tmp_path: Path) -> list[dict]:  # type: ignore[type-arg]
    script = tmp_path / "forgot_init.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [*launcher, str(script), order, str(tmp_path / "out")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(tmp_path / f"out.rank{r}") for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher, order",
    [
        ([sys.executable, "-m", "torchspan", "launch", "--nproc-per-node", "2"], "shard-first"),
        (
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
            "span-first",
        ),
    ],
    ids=["torchspan-launch-shard-first", "torchrun-span-first"],
)
def test_a_launched_script_without_init_trains_like_one_process(
    launcher: list[str], order: str, tmp_path: Path
) -> None:
    x, y = _data()
    want_losses, want = _reference(x, y)
    for rank, got in enumerate(_launch(launcher, order, tmp_path)):
        assert (got["world"], got["mode"]) == (2, "data-parallel"), (
            f"rank {rank}: {got['world']}, {got['mode']}"
        )
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(want_losses), rtol=1e-6, atol=1e-7
        )
        for key, value in want.items():
            torch.testing.assert_close(
                got["params"][key], value, rtol=1e-9, atol=1e-11, msg=lambda m: f"rank {rank}: {key}: {m}"
            )
        if order == "span-first":
            torch.manual_seed(1)
            reference = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).double()
            loss = nn.MSELoss()(reference(x), y)
            loss.backward()
            assert got["pipeline_mode"] == "sequential" and got["pipeline_loss"] == pytest.approx(
                loss.item(), rel=1e-6
            )
            ref = dict(reference.named_parameters())
            assert set(got["pipeline_grads"]) == (
                {"0.weight", "0.bias"} if rank == 0 else {"2.weight", "2.bias"}
            )
            for key, grad in got["pipeline_grads"].items():
                torch.testing.assert_close(grad, ref[key].grad, rtol=1e-10, atol=1e-12)

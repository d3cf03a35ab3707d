"""Bad calls to the public API (issue 19 item 9): each is one clear error naming the argument, or works.

Table-driven, like tests/test_cli_fuzz.py for the command line: every row is a call a careless
user makes, the exception type it must raise (never AttributeError, AssertionError,
NotImplementedError or a raw unpickling error) and words the one-line message must contain.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_model_loss import (
    _Returns,
)  # a module whose forward returns None or a float (tests/test_model_loss.py)
from torch import nn

import torchspan
from torchspan.parity_ranks import processes_for


class _RunsCode:
    """Unpickling this calls ``os.system``: a crafted checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _x() -> torch.Tensor:
    return torch.randn(6, 4)


def _y() -> torch.Tensor:
    return torch.randn(6, 2)


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _corrupt(tmp: Path) -> None:
    path = tmp / "ckpt.pt"
    path.write_bytes(b"PK\x03\x04 this is not a checkpoint")
    torchspan.load_checkpoint(str(path))


def _crafted(tmp: Path, raw: bool = False) -> None:
    path = tmp / "evil.pt"
    if raw:  # a plain pickle, protocol 5
        with open(path, "wb") as f:
            pickle.dump({"model": _RunsCode(tmp / "ran")}, f)
    else:  # what torch.save writes
        torch.save({"model": _RunsCode(tmp / "ran")}, path)
    try:
        torchspan.load_checkpoint(str(path))
    finally:
        assert not (tmp / "ran").exists(), "a crafted checkpoint ran code on load"


# (id, the call, exception type, words the message must contain)
CASES: list[tuple[str, Callable[[Path], Any], type[BaseException], str]] = [
    ("load_checkpoint of a corrupt file", _corrupt, ValueError, "ckpt.pt"),
    ("load_checkpoint of a crafted torch.save file", _crafted, ValueError, "trusted=True"),
    ("load_checkpoint of a crafted raw pickle", lambda t: _crafted(t, raw=True), ValueError, "evil.pt"),
    (
        "init_distributed with an unknown backend",
        lambda t: torchspan.init_distributed(backend="nosuch"),
        ValueError,
        "backend='nosuch'",
    ),
    (
        "init_distributed with a backend that is no string",
        lambda t: torchspan.init_distributed(backend=3),
        TypeError,
        "backend=3",
    ),  # type: ignore[arg-type]
    (
        "train_step without a target",
        lambda t: torchspan.span(_mlp()).train_step(_x(), None, nn.MSELoss()),
        ValueError,
        "target=None",
    ),
    (
        "forward returning None",
        lambda t: torchspan.span(_Returns("none")).train_step(_x(), _y(), nn.MSELoss()),
        ValueError,
        "forward returned None",
    ),
    (
        "forward returning a float",
        lambda t: torchspan.span(_Returns("float")).train_step(_x(), _y(), nn.MSELoss()),
        ValueError,
        "returned a float",
    ),
    (
        "a stage on meta then train_step",
        lambda t: torchspan.span(
            nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), devices=["cpu", "meta"]
        ).train_step(_x(), _y(), nn.MSELoss()),
        ValueError,
        "meta tensors hold shapes",
    ),
    (
        "rank_batches of a negative sample count",
        lambda t: torchspan.rank_batches(-5, 2, rank=0, world_size=1),
        ValueError,
        "-5",
    ),
    (
        "rank_batches with batch size 0",
        lambda t: torchspan.rank_batches(10, 0, rank=0, world_size=1),
        ValueError,
        "batch_size",
    ),
    ("verify dp with one process", lambda t: processes_for(["dp"], 1), ValueError, "--nproc-per-node 2"),
    ("verify fsdp with one process", lambda t: processes_for(["fsdp"], 1), ValueError, "--nproc-per-node 2"),
    (
        "verify rank-pipeline with one process",
        lambda t: processes_for(["rank-pipeline"], 1),
        ValueError,
        "--nproc-per-node 2",
    ),
    ("verify with an unknown strategy", lambda t: processes_for(["zero3"], 2), ValueError, "'zero3'"),
    (
        "span with microbatches=0",
        lambda t: torchspan.span(_mlp(), microbatches=0),
        ValueError,
        "microbatches",
    ),
    (
        "span with an unknown schedule",
        lambda t: torchspan.span(_mlp(), schedule="sideways"),
        ValueError,
        "sideways",
    ),
    (
        "span with an unknown device",
        lambda t: torchspan.span(_mlp(), devices=["nvidia"]),
        ValueError,
        "nvidia",
    ),
    ("shard_batch with world 0", lambda t: torchspan.shard_batch(_x(), 0, 0), ValueError, "0"),
]


@pytest.mark.parametrize(("name", "call", "kind", "needle"), CASES, ids=[c[0] for c in CASES])
def test_bad_call_is_one_clear_error(
    name: str, call: Callable[[Path], Any], kind: type[BaseException], needle: str, tmp_path: Path
) -> None:
    with pytest.raises(Exception) as info:
        call(tmp_path)
    exc = info.value
    assert type(exc) not in (AttributeError, AssertionError, NotImplementedError, KeyError, IndexError), repr(
        exc
    )
    assert isinstance(exc, kind), repr(exc)
    message = str(exc)
    assert "\n" not in message.strip(), message
    assert needle in message, message

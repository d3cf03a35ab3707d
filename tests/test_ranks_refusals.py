"""What a data-parallel replica refuses before any process group is touched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchspan.runtime.ranks import DataParallelReplica, shard_loss


def test_batchnorm_is_refused_with_the_layer_named() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.BatchNorm1d(4)), nn.Linear(4, 2))
    with pytest.raises(
        ValueError, match=r"layer '1.0' is BatchNorm1d: .*convert_sync_batchnorm.*per_shard_batchnorm=True"
    ):
        DataParallelReplica(model)


def test_needs_a_process_group_and_a_module() -> None:
    with pytest.raises(ValueError, match=r"call torchspan.init_distributed\(\) before"):
        DataParallelReplica(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="no process group"):
        DataParallelReplica(
            nn.BatchNorm1d(3), per_shard_batchnorm=True
        )  # allowed past the check, then needs a group
    with pytest.raises(TypeError, match="module=function is not a torch.nn.Module"):
        DataParallelReplica(lambda x: x)  # type: ignore[arg-type]


def test_an_opaque_loss_must_declare_its_reduction() -> None:
    opaque = lambda out, y: ((out - y) ** 2).sum()  # noqa: E731
    with pytest.raises(ValueError, match=r"is opaque: .*loss_reduction='mean' or 'sum'.*loss_normalizer="):
        shard_loss(opaque)
    assert shard_loss(opaque, loss_reduction="sum").reduction == "sum"
    spec = shard_loss(lambda out, y: out.sum(), loss_normalizer=lambda y: (y != -1).sum())
    assert spec.normalizer(torch.tensor([3, -1, 2, -1]), 4) == 2.0
    weighted = shard_loss(nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0]), ignore_index=-1))
    assert weighted.normalizer(torch.tensor([1, -1, 0, 1]), 4) == 7.0

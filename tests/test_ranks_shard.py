"""Shards over ranks: contiguous, uneven allowed, every sample exactly once (unlike DistributedSampler's
padding)."""

from __future__ import annotations

import pytest
import torch

from torchspan.runtime.ranks import rank_batches, shard_batch, shard_range, shard_sizes


def test_sizes_are_uneven_not_padded() -> None:
    assert shard_sizes(7, 2) == [4, 3]
    assert shard_sizes(2, 3) == [1, 1, 0]
    assert shard_sizes(0, 2) == [0, 0]
    assert [list(shard_range(7, r, 2)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6]]


def test_shards_of_a_nested_batch_concatenate_to_the_batch() -> None:
    batch = {"ids": torch.arange(7), "mask": torch.ones(7, 3), "extra": [torch.rand(7, 2)], "name": "kept"}
    parts = [shard_batch(batch, r, 3) for r in range(3)]
    assert [p["ids"].tolist() for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]
    assert all(p["name"] == "kept" for p in parts)
    torch.testing.assert_close(torch.cat([p["extra"][0] for p in parts]), batch["extra"][0])
    empty = shard_batch((torch.rand(1, 4), torch.rand(1)), 1, 2)
    assert empty[0].shape == (0, 4) and empty[1].shape == (0,)


def test_shard_batch_errors() -> None:
    with pytest.raises(ValueError, match=r"same size on dim 0; got shapes \(7, 2\), \(6,\)"):
        shard_batch((torch.rand(7, 2), torch.rand(6)), 0, 2)
    with pytest.raises(ValueError, match="no tensor"):
        shard_batch([1, 2, 3], 0, 2)
    with pytest.raises(ValueError, match=r"rank=2 must be an integer in \[0, world_size=2\)"):
        shard_batch(torch.rand(4), 2, 2)
    with pytest.raises(ValueError, match="world_size=0"):
        shard_sizes(4, 0)


def test_rank_batches_same_step_count_every_sample_once() -> None:
    world = 3
    per_rank = [rank_batches(23, 5, r, world, seed=4) for r in range(world)]
    assert {len(b) for b in per_rank} == {5}  # 23 samples, global batch 5: 5 steps on every rank
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert sorted(seen) == list(range(23))  # nothing repeated, nothing dropped
    assert [len(b) for b in per_rank[2]][-1] == 1 and [len(b) for b in per_rank[0]][
        -1
    ] == 1  # last batch 3 rows: 1+1+1
    assert rank_batches(23, 5, 0, world, seed=4) == per_rank[0]  # same seed, same order on every rank
    assert rank_batches(23, 5, 0, world, seed=5) != per_rank[0]
    assert len(rank_batches(23, 5, 0, world, drop_last=True)) == 4
    assert rank_batches([10, 11, 12], 2, 1, 2) == [[11], []]  # an empty shard: the rank still takes the step


def test_rank_batches_errors() -> None:
    with pytest.raises(ValueError, match="batch_size=0 must be an integer >= 1"):
        rank_batches(10, 0, 0, 2)


def test_rank_batches_refuses_a_negative_dataset_length() -> None:
    # issue 19: rank_batches(-5, 2) returned [] (no batch, no error): a training loop that silently does
    # nothing
    for bad in (-5, True):
        with pytest.raises(
            ValueError, match=rf"samples={bad!r} must be the dataset length \(an integer >= 0\)"
        ):
            rank_batches(bad, 2, 0, 1)
    assert rank_batches(0, 2, 0, 1) == []  # an empty dataset is no error

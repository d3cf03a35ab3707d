"""Sharding batches and datasets over ranks without duplicating a sample.

``DistributedSampler`` pads the dataset by repeating indices so every rank gets the same count;
the repeated samples then count twice in the gradient. Here shards are contiguous and may be
uneven (7 rows over 2 ranks are 4 + 3, over 8 ranks the last one is empty), so that the shards
concatenated in rank order are exactly the global batch. ``rank_batches`` splits every *global*
batch over the ranks, so every rank takes the same number of steps per epoch (a rank whose part
of the last batch is empty still calls ``train_step`` with its empty shard and adds zero).

Without an explicit ``rank``/``world_size`` they read this process's rank; in a launched job with no
process group yet they join it first (``env.join_launched_job``), so a script that forgot
``init_distributed()`` still shards by the rank that trains.

Usage::

    x_mine, y_mine = shard_batch((x, y))                      # this rank's rows of a global batch
    for idx in rank_batches(len(dataset), 64, seed=epoch):    # same step count on every rank
        ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .env import join_launched_job, rank_info

__all__ = ["shard_sizes", "shard_range", "shard_batch", "rank_batches"]


def _where(rank: int | None, world_size: int | None, caller: str = "shard_batch") -> tuple[int, int]:
    if rank is None or world_size is None:
        # launched without init_distributed(): join the job first, so that the rank sharded by here is the
        # rank that trains (span in the same script would otherwise be a lone process on every rank)
        join_launched_job(f"torchspan.{caller}", explicit=True)
        info = rank_info()
        rank = info.rank if rank is None else rank
        world_size = info.world_size if world_size is None else world_size
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an integer >= 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be an integer in [0, world_size={world_size})")
    return rank, world_size


def shard_sizes(total: int, world_size: int) -> list[int]:
    """Rows per rank: as even as possible, the first ``total % world_size`` ranks one larger."""
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"total={total!r} must be an integer >= 0 (the number of samples)")
    _where(0, world_size)
    base, extra = divmod(total, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def shard_range(total: int, rank: int | None = None, world_size: int | None = None) -> range:
    """The contiguous indices of ``range(total)`` that ``rank`` owns (default: this process's rank)."""
    rank, world_size = _where(rank, world_size, "shard_range")
    sizes = shard_sizes(total, world_size)
    start = sum(sizes[:rank])
    return range(start, start + sizes[rank])


def shard_batch(batch: Any, rank: int | None = None, world_size: int | None = None, dim: int = 0) -> Any:
    """This rank's rows of ``batch`` (a tensor or nested tuples/lists/dicts of tensors) along ``dim``.

    Every tensor leaf must have the same size along ``dim``; other leaves are kept whole. The
    result has the batch's structure; its tensors are views (empty where the rank has no rows).
    """
    rank, world_size = _where(rank, world_size)
    leaves, spec = tree_flatten(batch)
    tensors = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise ValueError(
            f"batch has no tensor to shard (got {type(batch).__name__}); pass tensors with samples on dim "
            f"{dim}"
        )
    sizes = {i: (t.shape[dim] if t.dim() > dim else None) for i, t in tensors}
    if any(n is None for n in sizes.values()) or len(set(sizes.values())) != 1:
        shown = ", ".join(f"{tuple(t.shape)}" for _, t in tensors)
        raise ValueError(
            f"shard_batch needs every tensor to have the same size on dim {dim}; got shapes {shown}"
        )
    total = int(next(iter(sizes.values())))  # type: ignore[arg-type]
    part = shard_range(total, rank, world_size)
    out = list(leaves)
    for i, t in tensors:
        out[i] = t.narrow(dim, part.start, len(part))
    return tree_unflatten(out, spec)


def rank_batches(
    samples: int | Sequence[int],
    batch_size: int,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    drop_last: bool = False,
    seed: int | None = None,
) -> list[list[int]]:
    """This rank's indices of each global batch of one epoch; the same number of batches on every rank.

    ``samples``: the dataset length or its indices. ``batch_size``: the *global* batch (all ranks
    together). ``seed``: shuffle the order first with ``torch.randperm`` (use the same seed on
    every rank, e.g. the epoch number). ``drop_last`` drops a final global batch smaller than
    ``batch_size``. Batches can be uneven or empty on some ranks; nothing is repeated.
    """
    rank, world_size = _where(rank, world_size, "rank_batches")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"batch_size={batch_size!r} must be an integer >= 1 (the global batch over all ranks)"
        )
    if isinstance(samples, bool) or (isinstance(samples, int) and samples < 0):
        raise ValueError(
            f"samples={samples!r} must be the dataset length (an integer >= 0) or its indices, e.g. "
            "rank_batches(len(dataset), 32)"
        )
    indices = list(range(samples)) if isinstance(samples, int) else [int(i) for i in samples]
    if seed is not None:
        order = torch.randperm(len(indices), generator=torch.Generator().manual_seed(int(seed))).tolist()
        indices = [indices[i] for i in order]
    stop = len(indices) - len(indices) % batch_size if drop_last else len(indices)
    out = []
    for start in range(0, stop, batch_size):
        batch = indices[start : min(start + batch_size, stop)]
        out.append([batch[i] for i in shard_range(len(batch), rank, world_size)])
    return out

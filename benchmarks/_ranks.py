"""The launcher variables of one rank of a benchmark's local gloo job (names starting with ``_`` are not run
as benchmarks).

Usage, first thing in a spawned worker, before ``init_distributed``::

    rank_env(rank, world, port)
"""

from __future__ import annotations

import os


def rank_env(rank: int, world: int, port: int, **extra: str) -> None:
    """Set what ``torchrun`` would for ``rank`` of ``world`` processes on 127.0.0.1:``port`` (one node), plus
    ``extra`` variables."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        **extra,
    )

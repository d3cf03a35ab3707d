"""Several gloo ranks on 127.0.0.1 for a test: each runs ``fn(rank, world, *args)``; a hang fails, never
blocks.

Usage (in a test module; ``fn`` must be a module-level function, spawned processes import it)::

    from ranks_spawn import join_job, spawn

    def _worker(rank, world, port):
        join_job(rank, world, port)             # the launcher's variables, one thread, init_distributed()
        ...

    spawn(_worker, 2, free_port())
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp


def spawn(fn: Callable[..., Any], world: int, *args: Any, deadline: float = 180.0) -> float:
    """Run ``fn`` on ``world`` spawned processes; fail the test past ``deadline`` seconds; return the seconds
    taken."""
    start = time.monotonic()
    ctx = mp.start_processes(fn, args=(world, *args), nprocs=world, join=False, start_method="spawn")
    while not ctx.join(timeout=0.5):
        if time.monotonic() - start > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"ranks still running after {deadline} s: a collective hangs")
    return time.monotonic() - start


def join_job(rank: int, world: int, port: int, timeout: float = 60) -> Any:
    """In a spawned rank: set what a launcher sets, one intra-op thread, and
    ``torchspan.init_distributed()``."""
    import torchspan

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    return torchspan.init_distributed(timeout=timeout)

"""Exact data-parallel training over processes: the same script under torchspan launch, torchrun or python.

Every rank trains a replica on its shard of each global batch (uneven shards included) with a
class-weighted, padded cross-entropy; the result equals one-device training on the whole batch.
With ``--checkpoint`` it saves after every step (rank 0, atomically) and resumes from there, so a
job started with ``--max-restarts`` continues where it failed.

Usage::

    torchspan launch --nproc-per-node 2 examples/train_dp.py --steps 12
    torchspan launch --nproc-per-node 2 --max-restarts 1 examples/train_dp.py \\
        --checkpoint /tmp/ckpt.pt --crash-after 5
    torchrun --nproc-per-node 2 examples/train_dp.py        # the same, with plain torchrun
    python examples/train_dp.py                             # one process: the reference
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

from torchspan.runtime.ranks import (
    DataParallelReplica,
    init_distributed,
    load_checkpoint,
    rank_batches,
    save_checkpoint,
)

SAMPLES, FEATURES, CLASSES, PAD = 45, 16, 5, -1


def make_data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic dataset (the same on every rank); about one label in five is padding."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=g, dtype=dtype)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    y[torch.rand(SAMPLES, generator=g) < 0.2] = PAD
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=10, help="global batch size (all ranks together)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--checkpoint", default=None, help="save after every step and resume from this file")
    parser.add_argument(
        "--crash-after",
        type=int,
        default=0,
        help="simulate a failure of the last rank after this step (first attempt only)",
    )
    parser.add_argument("--out", default=None, help="rank 0 writes the final state dict and losses here")
    args = parser.parse_args()

    info = init_distributed()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES)).to(dtype)
    replica = DataParallelReplica(model)
    optimizer = torch.optim.Adam(replica.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, CLASSES, dtype=dtype), ignore_index=PAD)
    x, y = make_data(dtype)

    start, losses = 0, []
    state = load_checkpoint(args.checkpoint) if args.checkpoint else None
    if state is not None:
        replica.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, losses = state["step"], state["losses"]
        if info.is_main:
            print(f"resumed from {args.checkpoint} at step {start}")

    per_epoch = -(-SAMPLES // args.batch)
    for step in range(start, args.steps):
        batches = rank_batches(SAMPLES, args.batch, seed=step // per_epoch)  # same shuffle on every rank
        mine = batches[step % per_epoch]
        optimizer.zero_grad()
        loss = replica.train_step(x[mine], y[mine], loss_fn)
        optimizer.step()
        losses.append(float(loss))
        if args.checkpoint:
            save_checkpoint(
                args.checkpoint,
                {
                    "model": replica.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step + 1,
                    "losses": losses,
                },
            )
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if step + 1 == args.crash_after and first_attempt and info.rank == info.world_size - 1:
            raise RuntimeError(f"simulated failure on rank {info.rank} after step {step + 1}")
        if info.is_main:
            print(
                f"step {step + 1}/{args.steps} loss {loss:.4f} ({len(mine)} rows on rank 0 of "
                f"{info.world_size} ranks)"
            )
    if args.out and info.is_main:
        torch.save({"model": replica.state_dict(), "losses": losses, "world_size": info.world_size}, args.out)


if __name__ == "__main__":
    main()

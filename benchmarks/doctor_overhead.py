"""Overhead of ``torchspan.watch()``: plain forward+backward vs the same step under the watcher.

One run, both measured interleaved (plain, watched, plain, watched, ...) so machine noise hits
both alike; prints the median times and their ratio. The goal is <= 1.5x on a realistic model.
Also prints ``RATIO <name> <value> <goal> <anchor>`` lines (read by ``torchspan bench``; ``--quick``).
A tiny model is measured too, to show the fixed per-op cost where ops are almost free.

Usage::

    python benchmarks/doctor_overhead.py            # default sizes
    python benchmarks/doctor_overhead.py --steps 40 --width 512 --depth 4 --batch 64 --tokens 32
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from torch import nn

import torchspan


class Block(nn.Module):
    """A transformer-style MLP block: LayerNorm -> Linear -> GELU -> Linear, residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


def make_model(width: int, depth: int, classes: int = 10) -> nn.Module:
    return nn.Sequential(*[Block(width) for _ in range(depth)], nn.Flatten(0, 1), nn.Linear(width, classes))


def step(model: nn.Module, criterion: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    loss = criterion(model(x), y)
    loss.backward()


def measure(
    width: int, depth: int, batch: int, tokens: int, steps: int, warmup: int = 3, clock: str = "wall"
) -> tuple[float, float, int]:
    now = time.perf_counter if clock == "wall" else time.process_time
    torch.manual_seed(0)
    model = make_model(width, depth)
    criterion = nn.CrossEntropyLoss(weight=torch.rand(10) + 0.5)
    x = torch.randn(batch, tokens, width)
    y = torch.randint(0, 10, (batch * tokens,))
    for _ in range(warmup):
        step(model, criterion, x, y)
        with torchspan.watch():
            step(model, criterion, x, y)
    plain: list[float] = []
    watched: list[float] = []
    ops = 0
    for _ in range(steps):
        t0 = now()
        step(model, criterion, x, y)
        plain.append(now() - t0)
        w = torchspan.watch()
        t0 = now()
        with w:
            step(model, criterion, x, y)
        watched.append(now() - t0)
        ops = w.ops
    return statistics.median(plain), statistics.median(watched), ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's default)")
    ap.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall", help="wall time, or this process's CPU time"
    )
    ap.add_argument("--quick", action="store_true", help="at most 10 steps (for torchspan bench --quick)")
    args = ap.parse_args()
    if args.quick:
        args.steps = min(args.steps, 10)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"threads={torch.get_num_threads()}, clock={args.clock}"
    )
    cases = [
        ("realistic", args.width, args.depth, args.batch, args.tokens),
        ("tiny (ops ~free)", 16, 2, 2, 4),
    ]
    for label, width, depth, batch, tokens in cases:
        plain, watched, ops = measure(width, depth, batch, tokens, args.steps, clock=args.clock)
        print(
            f"{label:18s} width={width} depth={depth} batch={batch}x{tokens}: plain {plain * 1e3:8.2f} ms, "
            f"watched {watched * 1e3:8.2f} ms, ratio {watched / plain:5.2f}x, {ops} ops checked/step"
        )
        goal = "<=1.5" if label == "realistic" else "-"
        print(
            f"RATIO doctor_watch/plain_{label.split()[0]} {watched / plain:.3f} {goal} plain "
            "forward+backward, same model"
        )


if __name__ == "__main__":
    main()

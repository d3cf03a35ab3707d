"""What the loop users write costs on top of ``train_step``: the non-finite loss check,
``spanned.clip_grad_norm_`` and the fp16 finish (issue 18 items 2, 3, 10).

Local (one process, 2 stages on the CPU, 4 micro-batches, transformer-style MLP blocks), measured
interleaved (the order reversed every other round) so machine noise hits every variant alike;
medians printed:

- ``step``: ``zero_grad(); train_step(); opt.step()``, with the non-finite check on (the default) and
  off (``check_loss`` replaced by a no-op), fp32;
- ``clip``: ``spanned.clip_grad_norm_(1.0)`` vs ``torch.nn.utils.clip_grad_norm_(spanned.parameters(), 1.0)``;
- ``fp16``: the plain fp16 loop (``train_step(); opt.step()``: the finish at the end of each train_step
  and the step hooks) vs ``--fp16-loop old``, the loop before (``spanned.step(opt)`` through GradScaler),
  which only an older checkout runs: ``PYTHONPATH=<old checkout>/src python benchmarks/gradients_cost.py
  --only fp16 --fp16-loop old``.

``--ranks``: 2 gloo ranks, a 2-stage pipeline: ``spanned.clip_grad_norm_`` (one all-reduce of
2 x named-parameters float64) vs a step.

Usage::

    python benchmarks/gradients_cost.py                 # local: step, clip, fp16
    python benchmarks/gradients_cost.py --ranks         # 2 gloo ranks
    python benchmarks/gradients_cost.py --quick         # tiny, 2 rounds (torchspan bench --quick)

Prints ``RATIO gradients_cost/... <ratio> - ...`` lines for ``torchspan bench``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
from torch import nn

import torchspan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _quick import add_quick  # noqa: E402  (benchmarks/_quick.py, beside this script)
from _ranks import rank_env  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(depth)], nn.Linear(width, width))


def _timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _local(args: argparse.Namespace) -> None:
    import torchspan.runtime.spanned as spanned_module

    x = torch.randn(args.batch, args.tokens, args.width)
    y = torch.randn(args.batch, args.tokens, args.width)
    spanned = torchspan.span(_model(args.width, args.depth), devices=["cpu", "cpu"], microbatches=4)
    opt = torch.optim.SGD(spanned.parameters(), lr=1e-4)
    real_check = spanned_module.check_loss

    def step() -> None:
        opt.zero_grad()
        spanned.train_step(x, y, nn.functional.mse_loss)
        opt.step()

    def unchecked() -> None:
        spanned_module.check_loss = lambda *a, **k: None
        try:
            step()
        finally:
            spanned_module.check_loss = real_check

    def ours() -> None:
        spanned.clip_grad_norm_(1.0)

    def torchs() -> None:
        torch.nn.utils.clip_grad_norm_(spanned.parameters(), 1.0)

    for f in (step, unchecked, ours, torchs):
        _timed(f, 3)
    times: dict[str, list[float]] = {
        "step (check on)": [],
        "step (check off)": [],
        "spanned.clip_grad_norm_": [],
        "torch clip_grad_norm_": [],
    }
    pairs = [
        ("step (check on)", step, 1),
        ("step (check off)", unchecked, 1),
        ("spanned.clip_grad_norm_", ours, 5),
        ("torch clip_grad_norm_", torchs, 5),
    ]
    for i in range(args.steps):  # every variant in turn, the order reversed every other round
        for name, fn, n in pairs if i % 2 else pairs[::-1]:
            times[name] += _timed(fn, n)
    n = sum(1 for _ in spanned.module.parameters())
    print(
        f"local: {args.depth} blocks of width {args.width} ({n} parameter tensors), batch "
        f"{args.batch}x{args.tokens}, 4 micro-batches, 2 CPU stages"
    )
    for k, v in times.items():
        print(f"  {k:28s} {statistics.median(v) * 1e3:9.3f} ms")
    on, off = statistics.median(times["step (check on)"]), statistics.median(times["step (check off)"])
    print(
        f"  check on / off: {on / off:.4f}; clip / step: "
        f"{statistics.median(times['spanned.clip_grad_norm_']) / on:.4f}"
    )
    ours_clip, torch_clip = (
        statistics.median(times["spanned.clip_grad_norm_"]),
        statistics.median(times["torch clip_grad_norm_"]),
    )
    print(
        f"RATIO gradients_cost/step_check_on_vs_off {on / off:.3f} - the same step with the non-finite "
        "loss check off"
    )
    print(
        f"RATIO gradients_cost/spanned_clip_vs_torch_clip {ours_clip / torch_clip:.3f} - "
        "torch.nn.utils.clip_grad_norm_ on the same parameters"
    )


def _fp16(args: argparse.Namespace) -> None:
    x = torch.randn(args.batch, args.tokens, args.width)
    y = torch.randn(args.batch, args.tokens, args.width)
    spanned = torchspan.span(
        _model(args.width, args.depth), devices=["cpu", "cpu"], microbatches=4, precision="fp16"
    )
    opt = torch.optim.SGD(spanned.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad()
        spanned.train_step(x, y, nn.functional.mse_loss)
        opt.step() if args.fp16_loop == "new" else spanned.step(opt)

    _timed(step, 3)
    times = _timed(step, args.steps)
    print(
        f"fp16 loop {args.fp16_loop}: median {statistics.median(times) * 1e3:.3f} ms per step "
        f"({torchspan.__file__})"
    )


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    torchspan.init_distributed(timeout=60)
    x = torch.randn(args.batch, args.tokens, args.width, generator=torch.Generator().manual_seed(0))
    y = torch.randn(args.batch, args.tokens, args.width, generator=torch.Generator().manual_seed(1))
    spanned = torchspan.span(
        _model(args.width, args.depth),
        balance=[args.depth // 2, args.depth - args.depth // 2 + 1],
        microbatches=4,
    )
    opt = torch.optim.SGD(spanned.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad()
        spanned.train_step(x, y, nn.functional.mse_loss)
        opt.step()

    def clip() -> None:
        spanned.clip_grad_norm_(1.0)

    _timed(step, 3)
    _timed(clip, 3)
    steps, clips = [], []
    for _ in range(args.steps):
        torch.distributed.barrier()
        steps += _timed(step, 1)
        torch.distributed.barrier()
        clips += _timed(clip, 5)
    if rank == 0:
        s, c = statistics.median(steps), statistics.median(clips)
        print(
            f"2 gloo ranks, 2-stage pipeline: step {s * 1e3:.3f} ms, spanned.clip_grad_norm_ {c * 1e3:.3f} "
            f"ms ({c / s:.4f} of a step)"
        )
        print(f"RATIO gradients_cost/ranks_clip_vs_step {c / s:.4f} - one train step of the 2-rank pipeline")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--only", choices=["local", "fp16"], default=None)
    parser.add_argument("--fp16-loop", choices=["new", "old"], default="new")
    parser.add_argument("--ranks", action="store_true")
    add_quick(parser, None, steps=2, width=32, depth=2, batch=4, tokens=8)
    args = parser.parse_args()
    if args.ranks:
        from torchspan.runtime.ranks import free_port

        mp.start_processes(_rank, args=(2, free_port(), args), nprocs=2, start_method="spawn")
        return
    if args.only in (None, "local"):
        _local(args)
    if args.only in (None, "fp16"):
        _fp16(args)


if __name__ == "__main__":
    main()

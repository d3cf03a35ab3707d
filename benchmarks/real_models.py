"""A real decoder LM (transformers GPT-2, random init) spanned by torchspan vs the accelerate way vs one
device.

One run, same initial weights and batch for every approach:

- ``one device``: the plain model, full batch (the reference for time and gradients);
- ``hooks, full batch``: the same 4-stage placement run the accelerate way (``dispatch_model``-style
  pre-hooks that move each block's inputs to its device, the whole batch at once): torchspan's
  hook placement with ``microbatches=1``;
- ``hooks, M micro-batches``: that placement with the batch cut into M micro-batches run one after
  another (what torchspan did for such models before the threaded executor);
- ``threads, workers=device`` / ``workers=stage``: torchspan's threaded pipeline (the model's own
  forward, one thread per micro-batch, 1F1B turns per stage), stages sharing a device taking turns
  (default) or each stage its own worker.

Rounds alternate between the approaches so that all see the same machine load; the median step
time (zero_grad + train step) and its ratio to one device are printed, then, per approach, whether
it trains every parameter (gradient present, non-zero where the reference's is, within 1e-5 of it).
On a CPU-only machine all 4 "devices" share the same cores, so a pipeline cannot be faster than one
device there: the ratios measure torchspan's overhead and the timeline shows the overlap.

Usage::

    python benchmarks/real_models.py           # GPT-2, 8 blocks, d=256, batch 16 x 64 tokens, 1 thread
    python benchmarks/real_models.py --layers 4 --rounds 3 --devices cuda:0,cuda:1,cpu,cpu
    python benchmarks/real_models.py --quick   # tiny GPT-2 on cpu,cpu, one round (torchspan bench --quick)

Prints ``RATIO real_models/<approach>/one_device <step time ratio> - ...`` lines for ``torchspan bench``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from _quick import add_quick  # benchmarks/_quick.py, beside this script
from torch import nn

import torchspan
from torchspan.parity import grad_differences
from torchspan.runtime.executor import Settings
from torchspan.runtime.local.serial import SerialExecutor
from torchspan.runtime.memory import ActivationMeter
from torchspan.runtime.record import Recorder
from torchspan.runtime.spanned import Spanned


def _model(args: argparse.Namespace) -> nn.Module:
    import transformers

    cfg = transformers.GPT2Config(
        n_layer=args.layers,
        n_embd=args.embd,
        n_head=args.heads,
        vocab_size=args.vocab,
        n_positions=args.seq,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _lm_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = out.logits
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device)
    )


def _hooks_with_microbatches(model: nn.Module, devices: list[str], m: int) -> Spanned:
    """torchspan's hook placement running ``m`` micro-batches one after another (span picks threads for m >
    1)."""
    devs = [torch.device(d) for d in devices]
    settings = Settings(m, "1f1b", "never", "32")
    rec, meter = Recorder(), ActivationMeter(len(devs))
    ex = SerialExecutor(model, devs, [["?"]] * len(devs), settings, rec, meter, balance_given=True, even=True)
    return Spanned(
        model, ex, settings, rec, meter, mode_reason="benchmark: hook placement, micro-batches in turn"
    )


Runs = dict[str, tuple[nn.Module, Callable[[torch.Tensor], Any]]]


def _approaches(base: nn.Module, devices: list[str], m: int) -> tuple[Runs, dict[str, Spanned]]:
    """Each approach's model and step function (and the spanned ones by name)."""
    out: dict[str, tuple[nn.Module, Callable[[torch.Tensor], Any]]] = {}
    one = copy.deepcopy(base)
    out["one device"] = (one, lambda ids: _lm_loss(one(input_ids=ids), ids).backward())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # span says hook placement does not pipeline: that is the point here
        full = torchspan.span(copy.deepcopy(base), devices=devices, microbatches=1)
    spans = {
        "hooks, full batch (accelerate way)": full,
        f"hooks, {m} micro-batches in turn": _hooks_with_microbatches(copy.deepcopy(base), devices, m),
        "threads, workers=device": torchspan.span(
            copy.deepcopy(base), devices=devices, microbatches=m, schedule="1f1b"
        ),
        "threads, workers=stage": torchspan.span(
            copy.deepcopy(base), devices=devices, microbatches=m, schedule="1f1b", workers="stage"
        ),
    }
    for name, sp in spans.items():
        out[name] = (sp.module, lambda ids, _sp=sp: _sp.train_step({"input_ids": ids}, ids, _lm_loss))
    return out, spans


def _step(model: nn.Module, run: Callable[[torch.Tensor], Any], ids: torch.Tensor) -> float:
    for p in model.parameters():
        p.grad = None
    t0 = time.perf_counter()
    run(ids)
    return time.perf_counter() - t0


def _trains_everything(model: nn.Module, ref: nn.Module) -> str:
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    zero = [
        n
        for (n, p), q in zip(model.named_parameters(), ref.parameters())
        if p.grad is not None and q.grad is not None and not p.grad.any() and q.grad.any()
    ]
    off = [d.name for d in grad_differences(model, ref, atol=1e-5, rtol=1e-4) if not d.within]
    if not (missing or zero or off):
        return f"yes: all {len(list(model.parameters()))} parameters, within 1e-5 of one device"
    return (
        f"NO: {len(missing)} without a gradient, {len(zero)} zero, {len(off)} off (e.g. "
        f"{(missing + zero + off)[:3]})"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--devices", default="cpu,cpu,cpu,cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per approach per round")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    add_quick(
        ap,
        argv,
        layers=2,
        embd=32,
        heads=2,
        vocab=64,
        seq=16,
        batch=4,
        microbatches=2,
        devices="cpu,cpu",
        rounds=1,
        steps=1,
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = args.devices.split(",")
    base = _model(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    print(
        f"GPT-2 {args.layers} blocks d={args.embd}, batch {args.batch}x{args.seq}, "
        f"{sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters, {len(devices)} stages on "
        f"{args.devices}, {args.microbatches} micro-batches; torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads, load average {os.getloadavg()[0]:.2f}"
    )
    runs, spans = _approaches(base, devices, args.microbatches)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name, (model, run) in runs.items():  # warm-up (the hook modes place at their first call)
        _step(model, run, ids)
    for _ in range(args.rounds):
        for name, (model, run) in runs.items():
            times[name].append(statistics.median(_step(model, run, ids) for _ in range(args.steps)))
    ref_time = statistics.median(times["one device"])
    print(f"\n{'approach':40s} {'step ms (median)':>16s} {'vs one device':>14s}")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:40s} {t * 1e3:16.1f} {t / ref_time:13.2f}x")
    for (
        name,
        ts,
    ) in (
        times.items()
    ):  # for torchspan bench: overhead over one device (the stages share this machine's cores)
        if name != "one device":
            slug = name.split(" (")[0].replace(", ", "_").replace(" ", "_").replace("=", "_")
            print(
                f"RATIO real_models/{slug}/one_device {statistics.median(ts) / ref_time:.3f} - one device, "
                f"plain GPT-2 {args.layers} blocks on {args.devices}"
            )
    ref = runs["one device"][0]
    _step(ref, runs["one device"][1], ids)
    print("\ntrains every parameter? (one step from the same weights, gradients against one device)")
    for name, (model, run) in runs.items():
        if name != "one device":
            _step(model, run, ids)
            print(f"  {name:40s} {_trains_everything(model, ref)}")
    threaded = spans["threads, workers=device"]
    fwd = {(e.stage, e.microbatch): e for e in threaded.timeline() if e.kind == "forward"}
    last = len(devices) - 1
    print(
        f"\nthreads timeline: micro-batch 1 enters stage 0 at {fwd[(0, 1)].start * 1e3:.1f} ms, "
        f"micro-batch 0 reaches stage {last} at {fwd[(last, 0)].start * 1e3:.1f} ms; stages "
        f"{[len(g) for _, g in threaded.stages]} blocks each; load average {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()

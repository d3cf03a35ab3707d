"""Pipelines across processes: every torchspan schedule against torch.distributed.pipelining, and the hybrid
against DDP.

1. **2-rank pipeline** (``pipeline``): the same ``nn.Sequential`` of ``depth`` x (Linear + ReLU), the same
   batch and micro-batches, 2 gloo processes, at two sizes (``--sizes``; both by default): ``small``
   (8 x Linear(512), batch 64, 4 micro-batches) and ``heavy``, compute-heavy (8 x Linear(1536), batch 128,
   8 micro-batches). Timed in the same rounds:

   - every torchspan schedule (``torchspan.schedule.SCHEDULES``, so a new one is picked up by itself;
     ``--schedule`` selects some): ``span(model, balance=[n/2, n/2], microbatches=m, schedule=s)``;
     ``interleaved-1f1b`` on the layers cut in four chunks, 2 stages per rank (looped: 0,2 | 1,3), as torch's
     ``ScheduleInterleaved1F1B`` below, and timed against it too (goal <= 0.9:
     ``interleaved_vs_Interleaved1F1B``);
   - ``torch.distributed.pipelining``'s ``Schedule1F1B`` (the anchor) and ``ScheduleGPipe`` on the model
     cut in two, one ``PipelineStage`` per rank, and its multi-stage schedules (``ScheduleInterleaved1F1B``,
     ``ScheduleInterleavedZeroBubble``, ``ScheduleLoopedBFS``: stages 0,2 on rank 0 and 1,3 on rank 1;
     ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``: V order, 0,3 and 1,2) on the same layers cut in four
     chunks, 2 virtual stages per rank; those missing from the installed torch, or refusing the
     configuration (DualPipeV wants micro-batches >= stages), are printed as skipped. ``--torch`` selects
     some.

   Before timing, one step of every variant from ``.grad = None``: each rank's gradients are compared
   with the first torchspan schedule's ("same gradients: yes/no", max |diff| over both ranks), so the
   timing compares like with like. Printed per variant: median ms/step, the ratio of medians and the
   **median of per-round ratios** against ``Schedule1F1B`` (goal <= 0.9 for torchspan), and the best
   torchspan schedule against torch's best, per round. ``--batch-check-cost`` adds each torchspan
   pipeline with its per-step same-batch check off, and prints checked / unchecked;
   ``--late-receives`` adds each with every receive posted only when the schedule needs it (no
   ``RankTransport.expect``), and prints early / late (what posting a stage's forward receives at once gains).
2. **Hybrid 2 x 2** (``hybrid``) on 4 processes against plain ``DistributedDataParallel`` of the
   whole model (each DDP rank a quarter of the batch).

Fairness: every variant runs in the same processes with the same intra-op threads (``--threads``,
default cores // processes), the same layers, batch and micro-batches; torch's steps pass
``return_outputs=False`` (torchspan returns only the loss) and torch scales gradients by the
micro-batch count (``scale_grads=True``), so both produce the whole batch's mean-loss gradients. Every
variant is warmed up (``--warmup`` steps each); a round times one step of each, starting from
``.grad = None`` (``zero_grad()``), with a barrier around each step; the order rotates by one and
reverses every round, so no variant always follows the same one. Wall-clock medians; on a machine
with few cores the processes share them: say so (and the load average) next to the numbers.

Usage: ``python benchmarks/distributed_pipeline.py [--steps 20] [--sizes small heavy] [--schedule ...]
[--torch ...] [--only pipeline|hybrid]``, or the same through ``python benchmarks/distributed.py --pipeline``
/ ``--hybrid`` (flags pass through). ``--width/--depth/--batch/--microbatches`` override every chosen size.
``--quick`` (``torchspan bench --quick``): tiny sizes, 2 rounds; each ratio also as a ``RATIO`` line.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _quick import add_quick  # noqa: E402  (benchmarks/_quick.py, beside this script)
from _ranks import rank_env  # noqa: E402

import torchspan  # noqa: E402
from torchspan.runtime.ranks import free_port, init_distributed  # noqa: E402
from torchspan.schedule import SCHEDULES  # noqa: E402

SIZES = {  # the two sizes of the issue; --width/--depth/--batch/--microbatches override them
    "small": dict(width=512, depth=8, batch=64, microbatches=4),
    "heavy": dict(width=1536, depth=8, batch=128, microbatches=8),
}
TORCH_SCHEDULES = (
    "1F1B",
    "GPipe",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
    "LoopedBFS",
)
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # stage order on the ranks: 0,3 | 1,2 (the others loop: 0,2 | 1,3)
ANCHOR = "torch Schedule1F1B"
PER_RANK = {"interleaved-1f1b": 2}  # torchspan schedules timed with several stages per rank (looped)
TWINS = {"torchspan interleaved-1f1b": "torch ScheduleInterleaved1F1B"}  # also timed against torch's own
Step = Callable[[], Any]
Grads = Callable[[], dict[str, torch.Tensor]]


def _model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def _timed(fn: Step) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _order(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: rotated by ``r`` and reversed every other round (each variant in every
    position)."""
    k = r % len(names)
    turned = names[k:] + names[:k]
    return turned if r % 2 == 0 else turned[::-1]


def _rounds(steps: dict[str, Step], args: argparse.Namespace) -> dict[str, list[float]]:
    """Warm every variant up, then ``args.steps`` rounds of one step each, in :func:`_order`."""
    names = list(steps)
    for _ in range(args.warmup):
        for name in names:
            _timed(steps[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.steps):
        for name in _order(names, r):
            times[name].append(_timed(steps[name]))
    return times


def _join(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    rank_env(rank, world, port)
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // world))
    init_distributed(timeout=120)


# ---------------------------------------------------------------------- the variants of the 2-rank pipeline
def _held(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's gradients by the whole model's parameter names (parameters it does not run have none)."""
    return {
        name: p.grad
        for name, p in module.named_parameters()
        if p.grad is not None and p.device.type != "meta"
    }


def _torchspan(
    schedule: str, size: dict[str, int], data: tuple, loss_fn: nn.Module
) -> tuple[Step, Grads, Any]:
    """``span`` over the whole model cut in two halves (four chunks, 2 per rank, for ``interleaved-1f1b``),
    with ``schedule``: (step, gradients, the Spanned)."""
    n, chunks = 2 * size["depth"], PER_RANK.get(schedule, 1) * 2
    balance = [n * (i + 1) // chunks - n * i // chunks for i in range(chunks)]
    spanned = torchspan.span(
        _model(size["width"], size["depth"]),
        balance=balance,
        microbatches=size["microbatches"],
        schedule=schedule,
    )
    x, y = data

    def step() -> None:
        spanned.zero_grad()
        spanned.train_step(x, y, loss_fn)

    return step, lambda: _held(spanned.module), spanned


def _stage_ids(kind: str, rank: int, world: int, per_rank: int) -> list[int]:
    """The stages ``rank`` holds, ascending, in the order torch's schedule ``kind`` expects."""
    if per_rank == 1:
        return [rank]
    if kind in V_SHAPED:  # V: down the ranks, then back up (per_rank == 2)
        return sorted([rank, 2 * world - 1 - rank])
    return [rank + world * k for k in range(per_rank)]  # looped: round-robin


def _torch(
    kind: str, rank: int, world: int, size: dict[str, int], data: tuple, loss_fn: nn.Module
) -> tuple[Step, Grads, int]:
    """torch's ``Schedule<kind>`` on the same layers: one stage per rank, or 2 (four chunks) for a multi-stage
    schedule; raises ``LookupError`` when the installed torch lacks it (its constructor's errors pass
    through)."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    cls = getattr(pipelining, f"Schedule{kind}", None)
    if cls is None:
        raise LookupError(f"torch {torch.__version__} has no Schedule{kind}")
    per_rank = 2 if issubclass(cls, PipelineScheduleMulti) else 1
    whole = _model(size["width"], size["depth"])
    pairs, count = size["depth"], world * per_rank
    if pairs % count:
        raise ValueError(f"{pairs} layers do not cut into {count} equal chunks")
    bounds = [2 * pairs * i // count for i in range(count + 1)]  # (Linear, ReLU) pairs kept together
    chunks = [nn.Sequential(*list(whole)[a:b]) for a, b in zip(bounds, bounds[1:])]
    ids = _stage_ids(kind, rank, world, per_rank)
    for i, chunk in enumerate(chunks):
        if i not in ids:
            chunk.to("meta")  # another rank's: no memory here, no gradients
    stages = [pipelining.PipelineStage(chunks[i], i, count, torch.device("cpu")) for i in ids]
    sched = cls(stages if per_rank > 1 else stages[0], n_microbatches=size["microbatches"], loss_fn=loss_fn)
    x, y = data
    inputs = (x,) if 0 in ids else ()
    last = {"target": y, "losses": []} if count - 1 in ids else {}

    def step() -> None:
        whole.zero_grad()
        if last:
            last["losses"] = []
        sched.step(*inputs, return_outputs=False, **last)

    return step, lambda: _held(whole), per_rank


def _variants(
    rank: int, world: int, size: dict[str, int], args: argparse.Namespace
) -> tuple[dict, dict, list[str], dict]:
    """Build every variant of one size: ({name: step}, {name: gradients}, [skipped lines], {name: stages per
    rank})."""
    g = torch.Generator().manual_seed(1)
    data = (
        torch.randn(size["batch"], size["width"], generator=g),
        torch.randn(size["batch"], size["width"], generator=g),
    )
    loss_fn = nn.MSELoss()
    steps: dict[str, Step] = {}
    grads: dict[str, Grads] = {}
    skipped: list[str] = []
    per_rank: dict[str, int] = {}
    spanned: dict[str, Any] = {}
    for name in args.schedule:
        key = f"torchspan {name}"
        steps[key], grads[key], spanned[name] = _torchspan(name, size, data, loss_fn)
        per_rank[key] = PER_RANK.get(name, 1)
    for kind in dict.fromkeys(["1F1B", *args.torch]):  # the anchor first, once
        key = f"torch Schedule{kind}"
        try:
            steps[key], grads[key], per_rank[key] = _torch(kind, rank, world, size, data, loss_fn)
        except (LookupError, ValueError) as e:  # the same on every rank: it depends only on the arguments
            skipped.append(f"{key}: {str(e).splitlines()[0]}")
    if args.batch_check_cost:  # the same pipelines with the per-step same-batch check switched off
        for name in args.schedule:
            key = f"{name} unchecked"
            steps[key], grads[key], unchecked = _torchspan(name, size, data, loss_fn)
            unchecked._executor.ranks.check_same_batch = lambda *a: None
            per_rank[key] = PER_RANK.get(name, 1)
            args.spent[name] = _clocked(spanned[name]._executor.ranks)
    if args.late_receives:  # the same pipelines with every receive posted when the schedule needs it
        for name in args.schedule:
            key = f"{name} late receives"
            steps[key], grads[key], late = _torchspan(name, size, data, loss_fn)
            transport = late._executor._pipeline.transport
            transport.expect = lambda *a, _t=transport, **k: (
                _t.run_gate()
            )  # the step's gate only, no receive posted
            per_rank[key] = PER_RANK.get(name, 1)
    return steps, grads, skipped, per_rank


def _first_steps(steps: dict[str, Step], grads: dict[str, Grads], world: int) -> dict[str, str]:
    """One step of each variant from ``.grad = None``, keeping its gradients; a variant that raises on any
    rank is dropped from ``steps`` (its error is returned: {name: error}; a schedule not running across ranks
    yet)."""
    failed: dict[str, str] = {}
    for name in list(steps):
        try:
            steps[name]()
            error = ""
        except Exception as e:  # noqa: BLE001  (reported and left out of the timing, on every rank alike)
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        box: list[Any] = [None] * world
        dist.all_gather_object(box, error)
        if any(box):
            failed[name] = next(b for b in box if b)
            del steps[name], grads[name]
    return failed


def _whole_grad(
    held: dict[str, torch.Tensor], shapes: dict[str, torch.Size]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole model's gradient as one vector, summed over the ranks (each adds what it holds, zeros
    elsewhere), and per parameter how many ranks hold its gradient (1 for every one in a pipeline)."""
    flat = torch.cat(
        [held[n].detach().flatten() if n in held else torch.zeros(s.numel()) for n, s in shapes.items()]
    )
    count = torch.tensor([float(n in held) for n in shapes])
    dist.all_reduce(flat)
    dist.all_reduce(count)
    return flat, count


def _same_gradients(grads: dict[str, Grads], shapes: dict[str, torch.Size]) -> dict[str, tuple[bool, float]]:
    """Every variant's gradients (of its first step) against the first variant's, as whole-model vectors (the
    variants cut the layers differently among the ranks): {name: (every parameter's gradient held by exactly
    one rank and allclose to the reference's, max |diff|)}."""
    out: dict[str, tuple[bool, float]] = {}
    ref = None
    for name, fn in grads.items():
        flat, count = _whole_grad(fn(), shapes)
        if ref is None:
            ref = flat
        diff = float((flat - ref).abs().max()) if flat.numel() else 0.0
        out[name] = (bool((count == 1).all()) and torch.allclose(flat, ref, rtol=1e-4, atol=1e-6), diff)
    return out


def _pipeline(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """Every chosen size in turn: build the variants, check their gradients, time them in the same rounds."""
    _join(rank, world, port, args)
    lines: list[str] = []
    for size_name in args.sizes:
        size = _size(size_name, args)
        args.spent = {}
        steps, grads, skipped, per_rank = _variants(rank, world, size, args)
        failed = _first_steps(steps, grads, world)
        skipped += [f"{name}: {error}" for name, error in failed.items()]
        shapes = {n: p.shape for n, p in _model(size["width"], size["depth"]).named_parameters()}
        same = _same_gradients(grads, shapes)
        times = _rounds(steps, args)
        if rank == 0:
            lines += _report(size_name, size, times, same, skipped, per_rank)
            if args.batch_check_cost:
                lines.append(_check_cost(times, args.spent, args.schedule).rstrip())
            if args.late_receives:
                lines += [
                    f"  early / late receives, {name}: median of per-round ratios "
                    f"{_per_round(times, f'torchspan {name}', f'{name} late receives'):.3f}"
                    for name in args.schedule
                ]
        del steps, grads
    if rank == 0:
        Path(out).write_text("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def _size(name: str, args: argparse.Namespace) -> dict[str, int]:
    """A size's settings, with ``--width/--depth/--batch/--microbatches`` when given."""
    return {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in SIZES[name].items()}


def _per_round(times: dict[str, list[float]], num: str, den: str) -> float:
    """The median over rounds of ``num``'s step time over ``den``'s in that round."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def _report(
    size_name: str,
    size: dict[str, int],
    times: dict[str, list[float]],
    same: dict[str, tuple[bool, float]],
    skipped: list[str],
    per_rank: dict[str, int],
) -> list[str]:
    """One size: medians, ratios to ``Schedule1F1B`` and same gradients per variant, torchspan's best against
    torch's best (both among the variants with the reference's gradients), ``RATIO`` and ``SKIP`` lines."""
    w, d, b, m = size["width"], size["depth"], size["batch"], size["microbatches"]
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = {k: _per_round(times, k, ANCHOR) for k in times}
    ref = next(iter(times))
    lines = [
        f"pipeline 2 ranks, {size_name}: {d} x (Linear({w}, {w}) + ReLU), batch {b}, {m} micro-batches, "
        f"{len(times[ANCHOR])} rounds",
        f"  {'variant':36s} {'stages/rank':>11s} {'median ms/step':>14s} {'ratio of medians':>16s} "
        f"{'median per-round ratio':>22s}  same gradients as {ref}",
    ]
    for k in times:
        ok, diff = same[k]
        verdict = "(reference)" if k == ref else f"{'yes' if ok else 'no'} (max |diff| {diff:.1e})"
        lines.append(
            f"  {k:36s} {per_rank[k]:11d} {med[k] * 1e3:14.2f} {med[k] / med[ANCHOR]:16.3f} "
            f"{ratio[k]:22.3f}  {verdict}"
        )
    lines += [f"  skipped {s}" for s in skipped]
    ours = [k for k in times if k.startswith("torchspan ")]
    for k in ours:
        lines.append(
            f"  {k} / {ANCHOR}, per round: "
            + " ".join(f"{a / c:.2f}" for a, c in zip(times[k], times[ANCHOR]))
        )
    fair = [
        k for k in times if same[k][0] and k.startswith(("torchspan ", "torch "))
    ]  # not the diagnostic variants
    best_ours = min((k for k in ours if k in fair), key=ratio.__getitem__, default=None)
    best_torch = min((k for k in fair if k.startswith("torch ")), key=ratio.__getitem__)
    tag = f"pipeline_2ranks/{size_name}"
    if best_ours is not None:
        best = _per_round(times, best_ours, best_torch)
        lines.append(
            f"  best: {best_ours} / {best_torch} (torch's best here) = {best:.3f} (median of per-round "
            "ratios)"
        )
    anchor = f"Schedule1F1B, {size_name}: {d} x Linear({w}), {m} micro-batches, 2 ranks"
    lines += [
        f"RATIO {tag}/{_slug(k)}_vs_Schedule1F1B {ratio[k]:.3f} {'<=0.9' if k in ours else '-'} {anchor}"
        + ("" if same[k][0] else " (NOT the same gradients)")
        for k in times
        if k != ANCHOR and k.startswith(("torchspan ", "torch "))
    ]
    if best_ours is not None:
        lines.append(
            f"RATIO {tag}/best_torchspan_vs_best_torch {best:.3f} - {best_ours} vs {best_torch}, {size_name}"
        )
    for k, twin in TWINS.items():
        if k in times and twin in times:
            r = _per_round(times, k, twin)
            lines.append(
                f"  {k} / {twin}: median of per-round ratios {r:.3f} (per round: "
                + " ".join(f"{a / c:.2f}" for a, c in zip(times[k], times[twin]))
                + ")"
            )
            lines.append(
                f"RATIO {tag}/{_slug(k)}_vs_{_slug(twin)[6:]} {r:.3f} <=0.9 {twin}, {size_name}: {d} x "
                f"Linear({w}), {m} micro-batches, 2 stages per rank"
                + ("" if same[k][0] else " (NOT the same gradients)")
            )
    lines += [f"SKIP {tag}/{_slug(s.split(': ')[0])}_vs_Schedule1F1B {s.split(': ', 1)[1]}" for s in skipped]
    return lines


def _slug(name: str) -> str:
    """'torchspan zero-bubble' -> 'torchspan_zero-bubble'; 'torch ScheduleGPipe' -> 'torch_GPipe'."""
    return name.replace("Schedule", "").replace(" ", "_")


def _clocked(ranks: Any) -> tuple[list[float], list[float]]:
    """Time every ``check_same_batch`` call of ``ranks`` (a ``RankStage``), its verdict's wait before the
    first transfer apart (the ``gate`` it leaves on the transport); returns the per-step lists it fills."""
    spent: list[float] = []
    waits: list[float] = []
    check = ranks.check_same_batch

    def timed(chunks: Any, targets: Any, transport: Any = None) -> None:
        start = time.perf_counter()
        check(chunks, targets, transport)
        spent.append(time.perf_counter() - start)
        waits.append(0.0)
        gate = getattr(transport, "gate", None)
        if gate is not None:

            def waited() -> None:
                start = time.perf_counter()
                try:
                    gate()
                finally:
                    waits[-1] = time.perf_counter() - start

            transport.gate = waited

    ranks.check_same_batch = timed
    return spent, waits


def _check_cost(
    times: dict[str, list[float]], spent: dict[str, tuple[list[float], list[float]]], schedules: list[str]
) -> str:
    """The same-batch check's cost: time inside the check (rank 0) against the step, and checked / unchecked
    step times from the same rounds (medians and median of per-round ratios)."""
    lines = [
        "per-step same-batch check (RankStage.check_same_batch), checked / unchecked in the same rounds:"
    ]
    for name in schedules:
        on, off = times[f"torchspan {name}"], times[f"{name} unchecked"]
        per_round = [a / b for a, b in zip(on, off)]
        inside, waits = spent[name]
        both = statistics.median([a + b for a, b in zip(inside, waits)])
        lines.append(
            f"  {name}: rank 0 spent {statistics.median(inside) * 1e3:.3f} ms in the check (fingerprint, "
            f"all-gather started) and {statistics.median(waits) * 1e3:.3f} ms waiting for its verdict "
            f"before the first send (medians of {len(inside)} steps); together {both * 1e3:.3f} ms = "
            f"{100 * both / statistics.median(on):.2f}% of the checked step"
        )
        lines.append(
            f"  {name}: checked {statistics.median(on) * 1e3:.2f} ms, unchecked "
            f"{statistics.median(off) * 1e3:.2f} ms: {statistics.median(on) / statistics.median(off):.4f} "
            f"(medians); median of per-round ratios {statistics.median(per_round):.4f}"
        )
    return "\n".join(lines) + "\n"


def _hybrid(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """torchspan 2 stages x 2 replicas against DDP of the whole model on 4 processes, at each of
    ``--hybrid-sizes``; ``--flat-reduction`` also times the replicas' flat all-reduce after the backward
    (``RankStage.bucketed = False``) against the default bucketed one, in the same rounds."""
    _join(rank, world, port, args)
    text = []
    for name in args.hybrid_sizes:
        text.append(_hybrid_size(rank, world, name, args))
    if rank == 0:
        Path(out).write_text("".join(text))


def _hybrid_size(rank: int, world: int, name: str, args: argparse.Namespace) -> str:
    from torchspan.runtime.ranks.stage import RankStage

    size = _size(name, args)
    replica = rank // 2
    g = torch.Generator().manual_seed(1)
    x = torch.randn(size["batch"], size["width"], generator=g)
    y = torch.randn(size["batch"], size["width"], generator=g)
    loss_fn = nn.MSELoss()
    n = 2 * size["depth"]

    def spanned() -> torchspan.Spanned:
        return torchspan.span(
            _model(size["width"], size["depth"]),
            balance=[n // 2, n - n // 2],
            microbatches=size["microbatches"],
            schedule=args.hybrid_schedule,
        )

    ours, flat = spanned(), spanned()
    half = size["batch"] // 2
    xs, ys = x[replica * half : (replica + 1) * half], y[replica * half : (replica + 1) * half]
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(_model(size["width"], size["depth"])))
    q = size["batch"] // world
    xq, yq = x[rank * q : (rank + 1) * q], y[rank * q : (rank + 1) * q]

    def step_ours() -> None:
        ours.zero_grad()
        ours.train_step(xs, ys, loss_fn)

    def step_flat() -> None:
        RankStage.bucketed = False
        try:
            flat.zero_grad()
            flat.train_step(xs, ys, loss_fn)
        finally:
            RankStage.bucketed = True

    def step_ddp() -> None:
        ddp.zero_grad()
        loss_fn(ddp(xq), yq).backward()

    steps = {"torchspan 2x2": step_ours, "DDP x4": step_ddp}
    if args.flat_reduction:
        steps["torchspan 2x2 flat"] = step_flat
    times = _rounds(steps, args)
    if rank != 0:
        return ""
    sched = "" if args.hybrid_schedule == "1f1b" else f", {args.hybrid_schedule}"
    title = f"hybrid 2 stages x 2 replicas vs DDP on 4 processes ({name}: {_describe(size)}{sched})"
    med = {k: statistics.median(v) for k, v in times.items()}
    r = _per_round(times, "torchspan 2x2", "DDP x4")
    lines = [f"{title}:"] + [
        f"  {k:20s} median {v * 1e3:8.2f} ms/step over {len(times[k])} rounds" for k, v in med.items()
    ]
    lines.append(
        f"  ratio torchspan 2x2 / DDP x4 = {med['torchspan 2x2'] / med['DDP x4']:.3f} (medians); "
        f"median of per-round ratios {r:.3f}"
    )
    suffix = ("" if name == "small" else f"_{name}") + sched.replace(", ", "_")
    lines.append(f"RATIO hybrid_2x2/torchspan_2x2_vs_DDP_x4{suffix} {r:.3f} - {title}")
    if args.flat_reduction:
        b = _per_round(times, "torchspan 2x2", "torchspan 2x2 flat")
        lines.append(
            f"  bucketed (DDP's reducer in the last backward) / flat (one all-reduce after it): "
            f"{med['torchspan 2x2'] / med['torchspan 2x2 flat']:.3f} (medians); "
            f"median of per-round ratios {b:.3f}"
        )
        lines.append(
            f"RATIO hybrid_2x2/bucketed_vs_flat_{name}{sched.replace(', ', '_')} {b:.3f} 1.0 {title}"
        )
    return "\n".join(lines) + "\n"


def _describe(size: dict[str, int]) -> str:
    return (
        f"{size['depth']} x Linear({size['width']}), batch {size['batch']}, "
        f"{size['microbatches']} micro-batches"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed rounds (one step of every variant per round)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of every variant first")
    p.add_argument(
        "--sizes",
        nargs="+",
        choices=list(SIZES),
        default=list(SIZES),
        help="; ".join(
            f"{k}: {v['depth']} x Linear({v['width']}), batch {v['batch']}, {v['microbatches']} micro-batches"
            for k, v in SIZES.items()
        ),
    )
    for name in ("width", "depth", "batch", "microbatches"):
        p.add_argument(f"--{name}", type=int, default=None, help="override every chosen size's")
    p.add_argument(
        "--schedule",
        nargs="+",
        choices=SCHEDULES,
        default=list(SCHEDULES),
        help="torchspan's pipeline schedule(s), each timed against Schedule1F1B in the same rounds "
        "(default: all)",
    )
    p.add_argument(
        "--torch",
        nargs="+",
        choices=TORCH_SCHEDULES,
        default=list(TORCH_SCHEDULES),
        help="torch's schedules besides the anchor Schedule1F1B (default: all; those that do not apply are "
        "skipped)",
    )
    p.add_argument(
        "--late-receives",
        action="store_true",
        help="also time each torchspan pipeline posting every receive only when needed, in the same rounds",
    )
    p.add_argument(
        "--batch-check-cost",
        action="store_true",
        help="also time each torchspan pipeline with its per-step same-batch check off, in the same rounds "
        "(the check's cost)",
    )
    p.add_argument(
        "--threads", type=int, default=0, help="intra-op threads per process (0: cores // processes)"
    )
    p.add_argument("--only", nargs="+", choices=("pipeline", "hybrid"), default=("pipeline", "hybrid"))
    p.add_argument(
        "--hybrid-sizes",
        nargs="+",
        choices=list(SIZES),
        default=["small"],
        help="sizes of the 2x2 hybrid run",
    )
    p.add_argument(
        "--flat-reduction",
        action="store_true",
        help="hybrid: also time the replicas' flat all-reduce after the backward against the default "
        "bucketed one (DDP's reducer), in the same rounds",
    )
    p.add_argument(
        "--hybrid-schedule",
        default="1f1b",
        choices=("1f1b", "gpipe", "zero-bubble"),
        help="hybrid: torchspan's schedule (default 1f1b)",
    )
    p.add_argument("--skip-hybrid", action="store_true", help="same as --only pipeline")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    add_quick(p, argv, steps=2, warmup=1, sizes=["small"], width=32, depth=4, batch=8, microbatches=2)
    args = p.parse_args(argv)
    only = ["pipeline"] if args.skip_hybrid else list(args.only)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPU cores shared by all processes (gloo on 127.0.0.1), "
        f"{args.threads or max(1, (os.cpu_count() or 2) // 2)} intra-op thread(s) per process"
    )
    print("load average (1, 5, 15 min) before: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    print(
        f"{args.warmup} warm-up steps of every variant, then {args.steps} rounds of one step each (order "
        "rotating, reversed every other round; barrier around each step; each step from .grad = None)"
    )
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        runs = [
            (name, fn, world)
            for name, fn, world in (("pipeline", _pipeline, 2), ("hybrid", _hybrid, 4))
            if name in only
        ]
        for name, fn, world in runs:
            out = str(Path(tmp) / f"{name}.txt")
            mp.start_processes(fn, args=(world, free_port(), args, out), nprocs=world, start_method="spawn")
            print(Path(out).read_text(), end="")
    print("load average (1, 5, 15 min) after the runs: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

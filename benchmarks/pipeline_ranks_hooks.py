"""Pipelines across ranks for models that run their own forward: what the own-forward path costs.

One 2-process gloo job (spawned like ``tests/test_ranks_hooks.py``), every rank one intra-op thread
(2 processes on this 2-core machine), variants alternating step by step, a barrier around each step,
medians; absolute times drift on a shared machine, so the ratios are what to read.

1. **Same blocks, every schedule**: ``depth`` blocks ``nn.Sequential(nn.Linear(w, w), nn.ReLU())``, the
   same weights, MSE loss, ``microbatches`` micro-batches, cut ``[depth/2, depth/2]``, for every torchspan
   schedule (``torchspan.schedule.SCHEDULES``; ``--schedule`` picks):

   (a) torchspan on an ``nn.Sequential`` of the blocks: stage functions (``RankPipelineExecutor``);
   (b) torchspan on a wrapper whose ``forward`` loops over an ``nn.ModuleList`` of the same blocks (a
       transformers-style model): the model's own forward on every rank, the other stage's blocks on
       ``meta`` (``RankOwnForwardExecutor``);

   and once (c) ``torch.distributed.pipelining``: ``PipelineStage`` + ``Schedule1F1B`` on the Sequential cut
   in two (``return_outputs=False``). ``--late-receives`` adds (b) with every receive posted only when the
   schedule needs it (no ``RankTransport.expect``) and prints early / late. One step of each from ``.grad =
   None`` first: the losses and the whole model's gradients (summed over the ranks) are compared with the
   first variant's (a variant that raises is named and left out). Then the variants take turns step by step (a
   turn: one step of each, the order rotated and reversed from turn to turn, a barrier around each step: what
   ``distributed.py --pipeline`` calls a round); printed per ratio: the ratio of medians and the **median of
   per-turn ratios** (the ``RATIO`` value), for every torchspan variant against (c) and (b) against (a) per
   schedule.
2. **A transformers decoder** (random-init ``LlamaForCausalLM``, tied embeddings, float32): the
   torchspan 2-rank pipeline (own forward, token-mean loss with ``loss_normalizer``) against the same
   model trained in one process with plain PyTorch (forward + loss + backward of the whole batch).
   Choice of anchor: the plain step runs *inside rank 0* with ``torch.set_num_threads(2)`` while rank 1
   waits at a barrier, so the two variants alternate step by step (a separate launch per round would
   compare minutes apart on a drifting machine). This is fair only if the waiting rank uses no CPU:
   gloo's barrier blocks in a receive, and the benchmark prints rank 1's own CPU seconds spent over
   all the anchor steps to show it (a few ms in total: the anchor had both cores). The pipeline steps
   run with 1 thread per rank: 2 processes x 1 thread = the same 2 cores. A plain step with 1 thread is
   timed too: when other jobs load the machine (load average above 2), a 2-thread OpenMP step loses
   far more than two 1-thread processes do (its threads wait for each other at every op), so the
   2-thread anchor is meaningful only on a quiet machine; the 1-thread one (the pipeline's speedup
   over one core) holds either way. Checked once before timing:
   the 2-rank loss equals the one-process loss, and each rank's gradients equal the one-process
   gradients of the parameters it holds.
3. **cProfile** of one rank of (b) (its 1f1b variant) for a few steps: the top entries inside torchspan by
cumulative
   time, plus the shares of step time of the parts of the own-forward path (meta execution of the
   other stage's blocks, timed without the profiler too, the ``MetaTaint`` mode, route checks, send/recv),
   a summary line, and the same for the decoder unless ``--skip-hf`` / ``--no-profile-hf``.

Usage: ``python benchmarks/pipeline_ranks_hooks.py [--steps 20] [--rounds 3] [--schedule ...] [--skip-hf]
[--hf-steps 6] [--profile-steps 10] [--hf-profile-steps 3] [--no-profile-hf] [--profile-rank 0]`` (defaults:
about 2-3 minutes on 2 cores); ``--quick``: tiny, few steps; ``--profile-steps 0``: no profile. Ratios also as
``RATIO`` lines (torchspan bench).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _quick import add_quick  # noqa: E402  (benchmarks/_quick.py, beside this script)
from _ranks import rank_env  # noqa: E402

import torchspan  # noqa: E402
from torchspan.runtime.ranks import free_port, init_distributed  # noqa: E402
from torchspan.schedule import SCHEDULES  # noqa: E402

TORCH_1F1B = "(c) torch Schedule1F1B"


# ---------------------------------------------------------------------- models
def _blocks(width: int, depth: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]


class Looped(nn.Module):
    """What users write: the same blocks in a ModuleList, the model's own forward loops over them."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _llama(args: argparse.Namespace) -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        tie_word_embeddings=True,
        use_cache=False,
        attn_implementation="sdpa",
        max_position_embeddings=max(256, args.seq),
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float()


def _token_ce(out: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())  # ignore_index=-100: a token mean


def _tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != -100).sum()


# ---------------------------------------------------------------------- helpers
def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _executor(spanned: Any) -> str:
    return type(spanned._executor).__name__


def _paired(times: dict[str, list[list[float]]], num: str, den: str) -> float:
    """The median over all timed steps of ``num``'s step over ``den``'s step of the same turn (one step of
    every variant, side by side: ``distributed.py --pipeline``'s per-round ratio)."""
    return statistics.median(a / b for ra, rb in zip(times[num], times[den]) for a, b in zip(ra, rb))


def _table(
    title: str,
    times: dict[str, list[list[float]]],
    ratios: list[tuple[str, str, str]],
    key: str,
    slugs: dict[str, str],
) -> list[str]:
    """Per-variant medians over all steps; each ratio ``(num, den, goal)`` as the ratio of medians, the median
    of per-turn ratios (:func:`_paired`) and per round (its spread); ``RATIO`` lines (median per-turn ratio)
    under ``key``, named by ``slugs``."""
    lines = [f"{title}:"]
    med = {k: statistics.median([t for r in v for t in r]) for k, v in times.items()}
    width = max(34, *(len(k) for k in times))
    for k, v in times.items():
        steps = sum(len(r) for r in v)
        per_round = ", ".join(f"{statistics.median(r) * 1e3:.1f}" for r in v)
        lines.append(
            f"  {k:{width}s} median {med[k] * 1e3:8.2f} ms/step over {steps} steps (per round: {per_round})"
        )
    for num, den, goal in ratios:
        rounds = ", ".join(
            f"{statistics.median(a) / statistics.median(b):.3f}" for a, b in zip(times[num], times[den])
        )
        paired = _paired(times, num, den)
        lines.append(
            f"  ratio {slugs[num]} / {slugs[den]} = {med[num] / med[den]:.3f} (medians); median per-turn "
            f"ratio {paired:.3f} (medians per round: {rounds})"
        )
        lines.append(
            f"RATIO pipeline_ranks_hooks/{key}/{slugs[num]}_vs_{slugs[den]} {paired:.3f} {goal} {den}"
        )
    return lines


def _torchspan_stats(
    prof: cProfile.Profile, steps: int, wall: float, top: int
) -> tuple[list[str], dict[tuple[str, int, str], tuple]]:
    """The top ``top`` functions inside torchspan by cumulative time, per step and as a share of the step."""
    st = pstats.Stats(prof, stream=io.StringIO())
    stats = st.stats  # type: ignore[attr-defined]
    ours = [(k, v) for k, v in stats.items() if "/torchspan/" in k[0].replace("\\", "/")]
    ours.sort(key=lambda kv: -kv[1][3])
    per = wall / steps
    lines = [
        f"  profiled {steps} steps, {per * 1e3:.1f} ms/step under cProfile (profiling inflates "
        "Python-heavy code)",
        f"  {'cum ms/step':>11s} {'% step':>7s} {'own ms/step':>11s} {'calls/step':>10s}  function",
    ]
    for (file, line, func), (cc, nc, tt, ct, _) in ours[:top]:
        rel = file.replace("\\", "/").split("/torchspan/", 1)[1]
        lines.append(
            f"  {ct / steps * 1e3:11.2f} {100 * ct / wall:6.1f}% {tt / steps * 1e3:11.2f} "
            f"{nc / steps:10.1f}  {rel}:{line}({func})"
        )
    return lines, stats


def _share(
    stats: dict, file_end: str, func: str, wall: float, steps: int, own: bool = False
) -> tuple[float, float]:
    """(ms/step, share of the step) of a function's cumulative (or own) time, summed over matches."""
    t = sum(
        v[2] if own else v[3]
        for k, v in stats.items()
        if k[0].replace("\\", "/").endswith(file_end) and k[2] == func
    )
    return t / steps * 1e3, 100 * t / wall


class _MetaClock:
    """Times the other stage's layer calls on this rank (to_meta + the block on meta), by wrapping
    ``RankOwnForwardExecutor._call`` for non-local layers only: cProfile cannot split a layer's forward by
    whether it ran on meta."""

    def __init__(self, executor: Any) -> None:
        self.ex, self.total, self.calls = executor, 0.0, 0
        self.original = type(executor)._call

    def __enter__(self) -> _MetaClock:
        original, clock = self.original, self

        def timed(ex: Any, st: Any, name: str, stage: int, fn: Any, args: Any, kwargs: Any) -> Any:
            if stage == ex.stage:
                return original(ex, st, name, stage, fn, args, kwargs)
            start = time.perf_counter()
            try:
                return original(ex, st, name, stage, fn, args, kwargs)
            finally:
                clock.total += time.perf_counter() - start
                clock.calls += 1

        self.ex._call = timed.__get__(self.ex)
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.ex._call


def _profile(
    rank: int, args: argparse.Namespace, n: int, step: Callable[[], Any], spanned: Any, title: str
) -> list[str]:
    """cProfile ``n`` steps of ``step`` on ``args.profile_rank``; the other rank runs them unprofiled."""
    lines: list[str] = []
    if n < 1:  # --profile-steps 0: nothing to profile (every rank returns: no barrier is left waiting)
        return lines
    if rank == args.profile_rank:
        prof = cProfile.Profile()
        dist.barrier()
        start = time.perf_counter()
        prof.enable()
        for _ in range(n):
            step()
        prof.disable()
        dist.barrier()
        wall = profiled_wall = time.perf_counter() - start
        table, stats = _torchspan_stats(prof, n, wall, args.top)
        lines += [
            f"{title}: cProfile of rank {rank} (stage {spanned._executor.stage}), top {args.top} torchspan "
            "entries by cumulative time"
        ]
        lines += table
        parts = [
            ("forward of every micro-batch (model's own forward)", "ranks/ownforward.py", "_forward", False),
            (
                "  one layer call: routing + send/recv + the layer (_call)",
                "ranks/ownforward.py",
                "_call",
                False,
            ),
            (
                "  MetaTaint.__torch_function__ (glue between layers)",
                "ranks/taint.py",
                "__torch_function__",
                False,
            ),
            ("  to_meta (other stage's arguments made meta)", "ranks/taint.py", "to_meta", False),
            ("  route check (CallRoute.check)", "ranks/routes.py", "check", False),
            (
                "  tree_flatten/unflatten of layer arguments (all callers)",
                "utils/_pytree.py",
                "tree_flatten",
                False,
            ),
            (
                "backward of every micro-batch (_backward, incl. grad recv)",
                "ranks/ownforward.py",
                "_backward",
                False,
            ),
            ("blocking receives (_recv: activations + gradients)", "ranks/ownforward.py", "_recv", False),
            ("sends (_isend, posting)", "ranks/ownforward.py", "_isend", False),
            ("waiting on sends at the end (_settle_sends)", "ranks/ownforward.py", "_settle_sends", False),
            ("activation meter saved-tensor hooks (pack)", "runtime/memory.py", "pack", False),
        ]
        lines.append("  breakdown (cumulative ms/step, % of step; parts nest as indented):")
        for label, file_end, func, own in parts:
            ms, pct = _share(stats, file_end, func, wall, n, own)
            if ms > 0:
                lines.append(f"    {label:62s} {ms:7.2f} ms {pct:5.1f}%")
        clock = _MetaClock(spanned._executor)
        dist.barrier()
        start = time.perf_counter()
        with clock:
            for _ in range(n):
                step()
        dist.barrier()
        wall = time.perf_counter() - start
        meta_pct = 100 * clock.total / wall
        lines.append(
            f"  without cProfile: the other stage's {clock.calls // n} layer calls/step on meta (to_meta + "
            f"swap + the block on meta + route check) take {clock.total / n * 1e3:.2f} ms/step = "
            f"{meta_pct:.1f}% of {wall / n * 1e3:.1f} ms/step"
        )
        lines += _summary(stats, n, profiled_wall, meta_pct, clock.total / max(1, clock.calls))
    else:
        dist.barrier()
        for _ in range(n):
            step()
        dist.barrier()
        dist.barrier()
        for _ in range(n):
            step()
        dist.barrier()
    return lines


def _summary(stats: dict, steps: int, wall: float, meta_pct: float, per_call: float) -> list[str]:
    """What dominates, in words, from the measured shares; plus why meta is not free here."""

    def op_us(fn: Callable[[], Any], n: int = 50) -> float:
        for _ in range(3):
            fn()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    x, w, b = (
        torch.empty(16, 512, device="meta"),
        torch.empty(512, 512, device="meta"),
        torch.empty(512, device="meta"),
    )
    xc, wc, bc = torch.randn(16, 512), torch.randn(512, 512), torch.randn(512)
    with torch.no_grad():
        meta_linear, meta_relu = op_us(lambda: F.linear(x, w, b)), op_us(lambda: F.relu(x))
        meta_mm, real_linear = op_us(lambda: torch.mm(x, w)), op_us(lambda: F.linear(xc, wc, bc))
    small = sum(
        _share(stats, f, fn, wall, steps)[1]
        for f, fn in (
            ("ranks/taint.py", "__torch_function__"),
            ("ranks/taint.py", "to_meta"),
            ("ranks/routes.py", "check"),
        )
    )
    recv = _share(stats, "ranks/ownforward.py", "_recv", wall, steps)[1]
    return [
        "  summary: running the other stage's layers on meta is the largest own-forward cost: "
        f"{meta_pct:.0f}% of this rank's step ({per_call * 1e3:.2f} ms per layer call).",
        f"  Meta is not free in torch {torch.__version__}: F.linear(16x512, 512x512, bias) on meta takes "
        f"{meta_linear:.0f} us, relu on meta {meta_relu:.0f} us (their meta kernels run as Python "
        f"decompositions/refs), torch.mm on meta {meta_mm:.0f} us, while the real F.linear on CPU takes "
        f"{real_linear:.0f} us.",
        f"  MetaTaint glue + to_meta + route checks: {small:.1f}% of the profiled step; blocking receives "
        f"{recv:.1f}% (waiting for the peer: the 1F1B bubble plus the peer's own meta work).",
    ]


# ---------------------------------------------------------------------- 1. same blocks, three ways
def _mlp_variants(
    rank: int, world: int, args: argparse.Namespace, data: tuple
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Every torchspan schedule twice, (a) on the Sequential and (b) on the Looped blocks, then (c) torch's
    ``Schedule1F1B``: ({name: step returning the loss or None}, {name: this rank's gradients}, [executor
    lines])."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    x, y = data
    loss_fn = nn.MSELoss()
    cut = [args.depth // 2, args.depth - args.depth // 2]
    blocks = _blocks(args.width, args.depth)
    steps: dict[str, Any] = {}
    grads: dict[str, Any] = {}
    made = []
    for schedule in args.schedule:
        for tag, model in (
            ("(b) own forward", Looped(copy.deepcopy(blocks))),
            ("(a) Sequential", nn.Sequential(*copy.deepcopy(blocks))),
        ):
            spanned = torchspan.span(model, balance=cut, microbatches=args.microbatches, schedule=schedule)
            name = f"{tag} {schedule}"
            steps[name] = (lambda sp: lambda: (sp.zero_grad(), sp.train_step(x, y, loss_fn))[1])(spanned)
            grads[name] = (lambda sp: lambda: _held(sp.module))(spanned)
            made.append(f"{name}: {_executor(spanned)}")
            args.spanned[name] = spanned
    for schedule in args.schedule if args.late_receives else []:  # (b) with every receive posted when needed
        spanned = torchspan.span(
            Looped(copy.deepcopy(blocks)), balance=cut, microbatches=args.microbatches, schedule=schedule
        )
        transport = spanned._executor._transport
        transport.expect = lambda *a, _t=transport, **k: (
            _t.run_gate()
        )  # the step's gate only, no receive posted
        name = f"(b) own forward {schedule} late receives"
        steps[name] = (lambda sp: lambda: (sp.zero_grad(), sp.train_step(x, y, loss_fn))[1])(spanned)
        grads[name] = (lambda sp: lambda: _held(sp.module))(spanned)
        made.append(f"{name}: {_executor(spanned)}")
        args.spanned[name] = spanned
    whole = nn.Sequential(*copy.deepcopy(blocks))
    half = nn.Sequential(*list(whole)[: cut[0]]) if rank == 0 else nn.Sequential(*list(whole)[cut[0] :])
    pipe = Schedule1F1B(
        PipelineStage(half, rank, world, torch.device("cpu")),
        n_microbatches=args.microbatches,
        loss_fn=loss_fn,
    )
    last = {"target": y, "losses": []} if rank == world - 1 else {}

    def step_c() -> torch.Tensor | None:
        half.zero_grad()
        if last:
            last["losses"] = []
        pipe.step(*(() if last else (x,)), return_outputs=False, **last)
        return torch.stack(last["losses"]).mean() if last else None

    steps[TORCH_1F1B] = step_c
    grads[TORCH_1F1B] = lambda: _held(whole)
    return steps, grads, made


def _held(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's gradients by block name ('3.0.weight', for the Looped model's 'blocks.3.0.weight' too)."""
    return {
        n.removeprefix("blocks."): p.grad
        for n, p in module.named_parameters()
        if p.grad is not None and p.device.type != "meta"
    }


def _mlp_check(steps: dict[str, Any], grads: dict[str, Any], world: int, width: int, depth: int) -> list[str]:
    """One step of every variant (a variant raising on any rank is dropped and named); its loss (the last
    rank's) and the whole model's gradients (summed over the ranks, each parameter's held by exactly one)
    against the first's. The lines are the same on every rank."""
    shapes = {n: p.shape for n, p in nn.Sequential(*_blocks(width, depth)).named_parameters()}
    lines: list[str] = []
    ref: Any = None
    for name in list(steps):
        error, loss = "", None
        try:
            out = steps[name]()
            loss = None if out is None else float(out.detach())
        except Exception as e:  # noqa: BLE001  (a schedule not running on this path yet: reported, not timed)
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        box: list[Any] = [None] * world
        dist.all_gather_object(box, (error, loss))
        if any(e for e, _ in box):
            lines.append(f"  skipped {name}: {next(e for e, _ in box if e)}")
            del steps[name]
            continue
        loss = box[-1][1]
        held = grads[name]()
        flat = torch.cat(
            [held[n].detach().flatten() if n in held else torch.zeros(s.numel()) for n, s in shapes.items()]
        )
        count = torch.tensor([float(n in held) for n in shapes])
        dist.all_reduce(flat)
        dist.all_reduce(count)
        ref = ref or (name, flat, loss)
        same = bool((count == 1).all()) and torch.allclose(flat, ref[1], rtol=1e-4, atol=1e-6)
        lines.append(
            f"  {name}: loss {loss:.6f}, same gradients as {ref[0]}: {'yes' if same else 'no'} "
            f"(max |diff| {float((flat - ref[1]).abs().max()):.1e})"
            + ("" if abs(loss - ref[2]) <= 1e-5 * abs(ref[2]) + 1e-7 else " (NOT the same loss)")
        )
    return lines


def _mlp_section(rank: int, world: int, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Section 1: every variant of :func:`_mlp_variants`, checked once, then timed step by step in turns."""
    g = torch.Generator().manual_seed(1)
    data = (
        torch.randn(args.batch, args.width, generator=g),
        torch.randn(args.batch, args.width, generator=g),
    )
    args.spanned = {}
    steps, grads, made = _mlp_variants(rank, world, args, data)
    checks = _mlp_check(steps, grads, world, args.width, args.depth)
    lines = [
        f"executors: {'; '.join(made)}; cut {[args.depth // 2, args.depth - args.depth // 2]}; "
        f"{args.rounds} rounds, variants taking turns step by step",
        "one step of each from .grad = None, compared:",
    ] + checks
    names = list(steps)
    times: dict[str, list[list[float]]] = {k: [] for k in names}
    turn = 0
    for r in range(args.rounds):
        for k in names:
            times[k].append([])
        for i in range(args.steps + (2 if r == 0 else 0)):
            got = {k: _timed(steps[k]) for k in _order(names, turn)}  # each variant in every position in turn
            turn += 1
            if r > 0 or i >= 2:  # warm-up
                for k, t in got.items():
                    times[k][-1].append(t)
    title = (
        f"1. same blocks, every schedule: {args.depth} x (Linear({args.width}, {args.width}) + ReLU), "
        f"batch {args.batch}, {args.microbatches} micro-batches, 2 ranks x 1 thread; ratios to {TORCH_1F1B}"
    )
    slugs = {
        k: k.replace("(a) Sequential ", "sequential_")
        .replace("(b) own forward ", "own_forward_")
        .replace(" late receives", "_late")
        for k in names
    }
    slugs[TORCH_1F1B] = "torch_1f1b"
    ratios = [
        (k, TORCH_1F1B, "-" if k.endswith("late receives") else "<=0.9") for k in names if k != TORCH_1F1B
    ]
    ratios += [
        (k, k.replace("(b) own forward", "(a) Sequential"), "-")
        for k in names
        if k.startswith("(b)") and k.replace("(b) own forward", "(a) Sequential") in steps
    ]
    ratios += [(k, f"{k} late receives", "-") for k in names if f"{k} late receives" in steps]  # early / late
    lines += _table(title, times, ratios, "mlp", slugs)
    own = next(
        (k for k in names if k == "(b) own forward 1f1b"),
        next((k for k in names if k.startswith("(b)")), None),
    )
    if own is None:
        return lines, []
    return lines, _profile(
        rank, args, args.profile_steps, steps[own], args.spanned[own], f"3. profile of {own}"
    )


def _order(names: list[str], turn: int) -> list[str]:
    """Turn ``turn``'s order: rotated by ``turn`` and reversed every other turn."""
    k = turn % len(names)
    turned = names[k:] + names[:k]
    return turned if turn % 2 == 0 else turned[::-1]


# ---------------------------------------------------------------------- 2. a transformers decoder
def _hf_section(rank: int, world: int, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    model = _llama(args)
    anchor = copy.deepcopy(model)
    spans = {  # one 2-rank pipeline per schedule (--hf-schedule), each on its own copy of the same weights
        s: torchspan.span(
            copy.deepcopy(model), devices=["cpu", "cpu"], microbatches=args.microbatches, schedule=s
        )
        for s in args.hf_schedule
    }
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, args.vocab, (args.hf_batch, args.seq), generator=g)
    labels = torch.randint(0, args.vocab, (args.hf_batch, args.seq), generator=g)
    labels[:, :8] = -100  # some ignored tokens (a prompt), unevenly many per micro-batch
    labels[0, 8:40] = -100
    inputs = {"input_ids": ids}

    def ours(spanned: Any) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            spanned.zero_grad()
            return spanned.train_step(inputs, labels, _token_ce, loss_normalizer=_tokens)

        return step

    def plain() -> torch.Tensor:
        anchor.zero_grad()
        loss = _token_ce(anchor(**inputs), labels)
        loss.backward()
        return loss.detach()

    # correctness, once: the 2-rank loss and this rank's gradients against one process on the whole batch
    losses = {s: ours(sp)() for s, sp in spans.items()}
    torch.set_num_threads(2 if rank == 0 else 1)  # the reference, untimed, on both ranks
    ref = plain()
    torch.set_num_threads(1)
    grads = dict(anchor.named_parameters())
    lines = [f"executor: {_executor(next(iter(spans.values())))}"]
    for s, spanned in spans.items():
        torch.testing.assert_close(losses[s], ref, rtol=1e-5, atol=1e-6)
        worst, held = 0.0, 0
        for name, p in spanned.module.named_parameters():
            if p.device.type == "meta":
                continue
            held += 1
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6)
            worst = max(worst, (p.grad - grads[name].grad).abs().max().item())
        held_all = [0] * world
        dist.all_gather_object(held_all, held)
        lines.append(
            f"check {s}: 2-rank loss {losses[s].item():.6f} vs one process {ref.item():.6f} "
            f"(|diff| {abs(losses[s].item() - ref.item()):.1e}); gradients of the parameters each rank "
            f"holds ({held_all}) equal the one-process ones (rank {rank} max |diff| {worst:.1e})"
        )

    def step_plain() -> None:
        if rank == 0:
            torch.set_num_threads(2)
            plain()
            torch.set_num_threads(1)

    def step_plain_1() -> None:
        if rank == 0:
            plain()

    mine = [f"torchspan 2 ranks (own forward, {s})" for s in spans]
    names = [*mine, "plain PyTorch, 1 process x 2 thr", "plain PyTorch, 1 process x 1 thr"]
    fns = [*(ours(sp) for sp in spans.values()), step_plain, step_plain_1]
    times: dict[str, list[list[float]]] = {k: [] for k in names}
    waiting_cpu = 0.0
    for r in range(args.rounds):
        for k in names:
            times[k].append([])
        for i in range(args.hf_steps + (1 if r == 0 else 0)):
            order = list(zip(names, fns))
            if i % 2:
                order.reverse()
            got = {}
            for k, fn in order:
                cpu = time.process_time()
                got[k] = _timed(fn)
                if k not in mine and rank == 1:
                    waiting_cpu += time.process_time() - cpu
            if r > 0 or i >= 1:
                for k, t in got.items():
                    times[k][-1].append(t)
    cpu_box = [0.0] * world
    dist.all_gather_object(cpu_box, waiting_cpu)
    title = (
        f"2. LlamaForCausalLM (hidden {args.hidden}, {args.layers} layers, {args.heads} heads, intermediate "
        f"{args.intermediate}, vocab {args.vocab}, tied, float32), batch {args.hf_batch} x seq {args.seq}, "
        f"{args.microbatches} micro-batches, schedules {', '.join(spans)}"
    )
    plain2, plain1 = names[-2], names[-1]
    slugs = {k: "torchspan" if s == "1f1b" else f"torchspan_{s}" for k, s in zip(mine, spans)}
    slugs.update({plain2: "plain_2thr", plain1: "plain_1thr"})
    pairs = (
        [(k, p, "-") for k in mine for p in (plain2, plain1)]
        + [(k, mine[0], "-") for k in mine[1:]]
        + [(plain2, plain1, "-")]
    )
    lines += _table(title, times, pairs, "decoder", slugs)
    steps = (len(names) - len(mine)) * (args.rounds * args.hf_steps + 1)
    lines.append(
        f"  rank 1's own CPU time while waiting at the barrier over all {steps} plain steps: "
        f"{cpu_box[1] * 1e3:.1f} ms"
    )
    if args.no_profile_hf:
        return lines, []
    first = next(iter(spans.values()))
    return lines, _profile(
        rank, args, args.hf_profile_steps, ours(first), first, "3b. profile of the decoder pipeline"
    )


# ---------------------------------------------------------------------- the job
def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    init_distributed(timeout=300)
    sections = [_mlp_section(rank, world, args)] + ([] if args.skip_hf else [_hf_section(rank, world, args)])
    box: list[Any] = [None] * world
    dist.all_gather_object(box, sections)
    if (
        rank == 0
    ):  # tables from rank 0 (barrier-timed: the same on both), checks from every rank, then the profiles
        merged: list[str] = []
        for i in range(len(sections)):
            for r, got in enumerate(box):
                merged += [
                    ln if r == 0 and not ln.startswith("check") else f"  [rank {r}] {ln}"
                    for ln in got[i][0]
                    if r == 0 or ln.startswith("check")
                ]
        for i in range(len(sections)):
            merged += box[args.profile_rank][i][1]
        Path(out).write_text("\n".join(merged) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round of each MLP variant")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds (each with its own medians, to show the spread)"
    )
    for name, default in (("--width", 512), ("--depth", 8), ("--batch", 64), ("--microbatches", 4)):
        parser.add_argument(name, type=int, default=default)
    parser.add_argument(
        "--schedule",
        nargs="+",
        choices=SCHEDULES,
        default=list(SCHEDULES),
        help="torchspan schedules of section 1, each on both paths (default: all)",
    )
    parser.add_argument(
        "--late-receives",
        action="store_true",
        help="also time (b) with every receive posted when the schedule needs it (no early receives); "
        "prints early / late",
    )
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers decoder")
    parser.add_argument(
        "--hf-steps", type=int, default=6, help="timed steps per round of each decoder variant"
    )
    parser.add_argument(
        "--hf-schedule",
        nargs="+",
        choices=SCHEDULES,
        default=["1f1b", "merged-weights"],
        help="torchspan schedules of section 2, each a variant timed against the plain step",
    )
    for name, default in (
        ("--hf-batch", 8),
        ("--seq", 128),
        ("--hidden", 256),
        ("--intermediate", 688),
        ("--layers", 8),
        ("--heads", 4),
        ("--vocab", 1000),
    ):
        parser.add_argument(name, type=int, default=default)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--profile-rank", type=int, default=0, choices=[0, 1])
    parser.add_argument("--hf-profile-steps", type=int, default=3)
    parser.add_argument("--no-profile-hf", action="store_true", help="do not profile the decoder pipeline")
    parser.add_argument("--top", type=int, default=15)
    add_quick(
        parser,
        argv,
        steps=2,
        rounds=1,
        width=32,
        depth=2,
        batch=8,
        microbatches=2,
        hf_steps=1,
        hf_batch=2,
        seq=16,
        hidden=32,
        intermediate=64,
        layers=2,
        heads=2,
        vocab=64,
        profile_steps=1,
        hf_profile_steps=1,
        top=5,
    )
    args = parser.parse_args(argv)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPU cores shared by both processes (gloo on 127.0.0.1)"
    )
    print("load average (1, 5, 15 min) before: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.txt")
        mp.start_processes(_worker, args=(2, free_port(), args, out), nprocs=2, start_method="spawn")
        print(Path(out).read_text(), end="")
    print("load average (1, 5, 15 min) after: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    print(f"wall time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Pipelines across ranks for models that run their own forward: what the own-forward path costs.

One 2-process gloo job (spawned like ``tests/test_ranks_hooks.py``), every rank one intra-op thread
(2 processes on this 2-core machine), variants alternating step by step, a barrier around each step,
medians; absolute times drift on a shared machine, so the ratios are what to read.

1. **Same blocks, three ways**: ``depth`` blocks ``nn.Sequential(nn.Linear(w, w), nn.ReLU())``, the
   same weights, MSE loss, ``microbatches`` micro-batches, 1F1B, cut ``[depth/2, depth/2]``:

   (a) torchspan on an ``nn.Sequential`` of the blocks: stage functions (``RankPipelineExecutor``);
   (b) torchspan on a wrapper whose ``forward`` loops over an ``nn.ModuleList`` of the same blocks:
       the model's own forward on every rank, the other stage's blocks on ``meta``
       (``RankOwnForwardExecutor``);
   (c) ``torch.distributed.pipelining``: ``PipelineStage`` + ``Schedule1F1B`` on the Sequential cut in two.

   The three losses are checked equal once before timing.
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
3. **cProfile** of one rank of (b) for a few steps: the top entries inside torchspan by cumulative
   time, plus the shares of step time of the parts of the own-forward path (meta execution of the
   other stage's blocks, timed without the profiler too, the ``MetaTaint`` mode, route checks, send/recv),
   a summary line, and the same for the decoder unless ``--skip-hf`` / ``--no-profile-hf``.

Usage: ``python benchmarks/pipeline_ranks_hooks.py [--steps 20] [--rounds 3] [--skip-hf] [--hf-steps 6]
[--profile-steps 10] [--hf-profile-steps 3] [--no-profile-hf] [--profile-rank 0]`` (defaults: about 2-3 minutes
on 2 cores); ``--quick``: tiny, few steps; ``--profile-steps 0``: no profile. Ratios also as ``RATIO`` lines (torchspan bench).
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
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torchspan  # noqa: E402
from torchspan.runtime.ranks import free_port, init_distributed  # noqa: E402
from _quick import add_quick  # noqa: E402  (benchmarks/_quick.py, beside this script)


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
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        tie_word_embeddings=True, use_cache=False, attn_implementation="sdpa",
        max_position_embeddings=max(256, args.seq),
    )  # fmt: skip
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


def _short(name: str) -> str:
    """'(b) own forward ...' -> '(b)'; 'plain PyTorch, 1 process x 2 thr' -> 'plain 2 thr'; 'torchspan 2 ranks ...' -> 'torchspan'."""
    if name.startswith("("):
        return name.split()[0]
    if name.startswith("plain"):
        return "plain " + " ".join(name.split()[-2:])
    return name.split()[0]


def _table(title: str, times: dict[str, list[list[float]]], ratios: list[tuple[str, str]], key: str) -> list[str]:
    """Per-variant medians over all steps, and each ratio overall and per round (its spread); ``RATIO`` lines under ``key``."""
    lines = [f"{title}:"]
    med = {k: statistics.median([t for r in v for t in r]) for k, v in times.items()}
    for k, v in times.items():
        steps = sum(len(r) for r in v)
        per_round = ", ".join(f"{statistics.median(r) * 1e3:.1f}" for r in v)
        lines.append(f"  {k:34s} median {med[k] * 1e3:8.2f} ms/step over {steps} steps (per round: {per_round})")
    slug = {"(a)": "sequential", "(b)": "own_forward", "(c)": "torch_1f1b", "plain 2 thr": "plain_2thr", "plain 1 thr": "plain_1thr"}
    for num, den in ratios:
        rounds = ", ".join(f"{statistics.median(a) / statistics.median(b):.3f}" for a, b in zip(times[num], times[den]))
        lines.append(f"  ratio {_short(num)} / {_short(den)} = {med[num] / med[den]:.3f} (per round: {rounds})")
        lines.append(f"RATIO pipeline_ranks_hooks/{key}/{slug.get(_short(num), 'torchspan')}_vs_{slug[_short(den)]} {med[num] / med[den]:.3f} - {den}")
    return lines


def _torchspan_stats(prof: cProfile.Profile, steps: int, wall: float, top: int) -> tuple[list[str], dict[tuple[str, int, str], tuple]]:
    """The top ``top`` functions inside torchspan by cumulative time, per step and as a share of the step."""
    st = pstats.Stats(prof, stream=io.StringIO())
    stats = st.stats  # type: ignore[attr-defined]
    ours = [(k, v) for k, v in stats.items() if "/torchspan/" in k[0].replace("\\", "/")]
    ours.sort(key=lambda kv: -kv[1][3])
    per = wall / steps
    lines = [f"  profiled {steps} steps, {per * 1e3:.1f} ms/step under cProfile (profiling inflates Python-heavy code)",
             f"  {'cum ms/step':>11s} {'% step':>7s} {'own ms/step':>11s} {'calls/step':>10s}  function"]  # fmt: skip
    for (file, line, func), (cc, nc, tt, ct, _) in ours[:top]:
        rel = file.replace("\\", "/").split("/torchspan/", 1)[1]
        lines.append(f"  {ct / steps * 1e3:11.2f} {100 * ct / wall:6.1f}% {tt / steps * 1e3:11.2f} {nc / steps:10.1f}  {rel}:{line}({func})")
    return lines, stats


def _share(stats: dict, file_end: str, func: str, wall: float, steps: int, own: bool = False) -> tuple[float, float]:
    """(ms/step, share of the step) of a function's cumulative (or own) time, summed over matches."""
    t = sum(v[2] if own else v[3] for k, v in stats.items() if k[0].replace("\\", "/").endswith(file_end) and k[2] == func)
    return t / steps * 1e3, 100 * t / wall


class _MetaClock:
    """Times the other stage's layer calls on this rank (to_meta + the block on meta), by wrapping
    ``RankOwnForwardExecutor._call`` for non-local layers only: cProfile cannot split a layer's forward by
    whether it ran on meta."""

    def __init__(self, executor: Any) -> None:
        self.ex, self.total, self.calls = executor, 0.0, 0
        self.original = type(executor)._call

    def __enter__(self) -> "_MetaClock":
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


def _profile(rank: int, args: argparse.Namespace, n: int, step: Callable[[], Any], spanned: Any, title: str) -> list[str]:
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
        lines += [f"{title}: cProfile of rank {rank} (stage {spanned._executor.stage}), top {args.top} torchspan entries by cumulative time"]
        lines += table
        parts = [
            ("forward of every micro-batch (model's own forward)", "ranks/ownforward.py", "_forward", False),
            ("  one layer call: routing + send/recv + the layer (_call)", "ranks/ownforward.py", "_call", False),
            ("  MetaTaint.__torch_function__ (glue between layers)", "ranks/taint.py", "__torch_function__", False),
            ("  to_meta (other stage's arguments made meta)", "ranks/taint.py", "to_meta", False),
            ("  route check (CallRoute.check)", "ranks/routes.py", "check", False),
            ("  tree_flatten/unflatten of layer arguments (all callers)", "utils/_pytree.py", "tree_flatten", False),
            ("backward of every micro-batch (_backward, incl. grad recv)", "ranks/ownforward.py", "_backward", False),
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
            f"  without cProfile: the other stage's {clock.calls // n} layer calls/step on meta (to_meta + swap + the "
            f"block on meta + route check) take {clock.total / n * 1e3:.2f} ms/step = {meta_pct:.1f}% "
            f"of {wall / n * 1e3:.1f} ms/step"
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

    x, w, b = torch.empty(16, 512, device="meta"), torch.empty(512, 512, device="meta"), torch.empty(512, device="meta")
    xc, wc, bc = torch.randn(16, 512), torch.randn(512, 512), torch.randn(512)
    with torch.no_grad():
        meta_linear, meta_relu = op_us(lambda: F.linear(x, w, b)), op_us(lambda: F.relu(x))
        meta_mm, real_linear = op_us(lambda: torch.mm(x, w)), op_us(lambda: F.linear(xc, wc, bc))
    small = sum(_share(stats, f, fn, wall, steps)[1] for f, fn in (
        ("ranks/taint.py", "__torch_function__"), ("ranks/taint.py", "to_meta"), ("ranks/routes.py", "check")))
    recv = _share(stats, "ranks/ownforward.py", "_recv", wall, steps)[1]
    return [
        f"  summary: running the other stage's layers on meta is the largest own-forward cost: {meta_pct:.0f}% of this "
        f"rank's step ({per_call * 1e3:.2f} ms per layer call).",
        f"  Meta is not free in torch {torch.__version__}: F.linear(16x512, 512x512, bias) on meta takes {meta_linear:.0f} us, "
        f"relu on meta {meta_relu:.0f} us (their meta kernels run as Python decompositions/refs), torch.mm on meta "
        f"{meta_mm:.0f} us, while the real F.linear on CPU takes {real_linear:.0f} us.",
        f"  MetaTaint glue + to_meta + route checks: {small:.1f}% of the profiled step; blocking receives {recv:.1f}% "
        "(waiting for the peer: the 1F1B bubble plus the peer's own meta work).",
    ]


# ---------------------------------------------------------------------- 1. same blocks, three ways
def _mlp_section(rank: int, world: int, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    w, d, m = args.width, args.depth, args.microbatches
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, w, generator=g)
    y = torch.randn(args.batch, w, generator=g)
    loss_fn = nn.MSELoss()
    cut = [d // 2, d - d // 2]
    blocks = _blocks(w, d)
    seq = torchspan.span(nn.Sequential(*copy.deepcopy(blocks)), balance=cut, microbatches=m, schedule="1f1b")
    hooked = torchspan.span(Looped(copy.deepcopy(blocks)), balance=cut, microbatches=m, schedule="1f1b")
    whole = nn.Sequential(*copy.deepcopy(blocks))
    half = nn.Sequential(*list(whole)[: cut[0]]) if rank == 0 else nn.Sequential(*list(whole)[cut[0] :])
    stage = PipelineStage(half, rank, world, torch.device("cpu"))
    pipe = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn)
    torch_losses: list[torch.Tensor] = []

    def step_a() -> torch.Tensor:
        seq.zero_grad()
        return seq.train_step(x, y, loss_fn)

    def step_b() -> torch.Tensor:
        hooked.zero_grad()
        return hooked.train_step(x, y, loss_fn)

    def step_c() -> None:
        half.zero_grad()
        torch_losses.clear()
        if rank == 0:
            pipe.step(x)
        else:
            pipe.step(target=y, losses=torch_losses)

    # correctness, once: the three compute the same loss (the last stage's, broadcast for torchspan)
    la, lb = step_a(), step_b()
    step_c()
    lines = [f"executors: (a) {_executor(seq)}, (b) {_executor(hooked)}; cut {cut}; {args.rounds} rounds, variants alternating step by step"]
    if rank == world - 1:
        lc = torch.stack(torch_losses).mean()
        torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(lc, la, rtol=1e-5, atol=1e-7)
        lines.append(f"check: losses (a) {la.item():.6f}, (b) {lb.item():.6f}, (c) {lc.item():.6f}: equal to float tolerance")

    names = ["(b) own forward (RankOwnForwardExecutor)", "(a) Sequential (RankPipelineExecutor)", "(c) torch Schedule1F1B"]
    fns = [step_b, step_a, step_c]
    times: dict[str, list[list[float]]] = {k: [] for k in names}
    for r in range(args.rounds):
        for k in names:
            times[k].append([])
        for i in range(args.steps + (2 if r == 0 else 0)):
            order = list(zip(names, fns))
            if i % 2:
                order.reverse()  # neither variant always runs right after the other
            got = {k: _timed(fn) for k, fn in order}
            if r > 0 or i >= 2:  # warm-up
                for k, t in got.items():
                    times[k][-1].append(t)
    title = (
        f"1. same blocks three ways: {d} x (Linear({w}, {w}) + ReLU), batch {args.batch}, {m} micro-batches, 1F1B, "
        "2 ranks x 1 thread"
    )
    lines += _table(title, times, [(names[0], names[1]), (names[0], names[2]), (names[1], names[2])], "mlp")
    return lines, _profile(rank, args, args.profile_steps, step_b, hooked, "3. profile of (b)")


# ---------------------------------------------------------------------- 2. a transformers decoder
def _hf_section(rank: int, world: int, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    model = _llama(args)
    anchor = copy.deepcopy(model)
    spanned = torchspan.span(model, devices=["cpu", "cpu"], microbatches=args.microbatches, schedule="1f1b")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, args.vocab, (args.hf_batch, args.seq), generator=g)
    labels = torch.randint(0, args.vocab, (args.hf_batch, args.seq), generator=g)
    labels[:, :8] = -100  # some ignored tokens (a prompt), unevenly many per micro-batch
    labels[0, 8:40] = -100
    inputs = {"input_ids": ids}

    def step_ours() -> torch.Tensor:
        spanned.zero_grad()
        return spanned.train_step(inputs, labels, _token_ce, loss_normalizer=_tokens)

    def plain() -> torch.Tensor:
        anchor.zero_grad()
        loss = _token_ce(anchor(**inputs), labels)
        loss.backward()
        return loss.detach()

    # correctness, once: the 2-rank loss and this rank's gradients against one process on the whole batch
    loss = step_ours()
    torch.set_num_threads(2 if rank == 0 else 1)  # the reference, untimed, on both ranks
    ref = plain()
    torch.set_num_threads(1)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    grads = dict(anchor.named_parameters())
    worst, held = 0.0, 0
    for name, p in spanned.module.named_parameters():
        if p.device.type == "meta":
            continue
        held += 1
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6)
        worst = max(worst, (p.grad - grads[name].grad).abs().max().item())
    held_all = [0] * world
    dist.all_gather_object(held_all, held)
    lines = [
        f"executor: {_executor(spanned)}",
        f"check: 2-rank loss {loss.item():.6f} vs one process {ref.item():.6f} "
        f"(|diff| {abs(loss.item() - ref.item()):.1e}); gradients of the parameters each rank holds ({held_all}) equal "
        f"the one-process ones (rank {rank} max |diff| {worst:.1e})"
    ]

    def step_plain() -> None:
        if rank == 0:
            torch.set_num_threads(2)
            plain()
            torch.set_num_threads(1)

    def step_plain_1() -> None:
        if rank == 0:
            plain()

    names = ["torchspan 2 ranks (own forward)", "plain PyTorch, 1 process x 2 thr", "plain PyTorch, 1 process x 1 thr"]
    fns = [step_ours, step_plain, step_plain_1]
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
                if k != names[0] and rank == 1:
                    waiting_cpu += time.process_time() - cpu
            if r > 0 or i >= 1:
                for k, t in got.items():
                    times[k][-1].append(t)
    cpu_box = [0.0] * world
    dist.all_gather_object(cpu_box, waiting_cpu)
    title = (
        f"2. LlamaForCausalLM (hidden {args.hidden}, {args.layers} layers, {args.heads} heads, intermediate "
        f"{args.intermediate}, vocab {args.vocab}, tied, float32), batch {args.hf_batch} x seq {args.seq}, "
        f"{args.microbatches} micro-batches, 1F1B"
    )
    lines += _table(title, times, [(names[0], names[1]), (names[0], names[2]), (names[1], names[2])], "decoder")
    steps = 2 * (args.rounds * args.hf_steps + 1)
    lines.append(f"  rank 1's own CPU time while waiting at the barrier over all {steps} plain steps: {cpu_box[1] * 1e3:.1f} ms")
    if args.no_profile_hf:
        return lines, []
    return lines, _profile(rank, args, args.hf_profile_steps, step_ours, spanned, "3b. profile of the decoder pipeline")


# ---------------------------------------------------------------------- the job
def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    init_distributed(timeout=300)
    sections = [_mlp_section(rank, world, args)] + ([] if args.skip_hf else [_hf_section(rank, world, args)])
    box: list[Any] = [None] * world
    dist.all_gather_object(box, sections)
    if rank == 0:  # tables from rank 0 (barrier-timed: the same on both), checks from every rank, then the profiles
        merged: list[str] = []
        for i in range(len(sections)):
            for r, got in enumerate(box):
                merged += [ln if r == 0 and not ln.startswith("check") else f"  [rank {r}] {ln}" for ln in got[i][0] if r == 0 or ln.startswith("check")]
        for i in range(len(sections)):
            merged += box[args.profile_rank][i][1]
        Path(out).write_text("\n".join(merged) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round of each MLP variant")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each with its own medians, to show the spread)")
    for name, default in (("--width", 512), ("--depth", 8), ("--batch", 64), ("--microbatches", 4)):
        parser.add_argument(name, type=int, default=default)
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers decoder")
    parser.add_argument("--hf-steps", type=int, default=6, help="timed steps per round of each decoder variant")
    for name, default in (("--hf-batch", 8), ("--seq", 128), ("--hidden", 256), ("--intermediate", 688), ("--layers", 8),
                          ("--heads", 4), ("--vocab", 1000)):
        parser.add_argument(name, type=int, default=default)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--profile-rank", type=int, default=0, choices=[0, 1])
    parser.add_argument("--hf-profile-steps", type=int, default=3)
    parser.add_argument("--no-profile-hf", action="store_true", help="do not profile the decoder pipeline")
    parser.add_argument("--top", type=int, default=15)
    add_quick(parser, argv, steps=2, rounds=1, width=32, depth=2, batch=8, microbatches=2, hf_steps=1, hf_batch=2, seq=16,
              hidden=32, intermediate=64, layers=2, heads=2, vocab=64, profile_steps=1, hf_profile_steps=1, top=5)  # fmt: skip
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores shared by both processes (gloo on 127.0.0.1)")
    print("load average (1, 5, 15 min) before: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.txt")
        mp.start_processes(_worker, args=(2, free_port(), args, out), nprocs=2, start_method="spawn")
        print(Path(out).read_text(), end="")
    print(f"load average (1, 5, 15 min) after: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    print(f"wall time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

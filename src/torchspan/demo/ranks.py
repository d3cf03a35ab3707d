"""``torchspan demo --nproc-per-node N``: the demo language model trained data-parallel over N processes.

Each process (gloo on 127.0.0.1, forked from one forkserver so torch is imported once) calls
``torchspan.span(model)`` on the same ``CharTransformer``, as a user's script does (in a launched
job that is the rank's exact data-parallel replica, ``runtime.ranks.replicated``), and trains on its
rows of every global batch (``shard_batch``: the same batches as one process would draw, split
without repeating a row); the gradients are
all-reduced, so the replicas stay identical and train like one device on the whole batch. Every
rank times its own steps; ``report.md`` says it ran data-parallel over N processes and gives each
rank's throughput (samples/s and tokens/s) next to the loss curve and a text sample.

Usage::

    from torchspan.demo.ranks import run_demo_ranks
    result = run_demo_ranks(2, steps=50, out="torchspan-demo")
    result.ranks[1]["samples_per_second"], result.files["report"]
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console

from .. import pictures
from ..files import write_text
from ..pictures.tables import md_table
from ..runtime import span
from ..runtime.ranks import free_port, init_distributed, shard_batch
from .corpus import build_corpus
from .model import CharTransformer, generate, lm_loss
from .run import DemoConfig, out_folder
from .story import guide, guide_line

__all__ = ["RanksDemoResult", "run_demo_ranks"]


@dataclass
class RanksDemoResult:
    """What the data-parallel demo did: global losses, each rank's figures (``rank``, ``samples``, ``seconds``,
    ``samples_per_second``, ``tokens_per_second``, ``threads``), the sample and the files written."""

    out: Path
    nproc: int
    losses: list[float]
    ranks: list[dict[str, Any]]
    seconds: float
    sample: str
    files: dict[str, Path] = field(default_factory=dict)


def _rank_main(rank: int, world: int, port: int, folder: str, cfg: DemoConfig, threads: int) -> None:
    """One process: a replica trained on its shard of every global batch; writes ``rank{R}.json``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
    )  # fmt: skip
    torch.set_num_threads(threads)
    init_distributed(backend="gloo", timeout=300)
    try:
        torch.manual_seed(cfg.seed)
        corpus = build_corpus(cfg.corpus, seed=cfg.seed)
        model = CharTransformer(corpus.vocab_size, dim=cfg.dim, depth=cfg.depth, heads=cfg.heads, seq_len=cfg.seq_len)
        spanned = span(model)  # as in a user's script: a launched one-stage span is this rank's replica
        if spanned.mode != "data-parallel":
            raise RuntimeError(f"span(model) in a {world}-process job gave mode {spanned.mode!r}, not 'data-parallel'")
        optimizer = torch.optim.AdamW(spanned.parameters(), lr=cfg.lr)
        gen = torch.Generator().manual_seed(cfg.seed)  # the same global batches on every rank
        losses, samples, seconds = [], 0, 0.0
        for _ in range(cfg.steps):
            x, y = shard_batch(corpus.batch(cfg.batch_size, cfg.seq_len, gen), rank, world)
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = spanned.train_step(x, y, lm_loss, loss_reduction="mean")  # a mean over tokens; rows weigh equally
            optimizer.step()
            seconds += time.perf_counter() - t0
            samples += len(x)
            losses.append(float(loss))
        sample = ""
        if rank == 0 and cfg.sample_chars:
            ids = generate(model, corpus.encode(cfg.prompt), cfg.sample_chars, generator=gen)
            sample = cfg.prompt + corpus.decode(ids)
        record = {"rank": rank, "samples": samples, "seconds": seconds, "threads": threads, "losses": losses, "sample": sample}
        write_text(Path(folder, f"rank{rank}.json"), json.dumps(record))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(nproc: int, folder: Path, cfg: DemoConfig, timeout: float) -> float:
    """Run the ranks; a ``RuntimeError`` naming the rank that failed, died or was still running at ``timeout``."""
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torchspan.demo.ranks"])
    threads = max(1, (os.cpu_count() or 1) // nproc)
    start = time.monotonic()
    ctx = mp.start_processes(
        _rank_main, args=(nproc, free_port(), str(folder), cfg, threads), nprocs=nproc, join=False, start_method="forkserver"
    )
    try:
        while not ctx.join(timeout=0.25):
            if time.monotonic() - start > timeout:
                running = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                raise RuntimeError(f"demo rank(s) {', '.join(map(str, running))} of {nproc} still running after {timeout:g} s (killed)")
    except mp.ProcessRaisedException as exc:
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise RuntimeError(f"demo rank {exc.error_index} of {nproc} failed: {lines[-1].strip() if lines else exc}") from None
    except mp.ProcessExitedException as exc:
        raise RuntimeError(f"demo rank {exc.error_index} of {nproc} died (exit {exc.exit_code}, {exc.signal_name or 'no signal'})") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return time.monotonic() - start


def run_demo_ranks(
    nproc: int,
    steps: int | None = None,
    out: str | Path = "torchspan-demo",
    *,
    console: Console | None = None,
    config: DemoConfig | None = None,
    timeout: float = 600.0,
) -> RanksDemoResult:
    """Train the demo model data-parallel over ``nproc`` processes and write ``report.md`` (with ``loss.png``) to ``out``.

    ``steps`` overrides ``config.steps``; ``timeout`` (seconds) bounds the whole run. ``nproc`` must be >= 2
    (one process is the ordinary ``run_demo``) and ``config.batch_size`` at least ``nproc``.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 2:
        raise ValueError(f"nproc={nproc!r} must be an int >= 2 for data parallel; run_demo trains in one process")
    cfg = config or DemoConfig()
    if steps is not None:
        cfg = replace(cfg, steps=steps)
    if cfg.batch_size < nproc:
        raise ValueError(f"batch_size={cfg.batch_size} gives some of nproc={nproc} processes no rows; use batch_size >= {nproc}")
    con = console or Console(markup=False)  # printed text keeps its square brackets
    out_dir = out_folder(out)
    rows = ", ".join(str(len(shard_batch(torch.empty(cfg.batch_size), r, nproc))) for r in range(nproc))
    con.print(
        f"data parallel over {nproc} processes (gloo on 127.0.0.1): one replica each, every global batch of "
        f"{cfg.batch_size} x {cfg.seq_len} characters split {rows} rows; {cfg.steps} steps"
    )
    import tempfile

    with tempfile.TemporaryDirectory(prefix="torchspan-demo-") as tmp, con.status(f"training on {nproc} processes ..."):
        wall = _spawn(nproc, Path(tmp), cfg, timeout)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text(encoding="utf-8")) for r in range(nproc)]
    for r in ranks:
        r["samples_per_second"] = r["samples"] / r["seconds"] if r["seconds"] > 0 else 0.0
        r["tokens_per_second"] = r["samples_per_second"] * cfg.seq_len
    losses, sample = ranks[0]["losses"], ranks[0]["sample"]
    step_seconds = max(r["seconds"] for r in ranks)
    total = sum(r["samples"] for r in ranks) / step_seconds if step_seconds > 0 else 0.0
    per_rank = "; ".join(f"rank {r['rank']}: {r['samples_per_second']:,.1f} samples/s" for r in ranks)
    summary = {
        "strategy": f"data-parallel over {nproc} processes (torchspan.span(model) in each; gloo on 127.0.0.1, "
        f"{ranks[0]['threads']} thread(s) each); "
        f"global batch {cfg.batch_size} x {cfg.seq_len} characters split {rows} rows",
        "steps": cfg.steps,
        "model": f"CharTransformer, {cfg.depth} blocks, dim {cfg.dim}",
        "loss": f"{losses[0]:.3f} -> {losses[-1]:.3f}",
        "per-rank throughput": per_rank,
        "all ranks": f"{total:,.1f} samples/s ({total * cfg.seq_len:,.0f} tokens/s); {wall:.1f} s wall clock including process start",
    }
    files = pictures.write_report(
        out_dir, title=f"torchspan demo: data parallel over {nproc} processes", losses=losses, summary=summary, sample=sample or None
    )
    table = md_table(
        ("rank", "samples", "training seconds", "samples/s", "tokens/s"),
        [(str(r["rank"]), str(r["samples"]), f"{r['seconds']:.2f}", f"{r['samples_per_second']:,.1f}", f"{r['tokens_per_second']:,.0f}") for r in ranks],
    )
    report = files.report.read_text(encoding="utf-8") + "\n## Per-rank throughput\n\n" + "\n".join(table) + "\n"
    report += f"\n## What you saw\n\n{guide(nproc)}\n"
    write_text(files.report, report, name="out")
    write_text(out_dir / "losses.json", json.dumps(losses), name="out")
    written = {"report": files.report, "losses": out_dir / "losses.json"}
    if files.loss is not None:
        written["loss"] = files.loss
    for r in ranks:
        con.print(f"rank {r['rank']}: {r['samples']} samples in {r['seconds']:.2f} s, {r['samples_per_second']:,.1f} samples/s")
    con.print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {cfg.steps} steps over {nproc} processes. Report: {files.report}")
    con.print(guide_line(nproc))
    return RanksDemoResult(out_dir, nproc, losses, ranks, wall, sample, written)

"""``torchspan demo --nproc-per-node N [--tp T]``: the demo language model trained over N processes.

Each process (gloo on 127.0.0.1, forked from one forkserver so torch is imported once) calls
``torchspan.span(model)`` on the same ``CharTransformer``, as a user's script does (in a launched
job that is the rank's exact data-parallel replica, ``runtime.ranks.replicated``), and trains on its
rows of every global batch (``shard_batch``: the same batches as one process would draw, split
without repeating a row); the gradients are
all-reduced, so the replicas stay identical and train like one device on the whole batch. Every
rank times its own steps; ``report.md`` says it ran data-parallel over N processes and gives each
rank's throughput (samples/s and tokens/s) next to the loss curve and a text sample.

With ``tp`` (``demo.tensorparallel``) each block's MLP is split over ``tp`` processes instead (``N / tp``
sharded replicas), and ``report.md`` also sets one step's gradients and the first steps' losses against
the same model on one device.

Usage::

    from torchspan.demo.ranks import run_demo_ranks
    result = run_demo_ranks(2, steps=50, out="torchspan-demo")          # tp=2: tensor parallel
    result.ranks[1]["samples_per_second"], result.files["report"]
"""

from __future__ import annotations

import copy
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
from ..runtime.ranks import free_port, init_distributed, shard_batch
from .corpus import build_corpus
from .model import CharTransformer, generate, lm_loss
from .run import DemoConfig, out_folder
from .spanning import GradientCheck
from .story import guide, guide_line
from .tensorparallel import TP_PLAN, gradient_parity, loss_parity, span_ranks

__all__ = ["RanksDemoResult", "run_demo_ranks"]


@dataclass
class RanksDemoResult:
    """What the data-parallel demo did: global losses, each rank's figures (``rank``, ``samples``,
    ``seconds``, ``samples_per_second``, ``tokens_per_second``, ``threads``), the sample and the files
    written."""

    out: Path
    nproc: int
    losses: list[float]
    ranks: list[dict[str, Any]]
    seconds: float
    sample: str
    files: dict[str, Path] = field(default_factory=dict)
    tp: int | None = None  # tensor parallel: each block's MLP split over tp processes
    parity: list[str] = field(
        default_factory=list
    )  # tensor parallel: the run against one device (gradients, losses)


def _rank_main(
    rank: int, world: int, port: int, folder: str, cfg: DemoConfig, threads: int, tp: int | None = None
) -> None:
    """One process: its span (a replica, or ``tp`` ranks per layer) trained on its rows of every global batch;
    with ``tp`` the parity with one device first (``demo.tensorparallel``); writes ``rank{R}.json``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(threads)
    init_distributed(backend="gloo", timeout=300)
    try:
        torch.manual_seed(cfg.seed)
        corpus = build_corpus(cfg.corpus, seed=cfg.seed)
        model = CharTransformer(
            corpus.vocab_size, dim=cfg.dim, depth=cfg.depth, heads=cfg.heads, seq_len=cfg.seq_len
        )
        reference = copy.deepcopy(model) if tp else None  # one device's model, for the parity
        spanned = span_ranks(model, world, tp)
        record: dict[str, Any] = {"rank": rank, "threads": threads}
        if reference is not None:
            check = gradient_parity(
                spanned,
                reference,
                *corpus.batch(cfg.batch_size, cfg.seq_len, torch.Generator().manual_seed(cfg.seed + 1)),
            )
            record["gradient_check"] = check.to_dict()
        record.update(_train(spanned, corpus, cfg))
        if reference is not None and rank == 0:
            gen = torch.Generator().manual_seed(cfg.seed)  # the run's first global batches again
            batches = [
                corpus.batch(cfg.batch_size, cfg.seq_len, gen)
                for _ in range(min(cfg.compare_steps, cfg.steps))
            ]
            record["one_device"] = loss_parity(reference, batches, record["losses"], cfg.lr)
        whole = spanned.state_dict() if tp else None  # full tensors: a collective, every rank calls it
        record["sample"] = ""
        if rank == 0 and cfg.sample_chars:
            if (
                whole is not None
            ):  # a plain copy to sample from alone (the split layers' forwards are collectives)
                model = CharTransformer(
                    corpus.vocab_size, dim=cfg.dim, depth=cfg.depth, heads=cfg.heads, seq_len=cfg.seq_len
                )
                model.load_state_dict(whole)
            ids = generate(
                model,
                corpus.encode(cfg.prompt),
                cfg.sample_chars,
                generator=torch.Generator().manual_seed(cfg.seed),
            )
            record["sample"] = cfg.prompt + corpus.decode(ids)
        write_text(Path(folder, f"rank{rank}.json"), json.dumps(record))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _train(spanned: Any, corpus: Any, cfg: DemoConfig) -> dict[str, Any]:
    """``cfg.steps`` AdamW steps on this rank's rows of every global batch (the same batches on every
    rank)."""
    optimizer = torch.optim.AdamW(spanned.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    replica, replicas = spanned.data_parallel
    losses, samples, seconds = [], 0, 0.0
    for _ in range(cfg.steps):
        x, y = shard_batch(corpus.batch(cfg.batch_size, cfg.seq_len, gen), replica, replicas)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = spanned.train_step(
            x, y, lm_loss, loss_reduction="mean"
        )  # a mean over tokens; rows weigh equally
        optimizer.step()
        seconds += time.perf_counter() - t0
        samples += len(x)
        losses.append(float(loss))
    return {"samples": samples, "seconds": seconds, "losses": losses}


def _spawn(nproc: int, folder: Path, cfg: DemoConfig, timeout: float, tp: int | None = None) -> float:
    """Run the ranks; a ``RuntimeError`` naming the rank that failed, died or was still running at
    ``timeout``."""
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torchspan.demo.ranks"])
    threads = max(1, (os.cpu_count() or 1) // nproc)
    start = time.monotonic()
    ctx = mp.start_processes(
        _rank_main,
        args=(nproc, free_port(), str(folder), cfg, threads, tp),
        nprocs=nproc,
        join=False,
        start_method="forkserver",
    )
    try:
        while not ctx.join(timeout=0.25):
            if time.monotonic() - start > timeout:
                running = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                raise RuntimeError(
                    f"demo rank(s) {', '.join(map(str, running))} of {nproc} still running after "
                    f"{timeout:g} s (killed)"
                )
    except mp.ProcessRaisedException as exc:
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise RuntimeError(
            f"demo rank {exc.error_index} of {nproc} failed: {lines[-1].strip() if lines else exc}"
        ) from None
    except mp.ProcessExitedException as exc:
        raise RuntimeError(
            f"demo rank {exc.error_index} of {nproc} died (exit {exc.exit_code}, "
            f"{exc.signal_name or 'no signal'})"
        ) from None
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
    tp: int | None = None,
) -> RanksDemoResult:
    """Train the demo model over ``nproc`` processes and write ``report.md`` (with ``loss.png``) to ``out``:
    data parallel, or with ``tp`` each block's MLP split over ``tp`` of them (``demo.tensorparallel``; ``nproc
    / tp`` sharded replicas), one step's gradients and the first steps' losses set against one device's.

    ``steps`` overrides ``config.steps``; ``timeout`` (seconds) bounds the whole run. ``nproc`` must be >= 2
    (one process is the ordinary ``run_demo``), a multiple of ``tp``, and ``config.batch_size`` at least the
    number of replicas.
    """
    cfg = _check(nproc, steps, config, tp)
    con = console or Console(markup=False)  # printed text keeps its square brackets
    out_dir = out_folder(out)
    replicas = nproc // (tp or 1)
    rows = ", ".join(str(len(shard_batch(torch.empty(cfg.batch_size), r, replicas))) for r in range(replicas))
    con.print(
        f"{_strategy(nproc, tp)}: every global batch of {cfg.batch_size} x {cfg.seq_len} characters split "
        f"{rows} rows; {cfg.steps} steps"
    )
    import tempfile

    with (
        tempfile.TemporaryDirectory(prefix="torchspan-demo-") as tmp,
        con.status(f"training on {nproc} processes ..."),
    ):
        wall = _spawn(nproc, Path(tmp), cfg, timeout, tp)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text(encoding="utf-8")) for r in range(nproc)]
    for r in ranks:
        r["samples_per_second"] = r["samples"] / r["seconds"] if r["seconds"] > 0 else 0.0
        r["tokens_per_second"] = r["samples_per_second"] * cfg.seq_len
    result = RanksDemoResult(out_dir, nproc, ranks[0]["losses"], ranks, wall, ranks[0]["sample"], tp=tp)
    result.parity = _parity_lines(ranks[0])
    result.files = _report(result, cfg, rows)
    for r in ranks:
        con.print(
            f"rank {r['rank']}: {r['samples']} samples in {r['seconds']:.2f} s, "
            f"{r['samples_per_second']:,.1f} samples/s"
        )
    for line in result.parity:
        con.print(line)
    losses = result.losses
    con.print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {cfg.steps} steps over {nproc} processes. Report: "
        f"{result.files['report']}"
    )
    con.print(guide_line(nproc, tp))
    return result


def _check(nproc: int, steps: int | None, config: DemoConfig | None, tp: int | None) -> DemoConfig:
    """The run's ``DemoConfig``; ``ValueError`` for a process count, ``tp`` or batch that cannot run."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 2:
        raise ValueError(
            f"nproc={nproc!r} must be an int >= 2 for data parallel; run_demo trains in one process"
        )
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 2 or nproc % tp):
        raise ValueError(
            f"tp={tp!r} must be an int >= 2 dividing nproc={nproc} (processes each block's MLP is split over)"
        )
    cfg = config or DemoConfig()
    if steps is not None:
        cfg = replace(cfg, steps=steps)
    replicas = nproc // (tp or 1)
    if cfg.batch_size < replicas:
        raise ValueError(
            f"batch_size={cfg.batch_size} gives some of {replicas} replicas no rows; use batch_size >= "
            f"{replicas}"
        )
    if tp is not None and (4 * cfg.dim) % tp:
        raise ValueError(
            f"tp={tp} does not divide the MLP width {4 * cfg.dim} (4 x dim={cfg.dim}); use a divisor"
        )
    return cfg


def _strategy(nproc: int, tp: int | None) -> str:
    if tp is None:
        return f"data-parallel over {nproc} processes (gloo on 127.0.0.1): one replica each"
    sharded = f", FSDP2 over {nproc // tp} replicas" if nproc > tp else ""
    return (
        f"tensor parallel over {nproc} processes (gloo on 127.0.0.1): each block's MLP split over tp "
        f"{tp}{sharded}"
    )


def _parity_lines(rank0: dict[str, Any]) -> list[str]:
    """What the tensor-parallel run's parity checks found (rank 0's record); none for data parallel."""
    lines = []
    if "gradient_check" in rank0:
        lines.append(GradientCheck(**rank0["gradient_check"]).line())
    if "one_device" in rank0:
        one = rank0["one_device"]
        lines.append(
            f"plain PyTorch on one device, the first {one['steps']} steps on the same global batches: "
            f"largest loss difference {one['largest_difference']:.2e}"
        )
    return lines


def _report(result: RanksDemoResult, cfg: DemoConfig, rows: str) -> dict[str, Path]:
    """``report.md`` (loss curve, per-rank throughput, parity, what you saw) and ``losses.json`` in
    ``result.out``."""
    ranks, nproc, losses = result.ranks, result.nproc, result.losses
    step_seconds = max(r["seconds"] for r in ranks)
    total = sum(r["samples"] for r in ranks) / step_seconds if step_seconds > 0 else 0.0
    how = (
        "torchspan.span(model) in each"
        if result.tp is None
        else f"torchspan.span(model, tp={result.tp}, tp_plan={TP_PLAN})"
    )
    summary = {
        "strategy": f"{_strategy(nproc, result.tp)} ({how}; {ranks[0]['threads']} thread(s) each); "
        f"global batch {cfg.batch_size} x {cfg.seq_len} characters split {rows} rows",
        "steps": cfg.steps,
        "model": f"CharTransformer, {cfg.depth} blocks, dim {cfg.dim}",
        "loss": f"{losses[0]:.3f} -> {losses[-1]:.3f}",
        "per-rank throughput": "; ".join(
            f"rank {r['rank']}: {r['samples_per_second']:,.1f} samples/s" for r in ranks
        ),
        "all ranks": f"{total:,.1f} samples/s ({total * cfg.seq_len:,.0f} tokens/s); {result.seconds:.1f} "
        "s wall "
        "clock including process start",
    }
    kind = "data parallel" if result.tp is None else "tensor parallel"
    files = pictures.write_report(
        result.out,
        title=f"torchspan demo: {kind} over {nproc} processes",
        losses=losses,
        summary=summary,
        sample=result.sample or None,
    )
    table = md_table(
        ("rank", "samples", "training seconds", "samples/s", "tokens/s"),
        [
            (
                str(r["rank"]),
                str(r["samples"]),
                f"{r['seconds']:.2f}",
                f"{r['samples_per_second']:,.1f}",
                f"{r['tokens_per_second']:,.0f}",
            )
            for r in ranks
        ],
    )
    report = (
        files.report.read_text(encoding="utf-8") + "\n## Per-rank throughput\n\n" + "\n".join(table) + "\n"
    )
    if result.parity:
        report += "\n## Against one device\n\n" + "".join(f"- {line}\n" for line in result.parity)
    report += f"\n## What you saw\n\n{guide(nproc, result.tp)}\n"
    write_text(files.report, report, name="out")
    write_text(result.out / "losses.json", json.dumps(losses), name="out")
    written = {"report": files.report, "losses": result.out / "losses.json"}
    if files.loss is not None:
        written["loss"] = files.loss
    return written

"""The demo driver: plan a small language model for this machine's devices, train it, draw what happened.

Usage::

    from torchspan.demo import run_demo
    result = run_demo(devices="cpu,cpu", steps=300, out="torchspan-demo")
    result.losses[0], result.losses[-1], result.files["timeline"]

Writes ``plan.json``, ``loss.png``, ``timeline.png``, ``memory.png`` and ``report.md`` into ``out``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .. import pictures
from ..files import output_folder, write_text
from ..hardware import Device, devices as find_devices
from ..planner.plans import Plan
from ..runtime.record import Event
from ..training import train
from .corpus import Corpus, build_corpus
from .model import CharTransformer, generate, lm_loss
from .placement import demo_plan

__all__ = ["run_demo", "DemoResult", "DemoConfig", "DEFAULT_STEPS"]

DEFAULT_STEPS = 500
DEMO_FILES = ("plan.json", "report.md", "losses.json", "loss.png", "timeline.png", "memory.png")  # what `out` receives


@dataclass
class DemoConfig:
    """Sizes of the demo run. The defaults train in under a minute on a quiet 2-core CPU."""

    steps: int = DEFAULT_STEPS
    batch_size: int = 32
    seq_len: int = 64
    dim: int = 128
    depth: int = 4
    heads: int = 4
    lr: float = 3e-3
    seed: int = 0
    corpus: str = "package"
    sample_chars: int = 240
    prompt: str = "def "
    microbatches: int | str = "auto"
    schedule: str = "auto"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "dim", "depth", "heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.microbatches != "auto" and (
            isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1
        ):
            raise ValueError(f"microbatches={self.microbatches!r} must be 'auto' or an int >= 1")
        if self.schedule not in ("auto", "gpipe", "1f1b"):
            raise ValueError(f"schedule={self.schedule!r} is not one of auto, gpipe, 1f1b")
        if self.sample_chars < 0:
            raise ValueError(f"sample_chars={self.sample_chars!r} must be >= 0")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr={self.lr!r} must be a finite number > 0")


@dataclass
class DemoResult:
    """What the demo did: the plan it ran, the losses, speed, the sample and the files it wrote."""

    out: Path
    plan: Plan
    devices: list[Device]
    losses: list[float]
    seconds: float
    tokens_per_second: float
    sample: str
    events: list[Event]
    memory: Any
    files: dict[str, Path] = field(default_factory=dict)


def _device_table(devs: list[Device], title: str) -> Table:
    table = Table(title=title)
    for col in pictures.DEVICE_COLUMNS:
        table.add_column(col, justify="right" if col in ("total", "free", "budget") else "left")
    for row in pictures.device_rows(devs):
        table.add_row(*row)
    return table


def _plan_table(plan: Plan) -> Table:
    table = Table(title="plan", caption=pictures.plan_caption(plan))  # with the runner-up when within noise
    for col in pictures.PLAN_COLUMNS:
        table.add_column(col, justify="left" if col in ("device", "layers") else "right")
    for row in pictures.plan_rows(plan):
        table.add_row(*row)
    return table


def _tail_mean(values: list[float], n: int = 20) -> float:
    tail = values[-n:]
    return sum(tail) / len(tail)


def _budgets(devs: list[Device]) -> dict[str, int]:
    return {str(d.device): d.budget for d in devs if d.budget is not None}


def run_demo(
    devices: str | list[str] = "auto",
    memory: Mapping[str, str | int] | None = None,
    steps: int | None = None,
    out: str | Path = "torchspan-demo",
    *,
    console: Console | None = None,
    config: DemoConfig | None = None,
    schedule: str | None = None,
    microbatches: int | str | None = None,
) -> DemoResult:
    """Train the demo language model with the planner + ``span`` and write the report to ``out``.

    With several devices listed explicitly (``"cpu,cpu"``) the model is spread over all of them,
    as ``demo.placement`` explains, so the pipeline shows even where one device would be faster.

    ``devices``/``memory`` are as for ``torchspan.devices``; a tight budget on the first device
    pushes layers to the next one. ``steps`` overrides ``config.steps`` (default ``DEFAULT_STEPS``);
    ``schedule``/``microbatches`` override the planner's choice
    (``"gpipe"``/``"1f1b"``, an int); ``config`` sets sizes. Returns a :class:`DemoResult`; raises ``ValueError`` for bad
    input and ``torchspan.PlanError`` when the model fits nowhere.
    """
    import torchspan

    cfg = _config(config, steps=steps, schedule=schedule, microbatches=microbatches)
    con = console or Console(markup=False)  # printed text keeps its square brackets
    out_dir = out_folder(out)
    devs = find_devices(devices, memory=memory)
    con.print(_device_table(devs, f"devices ({devices if isinstance(devices, str) else ','.join(devices)})"))

    torch.manual_seed(cfg.seed)
    corpus: Corpus = build_corpus(cfg.corpus, seed=cfg.seed)
    model = CharTransformer(corpus.vocab_size, dim=cfg.dim, depth=cfg.depth, heads=cfg.heads, seq_len=cfg.seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    con.print(
        f"corpus: {len(corpus.text):,} characters of torchspan's own {cfg.corpus} text; "
        f"model: {n_params:,} parameters in {len(list(model.children()))} layers"
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    spread = len(devs) > 1 and not (isinstance(devices, str) and devices.strip().lower() == "auto")
    plan = _plan(model, corpus, cfg, devs, spread, gen, out_dir, con)

    spanned = torchspan.span(model, plan)
    optimizer = torch.optim.AdamW(spanned.parameters(), lr=cfg.lr)
    trained = train(
        spanned,
        optimizer,
        lambda step: corpus.batch(cfg.batch_size, cfg.seq_len, gen),
        lm_loss,
        cfg.steps,
        console=con,
        items_per_step=cfg.batch_size * cfg.seq_len,
        speed_unit="tok/s",
        memory_every=10,
    )
    events = list(spanned.timeline())
    mem = spanned.memory(optimizer)
    sample = _sample(spanned.module, corpus, cfg, gen, con)
    result = DemoResult(
        out=out_dir,
        plan=plan,
        devices=devs,
        losses=trained.losses,
        seconds=trained.seconds,
        tokens_per_second=trained.items_per_second,
        sample=sample,
        events=events,
        memory=mem,
    )
    result.files = _write_report(result, cfg, n_params, con)
    return result


def _config(config: DemoConfig | None, **overrides: Any) -> DemoConfig:
    """``config`` (default ``DemoConfig()``) with the keyword arguments that are not ``None``."""
    cfg = config or DemoConfig()
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(cfg, **given) if given else cfg


def out_folder(out: str | Path) -> Path:
    """The report folder, checked (nothing but regular files where the report goes, writable) and created if
    missing; a ``ValueError`` naming ``out`` when it cannot be."""
    out_dir = output_folder(out, name="out", files=DEMO_FILES, example="torchspan-demo")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"out={str(out)!r}: cannot create the folder ({exc.strerror or exc}); name a folder you can write to") from exc
    return out_dir


def _plan(
    model: CharTransformer,
    corpus: Corpus,
    cfg: DemoConfig,
    devs: list[Device],
    spread: bool,
    gen: torch.Generator,
    out_dir: Path,
    con: Console,
) -> Plan:
    """Profile and plan on one example batch (drawn from ``gen``), save ``plan.json`` and print the plan."""
    example, _ = corpus.batch(cfg.batch_size, cfg.seq_len, gen)
    with con.status("profiling the model and planning ..."):
        plan = demo_plan(model, example, devs, spread=spread, microbatches=cfg.microbatches, schedule=cfg.schedule)
    plan.save(out_dir / "plan.json")
    con.print(_plan_table(plan))
    for note in plan.notes:
        con.print(Text(f"note: {note}", style="dim"))  # a note may hold brackets (shapes, lists): never markup
    return plan


def _sample(model: torch.nn.Module, corpus: Corpus, cfg: DemoConfig, gen: torch.Generator, con: Console) -> str:
    """Text the trained model writes after ``cfg.prompt`` (empty when ``cfg.sample_chars`` is 0)."""
    if not cfg.sample_chars:
        return ""
    ids = generate(model, corpus.encode(cfg.prompt), cfg.sample_chars, generator=gen)
    sample = cfg.prompt + corpus.decode(ids)
    con.print(Panel(Text(sample), title="sample from the trained model", expand=False))  # as written: `dict[str, Any]` stays
    return sample


def _write_report(result: DemoResult, cfg: DemoConfig, n_params: int, con: Console) -> dict[str, Path]:
    """Draw the report and save the losses into ``result.out``; returns the files written by name."""
    out_dir, plan, losses, seconds = result.out, result.plan, result.losses, result.seconds
    summary = {
        "devices": ", ".join(str(d.device) for d in result.devices),
        "steps": cfg.steps,
        "batch": f"{cfg.batch_size} x {cfg.seq_len} characters",
        "model": f"{n_params:,} parameters, {cfg.depth} blocks, dim {cfg.dim}",
        "loss": f"{losses[0]:.3f} -> {losses[-1]:.3f} (mean of the last {min(20, len(losses))} steps: {_tail_mean(losses):.3f})",
        "training time": f"{seconds:.1f} s ({seconds / cfg.steps * 1e3:.1f} ms per step"
        + (f"; plan predicted {plan.predicted_step_time * 1e3:.1f} ms)" if plan.predicted_step_time else ")"),
        "tokens/s": f"{result.tokens_per_second:,.0f}",
    }
    with con.status("drawing the report ..."):
        files = pictures.write_report(
            out_dir,
            title="torchspan demo",
            plan=plan,
            devices=result.devices,
            events=result.events,
            memory=result.memory,
            losses=losses,
            budgets=_budgets(result.devices),
            summary=summary,
            sample=result.sample or None,
        )
    write_text(out_dir / "losses.json", json.dumps(losses), name="out")
    written = {"plan": out_dir / "plan.json", "report": files.report, "losses": out_dir / "losses.json"}
    for name in ("loss", "timeline", "memory"):
        path = getattr(files, name)
        if path is not None:
            written[name] = path
    con.print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (last-20 mean {_tail_mean(losses):.3f}) in {cfg.steps} steps, {seconds:.1f} s, "
        f"{result.tokens_per_second:,.0f} tokens/s. Report: {files.report}"
    )
    return written

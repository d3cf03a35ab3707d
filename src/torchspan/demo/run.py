"""The demo driver: plan a small language model for this machine's devices, span it, check it, train it, draw
it.

On any machine the demo shows a span: without a GPU, ``torchspan.plan`` keeps the model on the CPU (one
stage), so the demo runs it as two pipeline stages on the CPU instead and says so
(``spanning.choose_devices``). Before training, one step's gradients are compared with the same model on one
device (the exact-gradient check), and plain PyTorch on one device trains the first steps beside the span on
the same batches. Where there is no GPU, the planner also says what a two-GPU machine would run
(``placement.gpu_machine``).

Usage::

    from torchspan.demo import run_demo
    result = run_demo(steps=300, out="torchspan-demo")
    result.check.max_abs, result.losses[-1], result.files["timeline"]

Writes ``plan.json``, ``loss.png``, ``timeline.png``, ``memory.png``, ``losses.json`` and ``report.md`` (what
ran and why, the check, the pictures) into ``out``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping
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
from ..hardware import Device
from ..planner.plans import Plan
from ..runtime.record import Event
from ..schedule import SCHEDULES
from ..training import train
from .corpus import Corpus, build_corpus
from .model import CharTransformer, generate, lm_loss
from .placement import Placement, demo_plan, gpu_machine
from .spanning import (
    DemoDevices,
    GradientCheck,
    OneDevice,
    choose_devices,
    gradient_check,
    one_device_run,
    reference_copy,
)
from .story import check_lines, describe, guide, guide_line, next_lines, spans, why_lines

__all__ = ["run_demo", "DemoResult", "DemoConfig", "DEFAULT_STEPS"]

DEFAULT_STEPS = 300
DEMO_FILES = (
    "plan.json",
    "report.md",
    "losses.json",
    "loss.png",
    "timeline.png",
    "memory.png",
)  # what `out` receives


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
    compare_steps: int = 20  # plain PyTorch on one device beside the span for this many first steps (0: none)
    gpu_note: bool = True  # where no GPU is found, say what a two-GPU machine would run (from the planner)

    def __post_init__(self) -> None:
        if (
            isinstance(self.compare_steps, bool)
            or not isinstance(self.compare_steps, int)
            or self.compare_steps < 0
        ):
            raise ValueError(f"compare_steps={self.compare_steps!r} must be an int >= 0")
        for name in ("steps", "batch_size", "seq_len", "dim", "depth", "heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.microbatches != "auto" and (
            isinstance(self.microbatches, bool)
            or not isinstance(self.microbatches, int)
            or self.microbatches < 1
        ):
            raise ValueError(f"microbatches={self.microbatches!r} must be 'auto' or an int >= 1")
        if self.schedule != "auto" and self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of auto, {', '.join(SCHEDULES)}")
        if self.sample_chars < 0:
            raise ValueError(f"sample_chars={self.sample_chars!r} must be >= 0")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr={self.lr!r} must be a finite number > 0")


@dataclass
class DemoResult:
    """What the demo did: the plan it ran (and ``torchspan.plan``'s own choice), the exact-gradient check,
    plain PyTorch beside it, the losses, speed, the sample, what it ran and why (``story``) and the files it
    wrote."""

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
    chosen: Plan | None = None  # torchspan.plan's choice for the same devices (the plan itself unless spread)
    found: list[Device] = field(default_factory=list)  # the devices the spec found on this machine
    check: GradientCheck | None = None  # None where nothing was spanned
    one_device: OneDevice | None = None
    ms_per_step: float = 0.0  # the span's train_step plus optimizer step, median over the steps
    story: list[str] = field(default_factory=list)  # what ran and why, the check, plain PyTorch beside it
    gpu_machine: str = ""  # what a two-GPU machine would run, where none was found
    next: list[str] = field(default_factory=list)  # commands to run next


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
    """Plan the demo language model, span it, check its gradients, train it and write the report to ``out``.

    ``devices="auto"`` shows a span on any machine (``spanning.choose_devices``: two CPU stages where there is
    no GPU); with several devices listed explicitly (``"cpu,cpu"``) the model is spread over all of them, as
    ``demo.placement`` explains. Whenever something is split (stages or micro-batches), one step is checked
    against the same model on one device and plain PyTorch trains ``config.compare_steps`` steps beside it.

    ``devices``/``memory`` are as for ``torchspan.devices``; a tight budget on the first device
    pushes layers to the next one. ``steps`` overrides ``config.steps`` (default ``DEFAULT_STEPS``);
    ``schedule``/``microbatches`` override the planner's choice
    (``"gpipe"``/``"1f1b"``, an int); ``config`` sets sizes. Returns a :class:`DemoResult`; raises
    ``ValueError`` for bad input and ``torchspan.PlanError`` when the model fits nowhere.
    """
    import torchspan

    cfg = _config(config, steps=steps, schedule=schedule, microbatches=microbatches)
    con = console or Console(markup=False)  # printed text keeps its square brackets
    out_dir = out_folder(out)
    setup = choose_devices(devices, memory)
    con.print(
        _device_table(setup.found, f"devices ({devices if isinstance(devices, str) else ','.join(devices)})")
    )

    corpus, model, n_params = _model(cfg, con)
    batch = _batches(corpus, cfg)
    placement, gpu = _plan(model, corpus, cfg, setup, out_dir, con)
    story = why_lines(setup, placement)
    _say(con, *story)
    reference = (
        reference_copy(model, placement.plan.stages[0].device) if spans(placement.plan) else None
    )  # before span moves it

    spanned = torchspan.span(model, placement.plan)
    optimizer = torch.optim.AdamW(spanned.parameters(), lr=cfg.lr)
    check, one = _check(spanned, reference, batch, cfg, con)
    trained, span_ms, compared = _train(spanned, optimizer, batch, cfg, con, check, one)
    result = DemoResult(
        out=out_dir,
        plan=placement.plan,
        devices=setup.used,
        losses=trained.losses,
        seconds=trained.seconds,
        tokens_per_second=trained.items_per_second,
        sample=_sample(spanned.module, corpus, cfg, torch.Generator().manual_seed(cfg.seed), con),
        events=list(spanned.timeline()),
        memory=spanned.memory(optimizer),
        chosen=placement.chosen,
        found=setup.found,
        check=check,
        one_device=one,
        ms_per_step=span_ms,
        story=story + compared,
        gpu_machine=gpu,
        next=next_lines(placement),
    )
    result.files = _write_report(result, cfg, n_params, con)
    return result


def _model(cfg: DemoConfig, con: Console) -> tuple[Corpus, CharTransformer, int]:
    """The corpus (torchspan's own text), the demo model on it (seeded) and its parameter count, said."""
    torch.manual_seed(cfg.seed)
    corpus: Corpus = build_corpus(cfg.corpus, seed=cfg.seed)
    model = CharTransformer(
        corpus.vocab_size, dim=cfg.dim, depth=cfg.depth, heads=cfg.heads, seq_len=cfg.seq_len
    )
    n_params = sum(p.numel() for p in model.parameters())
    con.print(
        f"corpus: {len(corpus.text):,} characters of torchspan's own {cfg.corpus} text; "
        f"model: {n_params:,} parameters in {len(list(model.children()))} layers"
    )
    return corpus, model, n_params


def _train(
    spanned: Any,
    optimizer: Any,
    batch: Callable[[int], Any],
    cfg: DemoConfig,
    con: Console,
    check: Any,
    one: Any,
) -> tuple[Any, float, list[str]]:
    """The span trained ``cfg.steps`` steps (live figures), its median ms per step, and the lines comparing it
    with the check and plain PyTorch (said, but the first)."""
    items = cfg.batch_size * cfg.seq_len
    trained = train(
        spanned,
        optimizer,
        batch,
        lm_loss,
        cfg.steps,
        console=con,
        items_per_step=items,
        speed_unit="tok/s",
        memory_every=10,
    )
    span_ms = 1e3 * statistics.median(a + b for a, b in zip(trained.step_times, trained.optimizer_times))
    compared = check_lines(check, one, trained.losses, span_ms)
    _say(con, *compared[1:])
    return trained, span_ms, compared


def _say(con: Console, *lines: str, style: str | None = None) -> None:
    """Print each line as text (never markup: plans and devices hold brackets)."""
    for line in lines:
        con.print(Text(line, style=style or ""))


def _batches(corpus: Corpus, cfg: DemoConfig) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """``batch(step)``: the training batch of a step, the same whoever asks (the span, plain PyTorch, the
    check)."""
    return lambda step: corpus.batch(
        cfg.batch_size, cfg.seq_len, torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    )


def _check(
    spanned: Any,
    reference: torch.nn.Module | None,
    batch: Callable[[int], Any],
    cfg: DemoConfig,
    con: Console,
) -> tuple[GradientCheck | None, OneDevice | None]:
    """The exact-gradient check on the first batch, then plain PyTorch on one device for the first steps
    (timed)."""
    if reference is None:
        return None, None
    with con.status(f"checking one step's gradients against {next(reference.parameters()).device} alone ..."):
        check = gradient_check(spanned, reference, *batch(0), lm_loss)
    _say(con, check.line(), style="bold green" if check.ok else "bold red")
    steps = min(cfg.compare_steps, cfg.steps)
    if not steps:
        return check, None
    with con.status(f"plain PyTorch on one device, {steps} steps ..."):
        one = one_device_run(reference, batch, lm_loss, steps=steps, lr=cfg.lr)
    _say(
        con,
        f"plain PyTorch on {one.device}: {steps} steps at {one.ms_per_step:.1f} ms per step; now the span "
        "trains on the same batches:",
    )
    return check, one


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
        raise ValueError(
            f"out={str(out)!r}: cannot create the folder ({exc.strerror or exc}); name a folder you can "
            "write to"
        ) from exc
    return out_dir


def _plan(
    model: CharTransformer, corpus: Corpus, cfg: DemoConfig, setup: DemoDevices, out_dir: Path, con: Console
) -> tuple[Placement, str]:
    """Profile and plan on one example batch, save ``plan.json`` and print the plan; with no GPU found, also
    what a two-GPU machine would run (``""`` otherwise)."""
    example, _ = corpus.batch(cfg.batch_size, cfg.seq_len, torch.Generator().manual_seed(cfg.seed + 1))
    with con.status("profiling the model and planning ..."):
        placement = demo_plan(
            model,
            example,
            setup.used,
            spread=setup.spread,
            microbatches=cfg.microbatches,
            schedule=cfg.schedule,
        )
        gpu = (
            ""
            if setup.has_accelerator or not cfg.gpu_note
            else gpu_machine(model, example, microbatches=cfg.microbatches, schedule=cfg.schedule)
        )
    placement.plan.save(out_dir / "plan.json")
    con.print(_plan_table(placement.plan))
    for note in placement.plan.notes:
        con.print(
            Text(f"note: {note}", style="dim")
        )  # a note may hold brackets (shapes, lists): never markup
    return placement, gpu


def _sample(
    model: torch.nn.Module, corpus: Corpus, cfg: DemoConfig, gen: torch.Generator, con: Console
) -> str:
    """Text the trained model writes after ``cfg.prompt`` (empty when ``cfg.sample_chars`` is 0)."""
    if not cfg.sample_chars:
        return ""
    ids = generate(model, corpus.encode(cfg.prompt), cfg.sample_chars, generator=gen)
    sample = cfg.prompt + corpus.decode(ids)
    con.print(
        Panel(Text(sample), title="sample from the trained model", expand=False)
    )  # as written: `dict[str, Any]` stays
    return sample


def _sections(result: DemoResult) -> list[tuple[str, list[str]]]:
    """``report.md``'s sections after the summary: what ran and why (with the check), a GPU machine, what to
    run next, and the guide that explains it."""
    sections = [("What ran and why", [f"- {line}" for line in result.story])]
    if result.gpu_machine:
        sections.append(("On a GPU machine", [result.gpu_machine]))
    sections.append(("Next", ["```bash", *result.next, "```"]))
    sections.append(("What you saw", [guide()]))
    return sections


def _write_report(result: DemoResult, cfg: DemoConfig, n_params: int, con: Console) -> dict[str, Path]:
    """Draw the report and save the losses into ``result.out``; returns the files written by name."""
    out_dir, plan, losses, seconds = result.out, result.plan, result.losses, result.seconds
    summary = {
        "ran": describe(plan)
        + (
            ""
            if result.chosen is None or result.chosen is plan
            else f"; torchspan.plan alone: {describe(result.chosen)}"
        ),
        "exact gradients": "not checked: nothing was split"
        if result.check is None
        else f"{'PASS' if result.check.ok else 'FAIL'}: max abs diff {result.check.max_abs:.3e}, max rel "
        f"diff {result.check.max_rel:.3e} "
        f"against {result.check.device} alone",
        "devices": ", ".join(str(d.device) for d in result.devices),
        "steps": cfg.steps,
        "batch": f"{cfg.batch_size} x {cfg.seq_len} characters",
        "model": f"{n_params:,} parameters, {cfg.depth} blocks, dim {cfg.dim}",
        "loss": f"{losses[0]:.3f} -> {losses[-1]:.3f} (mean of the last {min(20, len(losses))} steps: "
        f"{_tail_mean(losses):.3f})",
        "training time": f"{seconds:.1f} s (median {result.ms_per_step:.1f} ms per step"
        + (f"; plan predicted {plan.predicted_step_time * 1e3:.1f} ms)" if plan.predicted_step_time else ")"),
        "tokens/s": f"{result.tokens_per_second:,.0f}",
    }
    with con.status("drawing the report ..."):
        files = pictures.write_report(
            out_dir,
            title="torchspan demo",
            plan=plan,
            devices=result.found or result.devices,
            events=result.events,
            memory=result.memory,
            losses=losses,
            budgets=_budgets(result.devices),
            summary=summary,
            sections=_sections(result),
            sample=result.sample or None,
        )
    write_text(out_dir / "losses.json", json.dumps(losses), name="out")
    written = {"plan": out_dir / "plan.json", "report": files.report, "losses": out_dir / "losses.json"}
    for name in ("loss", "timeline", "memory"):
        path = getattr(files, name)
        if path is not None:
            written[name] = path
    if result.gpu_machine:
        _say(con, result.gpu_machine)
    _say(con, "next:")
    for line in result.next:
        _say(con, f"  {line}", style="dim" if line.startswith("#") else None)
    _say(
        con,
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (last-20 mean {_tail_mean(losses):.3f}) in {cfg.steps} "
        f"steps, {seconds:.1f} s, {result.tokens_per_second:,.0f} tokens/s. Report: {files.report}",
    )
    _say(con, guide_line())
    return written

"""Tests for torchspan.pictures: pictures from synthesised timelines, memory tables and losses."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from torchspan import pictures
from torchspan.hardware import devices
from torchspan.planner.plans import Plan, StagePlan
from torchspan.runtime.record import Event

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def simulate(
    schedule: str, stages: int = 2, mbs: int = 4, step: int = 0, fwd: float = 1.0, bwd: float = 2.0
) -> list[Event]:
    """Events of an ideal pipeline: each stage runs its action list as soon as inputs are ready."""
    order: list[list[tuple[str, int]]] = []
    for s in range(stages):
        if schedule == "gpipe":
            acts = [("forward", m) for m in range(mbs)] + [("backward", m) for m in reversed(range(mbs))]
        else:
            warm = min(stages - s, mbs)
            acts = [("forward", m) for m in range(warm)]
            nf, nb = warm, 0
            while nb < mbs:
                acts.append(("backward", nb))
                nb += 1
                if nf < mbs:
                    acts.append(("forward", nf))
                    nf += 1
        order.append(acts)
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * stages
    pos = [0] * stages
    events: list[Event] = []
    while any(pos[s] < len(order[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if pos[s] >= len(order[s]):
                continue
            kind, m = order[s][pos[s]]
            dep = ("forward", s - 1, m) if kind == "forward" and s > 0 else None
            if kind == "backward":
                dep = ("backward", s + 1, m) if s < stages - 1 else ("forward", s, m)
            if dep is not None and dep not in done:
                continue
            start = max(clock[s], done.get(dep, 0.0) if dep else 0.0)
            if dep and dep[1] != s:
                events.append(Event(step, s, "cpu", m, "transfer", start, start + 0.1))
                start += 0.1
            end = start + (fwd if kind == "forward" else bwd)
            events.append(Event(step, s, "cpu", m, kind, start, end))
            done[(kind, s, m)] = end
            clock[s] = end
            pos[s] += 1
            progressed = True
        assert progressed, "simulated schedule deadlocked"
    return events


def test_simulated_schedules_are_consistent_and_differ():
    g, f = simulate("gpipe"), simulate("1f1b")
    assert pictures.timeline_problems(g) == []
    assert pictures.timeline_problems(f) == []
    order = lambda evs: [
        (e.kind, e.microbatch)
        for e in sorted(evs, key=lambda e: e.start)
        if e.stage == 0 and e.kind != "transfer"
    ]
    assert order(g) != order(f)


def test_timeline_problems_finds_overlap_and_backward_before_forward():
    evs = [
        Event(0, 0, "cpu", 0, "forward", 0.0, 1.0),
        Event(0, 0, "cpu", 1, "forward", 0.5, 1.5),  # overlaps micro-batch 0
        Event(0, 0, "cpu", 2, "backward", 2.0, 3.0),  # no forward for micro-batch 2
        Event(0, 1, "cpu", 0, "forward", 0.2, 0.4),  # before stage 0 finished micro-batch 0
    ]
    problems = pictures.timeline_problems(evs)
    assert any("overlaps" in p for p in problems)
    assert any("has a backward but no forward" in p for p in problems)
    assert any("before stage 0 finished" in p for p in problems)
    # transfers may overlap compute (copies on their own stream)
    ok = [Event(0, 0, "cpu", 0, "forward", 0.0, 1.0), Event(0, 0, "cpu", 1, "transfer", 0.5, 0.7)]
    assert pictures.timeline_problems(ok) == []


def test_timeline_png_draws_last_step_and_validates(tmp_path):
    evs = simulate("gpipe", step=0) + simulate("1f1b", stages=3, step=1)
    out = pictures.timeline_png(evs, tmp_path / "sub" / "t.png")
    w, h = png_size(out)
    assert w > 400 and h > 100
    with pytest.raises(ValueError, match="step=5 has no events"):
        pictures.timeline_png(evs, tmp_path / "x.png", step=5)
    with pytest.raises(ValueError, match="events is empty"):
        pictures.timeline_png([], tmp_path / "x.png")
    with pytest.raises(ValueError, match="not a torchspan.runtime.record.Event"):
        pictures.timeline_png([("cpu", 0)], tmp_path / "x.png")  # type: ignore[list-item]
    with pytest.raises(ValueError, match="kind='sleep'"):
        pictures.timeline_png([Event(0, 0, "cpu", 0, "sleep", 0, 1)], tmp_path / "x.png")


def test_gpipe_and_1f1b_pictures_differ(tmp_path):
    a = pictures.timeline_png(simulate("gpipe"), tmp_path / "g.png", title="t")
    b = pictures.timeline_png(simulate("1f1b"), tmp_path / "f.png", title="t")
    assert a.read_bytes() != b.read_bytes()


def test_normalize_memory_accepts_runtime_shapes():
    per_device = {"cpu": {"param_bytes": 10, "grad_bytes": 10, "optimizer_bytes": 20, "peak_activations": 5}}
    assert pictures.normalize_memory(per_device) == {
        "cpu": {"params": 10, "grads": 10, "optimizer": 20, "activations": 5, "buffers": 0}
    }
    per_stage = [{"stage": 0, "device": "cpu", "params": 1}, {"stage": 1, "device": "meta", "activations": 7}]
    rows = pictures.normalize_memory(per_stage)
    assert rows == {
        "stage 0\ncpu": {"params": 1, "grads": 0, "optimizer": 0, "activations": 0, "buffers": 0},
        "stage 1\nmeta": {"params": 0, "grads": 0, "optimizer": 0, "activations": 7, "buffers": 0},
    }
    assert pictures.normalize_memory({"stages": per_stage}) == rows
    with pytest.raises(ValueError, match="memory=None"):
        pictures.normalize_memory(None)
    with pytest.raises(ValueError, match="mixes numbers and tables"):
        pictures.normalize_memory({"cpu": {"params": 1}, "total": 3})
    with pytest.raises(ValueError, match="not a byte count"):
        pictures.normalize_memory({"cpu": {"params": -1}})


def test_memory_kinds_are_the_profiles_and_buffers_count():
    # one vocabulary: the picture shows every kind spanned.memory() measures and a plan predicts
    from torchspan.profiler.costs import MEMORY_KINDS

    assert pictures.MEMORY_KINDS is MEMORY_KINDS
    rows = pictures.normalize_memory([{"stage": 0, "device": "cpu", "params": 4, "buffers": 6}])
    assert rows == {"stage 0\ncpu": {"params": 4, "grads": 0, "optimizer": 0, "activations": 0, "buffers": 6}}
    assert pictures.normalize_memory({"cpu": {"buffer_bytes": 2}})["cpu"]["buffers"] == 2


def test_memory_png_with_budget(tmp_path):
    mem = {
        "cpu": {"params": 3 << 20, "grads": 3 << 20, "optimizer": 6 << 20, "activations": 2 << 20},
        "meta": {"params": 1 << 20},
    }
    out = pictures.memory_png(mem, tmp_path / "m.png", budgets={"cpu": 16 << 20, "meta": None})
    assert png_size(out)[0] > 200


def test_loss_png_rejects_bad_input(tmp_path):
    out = pictures.loss_png([4.0, 3.5, 3.0, 2.8], tmp_path / "l.png")
    assert png_size(out)[0] > 200
    with pytest.raises(ValueError, match="losses is empty"):
        pictures.loss_png([], tmp_path / "l.png")
    with pytest.raises(ValueError, match=r"losses\[1\]=nan"):
        pictures.loss_png([1.0, float("nan")], tmp_path / "l.png")
    with pytest.raises(ValueError, match="smoothing"):
        pictures.loss_png([1.0], tmp_path / "l.png", smoothing=1.0)


def test_write_report_links_every_picture(tmp_path):
    plan = Plan(
        stages=[StagePlan("cpu", ["embed", "block0"], param_bytes=100), StagePlan("cpu", ["head"])],
        microbatches=4,
        schedule="1f1b",
    )
    files = pictures.write_report(
        tmp_path / "r",
        title="demo",
        plan=plan,
        devices=devices("cpu"),
        events=simulate("1f1b"),
        memory={"cpu": {"params": 100}},
        losses=[3.0, 2.0],
        summary={"steps": 2},
        sample="def ```x```",
    )
    text = files.report.read_text()
    for picture in (files.loss, files.timeline, files.memory):
        assert picture is not None and picture.exists()
        assert f"]({picture.name})" in text
        png_size(picture)
    assert "embed .. block0 (2)" in text and "1f1b" in text
    assert "| cpu |" in text
    assert "````text" in text  # fence longer than any backtick run in the sample


def test_training_progress_keeps_the_last_memory_when_none_is_given():
    import io

    from rich.console import Console

    from torchspan.progress import TrainingProgress, memory_text

    memory = {"cpu": {"params": 3 * 2**20, "grads": 2**20, "optimizer": 0, "activations": 0}}
    with TrainingProgress(Console(file=io.StringIO(), width=160), total=3) as bar:
        fields = bar._progress.tasks[0].fields
        assert fields["mem"] == "-"
        bar.step(loss=2.0, speed=10.0, memory=memory)
        assert fields["mem"] == memory_text(memory) == "mem cpu 4.0M"
        bar.step(loss=1.5, speed=12.0)
        assert (fields["mem"], fields["loss"], bar._progress.tasks[0].completed) == (
            "mem cpu 4.0M",
            "1.500",
            2,
        )

"""``schedule="interleaved-1f1b"`` in one process: stages looped over devices (``runtime.local.looped``),
exact against one device, run in Megatron's order per worker, drawn in the timeline; refused where it cannot
run."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

import torchspan
from torchspan import pictures
from torchspan import schedule as sched
from torchspan.runtime.local.looped import looped_workers


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6), nn.Linear(6, 4)).double()


def test_interleaved_in_one_process_is_exact_runs_megatrons_order_and_is_drawn(tmp_path: Path) -> None:
    x = torch.randn(7, 5, dtype=torch.float64)
    y = torch.randn(7, 4, dtype=torch.float64)
    model = _model()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, devices=["cpu"] * 4, microbatches=4, schedule="interleaved-1f1b")
    got = spanned.train_step(x, y, nn.MSELoss())
    want = nn.MSELoss()(reference(x), y)
    want.backward()
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-6, atol=1e-7)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    events = spanned.timeline()
    assert pictures.timeline_problems(events) == []
    compute = sorted((e for e in events if e.kind in ("forward", "backward")), key=lambda e: e.start)
    # one worker holds the 4 stages: the blocks follow the schedule's order for that worker, never overlapping
    order = [
        (a.kind, a.stage, a.microbatch)
        for a in sched.merged_order(sched.build("interleaved-1f1b", 4, 4, 1), [0, 1, 2, 3])
    ]
    assert [(e.kind, e.stage, e.microbatch) for e in compute] == order
    assert all(b.start >= a.end - 1e-6 for a, b in itertools.pairwise(compute))
    png = pictures.timeline_png(
        events, tmp_path / "timeline.png", title="interleaved-1f1b, 4 stages on one worker"
    )
    assert png.stat().st_size > 1000


def test_interleaved_needs_looped_devices() -> None:
    assert looped_workers([[0, 2], [1, 3]], 4) == 2 and looped_workers([[0, 1], [2, 3]], 4) is None
    from torchspan.runtime.local.looped import LoopedPipeline
    from torchspan.runtime.memory import ActivationMeter
    from torchspan.runtime.record import Recorder

    pipe = LoopedPipeline(
        [torch.device("cpu")] * 4,
        recompute="never",
        precision="32",
        recorder=Recorder(),
        meter=ActivationMeter(4),
        groups=[[0, 1], [2, 3]],
    )
    with pytest.raises(
        ValueError, match=r"interleaved-1f1b' runs stage s on worker s % P .* schedule='1f1b'"
    ):
        pipe._plan("interleaved-1f1b", 4, 4)
    assert (
        len(
            LoopedPipeline(
                [torch.device("cpu")] * 4,
                recompute="never",
                precision="32",
                recorder=Recorder(),
                meter=ActivationMeter(4),
                groups=[[0, 2], [1, 3]],
            )._plan("interleaved-1f1b", 4, 4)
        )
        == 4
    )

"""``Spanned`` is a façade: everything that runs goes through the ``Executor`` interface.

A recording executor stands in for the local ones (as a multi-process executor will): the façade
must prepare, place, open a step and hand over targets and weights, and report what the executor
placed, without knowing which executor it holds.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from runtime_models import residual, sequential, untraceable
from torch import nn

import torchspan
from torchspan.runtime.executor import Executor, Settings, Work
from torchspan.runtime.local.pipelined import PipelinedExecutor
from torchspan.runtime.local.serial import SerialExecutor
from torchspan.runtime.memory import ActivationMeter
from torchspan.runtime.record import Recorder
from torchspan.runtime.spanned import Spanned


class Recording(Executor):
    """Runs the model whole on one device, one micro-batch at a time, and notes every call."""

    mode = "recording"

    def __init__(self, model: nn.Module, settings: Settings, recorder: Recorder) -> None:
        super().__init__([torch.device("cpu")], [[n for n, _ in model.named_children()]])
        self.model, self.settings, self.recorder = model, settings, recorder
        self.calls: list[str] = []
        self.root_attrs = {"extra": 0}

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
        self.calls.append("prepare")
        (x,) = args
        return Work([[c] for c in x.tensor_split(self.settings.microbatches)])

    def place(self, work: Work) -> None:
        self.calls.append("place")

    def forward(self, work: Work) -> list[Any]:
        self.calls.append(f"forward in step {self.recorder.step}")
        return [self.model(*c) for c in work.chunks]

    def train(
        self,
        work: Work,
        targets: Sequence[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        weights: Sequence[float],
        spec: Any = None,
    ) -> torch.Tensor:
        self.calls.append(f"train in step {self.recorder.step}")
        total = torch.zeros(())
        for (x,), y, w in zip(work.chunks, targets, weights):
            loss = loss_fn(self.model(x), y) * w
            loss.backward()
            total = total + loss.detach()
        return total


def spanned_with_recording(microbatches: int) -> tuple[Spanned, Recording, nn.Module]:
    model = sequential()
    settings = Settings(microbatches, "gpipe", "never", "32")
    recorder = Recorder()
    ex = Recording(model, settings, recorder)
    return Spanned(model, ex, settings, recorder, ActivationMeter(1), mode_reason="a test"), ex, model


def test_the_facade_runs_everything_through_the_executor() -> None:
    spanned, ex, model = spanned_with_recording(3)
    assert spanned.mode == "recording" and spanned.mode_reason == "a test"
    assert spanned.balance == [7] and spanned.devices == ["cpu"]
    x, y = torch.randn(7, 6), torch.randn(7, 3)
    out = spanned(x)
    assert ex.calls == ["prepare", "place", "forward in step 1"]
    torch.testing.assert_close(out, model(x))  # micro-batch outputs gathered in order
    ex.calls.clear()
    loss = spanned.train_step(x, y, nn.functional.mse_loss)
    assert ex.calls[0] == "prepare" and ex.calls[-2:] == ["place", "train in step 2"]
    torch.testing.assert_close(loss, nn.functional.mse_loss(model(x), y).detach())  # weights 3/7, 2/7, 2/7
    assert spanned.memory()[0]["params"] == sum(p.numel() * 4 for p in model.parameters())


def test_settings_belong_to_the_facade_and_the_executor_alike() -> None:
    spanned, ex, _ = spanned_with_recording(2)
    assert ex.settings is spanned._settings
    assert (spanned.microbatches, spanned.schedule, spanned.recompute, spanned.precision, spanned.scaler) == (
        2,
        "gpipe",
        "never",
        "32",
        None,
    )


@pytest.mark.parametrize(
    ("make", "kind"),
    [(sequential, PipelinedExecutor), (residual, PipelinedExecutor), (untraceable, SerialExecutor)],
)
def test_span_chooses_the_executor_by_mode(make: Callable[[], nn.Module], kind: type) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spanned = torchspan.span(make(), devices=["cpu", "cpu"])
    hook_warnings = [w for w in caught if "hook placement" in str(w.message)]
    assert len(hook_warnings) == (1 if kind is SerialExecutor else 0)
    assert all(w.filename == __file__ for w in hook_warnings)  # the warning points at the span() call
    assert isinstance(spanned._executor, kind) and spanned.mode == spanned._executor.mode


def test_a_pipelined_executor_refuses_the_hooks_mode_and_foreign_work() -> None:
    settings = Settings(1, "gpipe", "never", "32")
    dev = [torch.device("cpu")]
    with pytest.raises(ValueError, match="mode='own-forward' is not a pipelined mode"):
        PipelinedExecutor(
            sequential(),
            "own-forward",
            None,
            dev,
            [[str(i) for i in range(7)]],
            settings,
            Recorder(),
            ActivationMeter(1),
        )
    ex = PipelinedExecutor(
        sequential(),
        "sequential",
        None,
        dev,
        [[str(i) for i in range(7)]],
        settings,
        Recorder(),
        ActivationMeter(1),
    )
    with pytest.raises(ValueError, match="work.fns is None"):
        ex.forward(Work([[torch.randn(2, 6)]]))

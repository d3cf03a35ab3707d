"""A local pipeline counts saved activations once per kind of step, not every step (issue 21, less per-step
work).

The saved-tensor hooks behind ``Spanned.memory()`` cost ~10% of a small local pipeline's step. A step that
looks like the last metered one (micro-batch shapes, the loss, which parameters train, train/eval modes, which
chunks weigh zero, autocast) and starts from the same meter state reports that step's peak without the hooks;
anything else is metered afresh. Each case compares with a twin span that meters every step: a stale cached
peak would differ from it.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from test_ranks_speed_meter import _counting  # counts the tensors the meter is asked to hold
from torch import nn

import torchspan
from torchspan.runtime.memory import behaviour_key


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    ).double()


class _Twins:
    """The span under test and one that meters every step, stepped alike."""

    def __init__(self, schedule: str = "1f1b", recompute: str = "never") -> None:
        model = _model()
        self.a = torchspan.span(
            model,
            balance=[3, 3],
            devices=["cpu", "cpu"],
            microbatches=2,
            schedule=schedule,
            recompute=recompute,
        )
        self.b = torchspan.span(
            copy.deepcopy(model),
            balance=[3, 3],
            devices=["cpu", "cpu"],
            microbatches=2,
            schedule=schedule,
            recompute=recompute,
        )
        self.b._executor._pipeline._steps.wants = lambda signature: True  # type: ignore[method-assign]
        self.calls = _counting(self.a)

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_fn, metered: bool) -> None:  # type: ignore[no-untyped-def]
        self.calls.clear()
        for s in (self.a, self.b):
            torch.manual_seed(1)  # the same dropout masks
            s.train_step(x, y, loss_fn)
        assert bool(self.calls) == metered, (
            f"metered {len(self.calls)} saved tensors, expected metered={metered}"
        )
        got = [m["activations"] for m in self.a.memory()]
        want = [m["activations"] for m in self.b.memory()]
        assert got == want and min(want) > 0, (got, want)

    def each(self, fn) -> None:  # type: ignore[no-untyped-def]
        fn(self.a.module)
        fn(self.b.module)


def _data(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    return torch.randn(rows, 5, generator=g, dtype=torch.float64), torch.randn(
        rows, 4, generator=g, dtype=torch.float64
    )


def test_a_repeated_step_reports_the_metered_peak_and_a_new_shape_is_metered() -> None:
    t = _Twins()
    x, y = _data()
    t.step(x, y, nn.MSELoss(), metered=True)
    t.step(x, y, nn.MSELoss(), metered=False)  # a new loss object of the same kind: the same step
    t.step(*_data(), F.mse_loss, metered=True)  # another loss function
    t.step(*_data(), F.mse_loss, metered=False)  # new values, same shapes
    t.step(*_data(6), F.mse_loss, metered=True)  # fewer rows
    t.step(*_data(6), F.mse_loss, metered=False)
    t.step(x, y, F.mse_loss, metered=True)  # back to the first shape: metered again


def test_modes_frozen_parameters_and_held_activations_are_metered_afresh() -> None:
    t = _Twins(schedule="gpipe")
    x, y = _data()
    t.step(x, y, F.mse_loss, metered=True)
    t.each(lambda m: m.eval())  # no dropout masks saved
    t.step(x, y, F.mse_loss, metered=True)
    t.step(x, y, F.mse_loss, metered=False)
    t.each(lambda m: m[0].weight.requires_grad_(False))  # the first layer's input is no longer saved for it
    t.step(x, y, F.mse_loss, metered=True)
    t.each(lambda m: m[0].weight.requires_grad_(True))
    t.step(x, y, F.mse_loss, metered=True)
    held = t.a(x), t.b(x)  # a forward whose graph is still alive: the next step starts from more live bytes
    t.step(x, y, F.mse_loss, metered=True)
    del held
    t.step(x, y, F.mse_loss, metered=True)
    t.step(x, y, F.mse_loss, metered=False)


def test_loss_options_and_zero_weight_chunks_are_part_of_the_step() -> None:
    t = _Twins(recompute="except_last")
    x = _data()[0]
    labels = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    t.step(x, labels, functools.partial(F.cross_entropy, ignore_index=-1), metered=True)
    t.step(
        x, labels, functools.partial(F.cross_entropy, ignore_index=-1), metered=False
    )  # made anew: the same loss
    t.step(x, labels, functools.partial(F.cross_entropy, label_smoothing=0.1), metered=True)
    ignored = torch.tensor(
        [-100, -100, -100, -100, 0, 1, 2, 3]
    )  # the first chunk weighs 0: a different graph
    t.step(x, ignored, nn.CrossEntropyLoss(), metered=True)
    t.step(x, ignored, nn.CrossEntropyLoss(), metered=False)
    t.step(x, labels, nn.CrossEntropyLoss(), metered=True)
    t.step(x, labels, nn.CrossEntropyLoss(label_smoothing=0.2), metered=True)


def test_behaviour_key_compares_loss_options_not_identity() -> None:
    assert behaviour_key(nn.MSELoss()) == behaviour_key(nn.MSELoss())
    assert behaviour_key(nn.MSELoss()) != behaviour_key(nn.MSELoss(reduction="sum"))
    assert behaviour_key(nn.CrossEntropyLoss(weight=torch.ones(3))) != behaviour_key(
        nn.CrossEntropyLoss(weight=torch.ones(4))
    )
    assert behaviour_key(F.mse_loss) == behaviour_key(F.mse_loss) != behaviour_key(F.l1_loss)
    assert behaviour_key(lambda a, b: a) != behaviour_key(lambda a, b: a)
    weights = torch.ones(3)
    assert behaviour_key(functools.partial(F.cross_entropy, weight=weights)) == behaviour_key(
        functools.partial(F.cross_entropy, weight=weights)
    )

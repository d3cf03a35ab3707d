"""The loop users write, with ``precision="fp16"`` and with a loss that goes inf/NaN.

fp16: ``zero_grad(); train_step(...); optimizer.step()`` (no scaler call) must train exactly as the
same autocast + ``torch.amp.GradScaler`` loop on one device: ``.grad`` unscaled after ``train_step``,
a step whose gradients overflow skipped with the scale backed off, gradient accumulation over several
``train_step`` calls before one step, ``spanned.step(optimizer)`` and a ``GradScaler``-style loop
still right. On the CPU (fp16 autocast runs ``linear`` in fp16 there), float32 master weights.

Non-finite losses: ``train_step`` raises ``FloatingPointError`` naming the call and the micro-batch,
or warns with ``nonfinite="warn"``; an fp16 overflow the scaler skips is not an error.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

import torchspan
from torchspan.runtime.fp16 import SpanScaler


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(n: int, big: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of 8 rows; those in ``big`` have targets so large that fp16 gradients overflow at
    65536."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        out.append((x, y * 1e4 if i in big else y))
    return out


class Reference:
    """One device: the autocast + GradScaler loop from PyTorch's AMP recipe, micro-batches as torchspan splits
    them."""

    def __init__(self, model: nn.Module, microbatches: int, opt=torch.optim.SGD, **opt_args) -> None:
        self.model, self.microbatches = model, microbatches
        self.opt = opt(model.parameters(), **opt_args)
        self.scaler = torch.amp.GradScaler("cpu")

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for xm, ym in zip(x.tensor_split(self.microbatches), y.tensor_split(self.microbatches)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(self.model(xm), ym) * (len(xm) / len(x))
            self.scaler.scale(loss).backward()

    def step(self) -> None:
        self.scaler.step(self.opt)
        self.scaler.update()


def _same(model: nn.Module, reference: nn.Module, label: str, grads: bool = False) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        a, b = (p.grad, q.grad) if grads else (p.detach(), q.detach())
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{label}: {name}: {m}")


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize(
    "stepper", ["optimizer.step()", "spanned.step(opt)", "scaler.step(opt); scaler.update()"]
)
def test_fp16_plain_loop_matches_autocast_with_grad_scaler(microbatches: int, stepper: str) -> None:
    model = _model()
    ref = Reference(copy.deepcopy(model), microbatches, lr=0.05)
    spanned = torchspan.span(model, devices=["cpu", "cpu"], microbatches=microbatches, precision="fp16")
    assert isinstance(spanned.scaler, SpanScaler)
    opt = torch.optim.SGD(spanned.parameters(), lr=0.05)
    for i, (x, y) in enumerate(
        _batches(6, big=(2, 3))
    ):  # two overflows in a row: skipped, scale halved twice
        opt.zero_grad()
        ref.opt.zero_grad()
        spanned.train_step(x, y, nn.functional.mse_loss)
        ref.backward(x, y)
        if i in (2, 3):
            assert all(p.grad is None for p in model.parameters()), (
                "an overflowed step leaves no gradient to apply"
            )
        else:
            ref.scaler.unscale_(ref.opt)
            _same(model, ref.model, f"step {i}: .grad after train_step (unscaled)", grads=True)
        if stepper == "optimizer.step()":
            opt.step()
        elif stepper == "spanned.step(opt)":
            spanned.step(opt)
        else:
            spanned.scaler.unscale_(opt)  # what a GradScaler loop does before clipping: nothing left to do
            spanned.scaler.step(opt)
            spanned.scaler.update()
        ref.step()
        assert spanned.scaler.get_scale() == ref.scaler.get_scale(), f"step {i}: scale"
        _same(model, ref.model, f"step {i} ({stepper}): weights")
    assert ref.scaler.get_scale() == 65536.0 / 4


class Residual(nn.Module):
    """Blocks in a ModuleList: the model's own forward runs (modes own-forward / own-forward-serial)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(6, 16), nn.Linear(16, 3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h) + h
        return self.out(h)


@pytest.mark.parametrize("microbatches,mode", [(1, "own-forward-serial"), (2, "own-forward")])
def test_fp16_plain_loop_when_the_models_own_forward_runs(microbatches: int, mode: str) -> None:
    model = Residual()
    ref = Reference(copy.deepcopy(model), microbatches, lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one micro-batch: "no pipelining"
        spanned = torchspan.span(model, devices=["cpu", "cpu"], microbatches=microbatches, precision="fp16")
    opt = torch.optim.SGD(spanned.parameters(), lr=0.05)
    for i, (x, y) in enumerate(_batches(4, big=(2,))):
        opt.zero_grad()
        ref.opt.zero_grad()
        spanned.train_step(x, y, nn.functional.mse_loss)
        ref.backward(x, y)
        opt.step()
        ref.step()
        _same(model, ref.model, f"step {i}: weights")
    assert spanned.mode == mode and spanned.scaler.get_scale() == ref.scaler.get_scale() == 32768.0


def test_fp16_accumulation_over_train_steps_and_an_overflow_inside_it() -> None:
    model = _model()
    ref = Reference(copy.deepcopy(model), 1, opt=torch.optim.Adam, lr=0.01)
    spanned = torchspan.span(model, devices=["cpu", "cpu"], precision="fp16")
    opt = torch.optim.Adam(spanned.parameters(), lr=0.01)
    batches = _batches(9, big=(4,))
    for window in range(3):  # three optimizer steps of three train_step calls; the middle one overflows once
        opt.zero_grad()
        ref.opt.zero_grad()
        for x, y in batches[3 * window : 3 * window + 3]:
            spanned.train_step(x, y, nn.functional.mse_loss)
            ref.backward(x, y)
        opt.step()
        ref.step()
        assert spanned.scaler.get_scale() == ref.scaler.get_scale(), f"window {window}: scale"
        _same(model, ref.model, f"window {window}: weights")
        steps = {int(s["step"]) for s in opt.state.values()}
        assert steps == {int(s["step"]) for s in ref.opt.state.values()}, (
            f"window {window}: Adam's step count"
        )
    assert ref.scaler.get_scale() == 32768.0  # one skipped window


def test_fp16_clip_after_train_step_is_torchs_clip_after_unscale() -> None:
    model = _model()
    ref = Reference(copy.deepcopy(model), 2, lr=0.05)
    spanned = torchspan.span(model, devices=["cpu", "cpu"], microbatches=2, precision="fp16")
    opt = torch.optim.SGD(spanned.parameters(), lr=0.05)
    for i, (x, y) in enumerate(_batches(3, big=(1,))):
        opt.zero_grad()
        ref.opt.zero_grad()
        spanned.train_step(x, y, nn.functional.mse_loss)
        got = spanned.clip_grad_norm_(0.1)
        ref.backward(x, y)
        ref.scaler.unscale_(ref.opt)
        want = torch.nn.utils.clip_grad_norm_(ref.model.parameters(), 0.1)
        if i == 1:
            assert not math.isfinite(got.item()) and not math.isfinite(want.item())
        else:
            assert got.item() == want.item()
        opt.step()
        ref.step()
        _same(model, ref.model, f"step {i}: weights")


def test_fp16_scale_updates_once_per_step_and_only_for_its_optimizer() -> None:
    model = _model()
    spanned = torchspan.span(model, devices=["cpu", "cpu"], precision="fp16")
    opt = torch.optim.SGD(spanned.parameters(), lr=0.0)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    x, y = _batches(1, big=(0,))[0]
    spanned.train_step(x, y, nn.functional.mse_loss)
    other.step()  # an optimizer of other parameters: the scale waits
    assert spanned.scaler.get_scale() == 65536.0
    opt.step()
    opt.step()  # a second step of the same window does not back off twice
    assert spanned.scaler.get_scale() == 32768.0


def test_fp16_parameters_are_refused_before_any_backward() -> None:
    spanned = torchspan.span(_model().half(), devices=["cpu", "cpu"], precision="fp16")
    with pytest.raises(ValueError, match=r"float32 master weights.*model\.float\(\)"):
        spanned.train_step(
            torch.randn(4, 6, dtype=torch.float16),
            torch.randn(4, 3, dtype=torch.float16),
            nn.functional.mse_loss,
        )


# ---------------------------------------------------------------------- non-finite losses
def test_a_nan_loss_raises_naming_the_call_and_micro_batch() -> None:
    model = _model().double()
    spanned = torchspan.span(model, devices=["cpu", "cpu"], microbatches=3)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    spanned.train_step(x, y, nn.functional.mse_loss)
    x[6, 2] = math.nan  # rows 6-7 are micro-batch 2 of 3 (3 + 3 + 2)
    with pytest.raises(
        FloatingPointError, match=r"train_step call 2: the loss is nan in micro-batch 2 \(rows 6-7\) of 3"
    ):
        spanned.train_step(x, y, nn.functional.mse_loss)
    y[0, 0] = math.inf
    with pytest.raises(
        FloatingPointError,
        match=r"train_step call 3: the loss is .*micro-batches 0 \(rows 0-2\), 2 \(rows 6-7\)",
    ):
        spanned.train_step(x, y, nn.functional.mse_loss)


def test_nonfinite_warn_returns_the_loss_and_bad_values_are_refused() -> None:
    spanned = torchspan.span(_model(), devices=["cpu", "cpu"], nonfinite="warn")
    assert spanned.nonfinite == "warn"
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    x[0, 0] = math.nan
    with pytest.warns(
        RuntimeWarning, match=r"train_step call 1: the loss is nan in micro-batch 0 \(rows 0-3\) of 1"
    ):
        loss = spanned.train_step(x, y, nn.functional.mse_loss)
    assert math.isnan(loss.item())
    spanned.nonfinite = "raise"
    with pytest.raises(FloatingPointError):
        spanned.train_step(x, y, nn.functional.mse_loss)
    with pytest.raises(ValueError, match=r"nonfinite='ignore' is not one of 'raise', 'warn'"):
        spanned.nonfinite = "ignore"
    with pytest.raises(ValueError, match=r"nonfinite='off' is not one of 'raise', 'warn'"):
        torchspan.span(_model(), devices=["cpu", "cpu"], nonfinite="off")


def test_an_fp16_overflow_the_scaler_skips_is_not_an_error() -> None:
    spanned = torchspan.span(_model(), devices=["cpu", "cpu"], precision="fp16")
    opt = torch.optim.SGD(spanned.parameters(), lr=0.1)
    x, y = _batches(1, big=(0,))[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spanned.train_step(x, y, nn.functional.mse_loss)  # finite loss, overflowed gradients: skipped
        spanned.train_step(
            x * math.inf, y, nn.functional.mse_loss
        )  # an inf loss too: the scaler skips the window
    opt.step()
    assert spanned.scaler.get_scale() == 32768.0


# ---------------------------------------------------------------------- 2 gloo ranks
def _ranks_worker(rank: int, world: int, port: int) -> None:
    from test_ranks_pipeline import _join, _leave, _seq

    _join(rank, world, port)
    g = torch.Generator().manual_seed(5)
    x, y = (
        torch.randn(6, 5, generator=g, dtype=torch.float64),
        torch.randn(6, 4, generator=g, dtype=torch.float64),
    )
    x[4, 1] = math.nan  # the same batch on both ranks (a NaN at row 4)
    spanned = torchspan.span(_seq(), balance=[2, 2], microbatches=2)
    with pytest.raises(
        FloatingPointError, match=r"train_step call 1: the loss is nan\. "
    ):  # every rank, together
        spanned.train_step(x, y, nn.MSELoss())
    spanned = torchspan.span(
        _seq()
    )  # data parallel: rank 1's shard holds the NaN; the global loss is NaN on both
    rows = slice(0, 3) if rank == 0 else slice(3, 6)
    where = r" in micro-batch 0 \(rows 0-2\) of 1 of rank 1's shard, counted from 0" if rank == 1 else ""
    with pytest.raises(FloatingPointError, match=rf"train_step call 1: the loss is nan{where}\. "):
        spanned.train_step(x[rows], y[rows], nn.MSELoss())
    with pytest.raises(
        ValueError, match=r"precision='fp16' across ranks is not supported"
    ):  # ranks would skip alone
        torchspan.span(_seq().float(), balance=[2, 2], precision="fp16")
    _leave()


@pytest.mark.slow
def test_nonfinite_losses_raise_on_every_rank() -> None:
    from test_ranks_pipeline import _spawn

    from torchspan.runtime.ranks import free_port

    _spawn(_ranks_worker, 2, free_port(), deadline=120.0)

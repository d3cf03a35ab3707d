"""A small measured training loop over a ``Spanned`` model, shared by ``torchspan demo`` and ``torchspan
run``.

Each step: ``zero_grad``, ``train_step`` (timed between device synchronisations), the optimizer
step (timed apart: the plan does not model it), a finite-loss check, and the progress bar with
loss, speed and, every ``memory_every`` steps, memory per stage.

Usage::

    trained = train(spanned, optimizer, lambda step: (x, y), loss_fn, steps=20, console=con,
                    items_per_step=len(x))
    trained.losses[-1], trained.step_times, trained.items_per_second
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from torch.utils._pytree import tree_leaves

from .profiler.timing import synchronize
from .progress import TrainingProgress
from .runtime.nonfinite import NonFiniteLoss
from .runtime.spanned import Spanned

__all__ = ["Trained", "LossNotFinite", "OutOfMemoryAtStep", "train", "mse_loss"]


class LossNotFinite(FloatingPointError):
    """The loss became ``inf`` or ``nan``; ``step`` counts from 0."""

    def __init__(self, step: int, value: float, lr: Any) -> None:
        super().__init__(f"loss became {value} at step {step}; lower the learning rate (lr={lr})")
        self.step, self.value = step, value


class OutOfMemoryAtStep(RuntimeError):
    """A device ran out of memory during ``train_step`` number ``step`` (from 0); the cause is PyTorch's
    error."""

    def __init__(self, step: int, error: BaseException) -> None:
        text = str(error).strip()
        super().__init__(
            f"out of device memory at step {step}: {text.splitlines()[0] if text else type(error).__name__}"
        )
        self.step = step


@dataclass
class Trained:
    """What :func:`train` measured: one loss and two times (seconds) per step, and the whole run."""

    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(
        default_factory=list
    )  # train_step: forward + backward of every micro-batch
    optimizer_times: list[float] = field(default_factory=list)
    seconds: float = 0.0
    items_per_second: float = 0.0  # samples or tokens, as items_per_step counts them


def _synchronize(devices: Sequence[torch.device]) -> None:
    for d in devices:
        synchronize(d)


def train(
    spanned: Spanned,
    optimizer: torch.optim.Optimizer,
    batch: Callable[[int], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    steps: int,
    *,
    console: Console,
    items_per_step: int,
    speed_unit: str = "samples/s",
    memory_every: int = 5,
) -> Trained:
    """Train ``steps`` steps; ``batch(step)`` gives ``(inputs, target)`` for ``spanned.train_step``.

    Raises :class:`LossNotFinite` when a loss is not finite (before that step's optimizer step, as
    ``train_step`` refuses it; after it where ``spanned.nonfinite == "warn"``) and
    :class:`OutOfMemoryAtStep` when a device runs out of memory.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an int >= 1")
    if memory_every < 1:
        raise ValueError(f"memory_every={memory_every!r} must be >= 1 (show memory every N steps)")
    devices = [torch.device(d) for d in dict.fromkeys(spanned.devices)]
    out = Trained()
    t_start = time.perf_counter()
    with TrainingProgress(console, steps, speed_unit=speed_unit) as bar:
        for step in range(steps):
            inputs, target = batch(step)
            optimizer.zero_grad(set_to_none=True)
            _synchronize(devices)
            t0 = time.perf_counter()
            try:
                loss = spanned.train_step(inputs, target, loss_fn)
            except torch.OutOfMemoryError as exc:  # pragma: no cover - needs a GPU
                raise OutOfMemoryAtStep(step, exc) from exc
            except NonFiniteLoss as exc:  # refused by train_step before any optimizer step
                raise LossNotFinite(step, exc.loss, optimizer.param_groups[0]["lr"]) from exc
            value = float(loss)
            _synchronize(devices)
            t1 = time.perf_counter()
            spanned.step(optimizer)  # through the fp16 gradient scaler when precision="fp16"
            _synchronize(devices)
            out.optimizer_times.append(time.perf_counter() - t1)
            out.step_times.append(t1 - t0)
            if not math.isfinite(value):
                raise LossNotFinite(step, value, optimizer.param_groups[0]["lr"])
            out.losses.append(value)
            elapsed = time.perf_counter() - t_start
            show_memory = step == 0 or step % memory_every == memory_every - 1 or step == steps - 1
            bar.step(
                loss=value,
                speed=items_per_step * (step + 1) / elapsed,
                memory=spanned.memory(optimizer) if show_memory else None,
            )
    out.seconds = time.perf_counter() - t_start
    out.items_per_second = items_per_step * steps / out.seconds
    return out


def mse_loss(out: Any, target: Any) -> torch.Tensor:
    """MSE between every floating-point tensor of an output and the same place in ``target``, summed.

    The loss ``torchspan run`` and ``torchspan verify`` train synthetic models with (outputs may be
    tuples or dicts of tensors). Raises ``ValueError`` when the output holds no floating tensor.
    """
    pairs = [
        (o, t)
        for o, t in zip(tree_leaves(out), tree_leaves(target))
        if isinstance(o, torch.Tensor) and o.is_floating_point()
    ]
    if not pairs:
        raise ValueError("the model's output has no floating-point tensor to put an MSE loss on")
    return sum(
        (torch.nn.functional.mse_loss(o.float(), t.float()) for o, t in pairs),
        torch.zeros((), device=pairs[0][0].device),
    )

"""What the demo shows besides training: where it spans the model and why, the exact-gradient check, and plain
PyTorch on one device beside the span.

On a machine without a GPU, ``torchspan.plan`` rightly keeps the demo's small model on the CPU, one stage:
nothing to span. ``torchspan demo`` then splits it into two pipeline stages on the CPU (``cpu, cpu``: the same
cores, taking turns), so that every machine shows a span: a timeline with two lanes, a memory picture with two
stages, and one step's gradients compared with the same model on one device.

Usage::

    setup = choose_devices("auto", memory=None)         # setup.found, setup.used, setup.reason
    check = gradient_check(spanned, reference, x, y, lm_loss)
    one = one_device_run(reference, lambda step: (x, y), lm_loss, steps=20, lr=3e-3)
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..hardware import Device
from ..hardware import devices as find_devices
from ..parity import check_parity
from ..profiler.timing import synchronize
from ..runtime.spanned import Spanned

__all__ = [
    "DemoDevices",
    "GradientCheck",
    "OneDevice",
    "choose_devices",
    "gradient_check",
    "one_device_run",
    "reference_copy",
]


@dataclass
class DemoDevices:
    """The devices the spec found (``found``), the ones the demo plans over (``used``) and why, in one
    line."""

    found: list[Device]
    used: list[Device]
    reason: str
    auto: bool

    @property
    def spread(self) -> bool:
        """Whether the demo spreads the model over every used device when the planner alone keeps fewer
        stages."""
        return len(self.used) > 1

    @property
    def has_accelerator(self) -> bool:
        return any(d.kind != "cpu" for d in self.found)


def choose_devices(spec: str | list[str], memory: Mapping[str, str | int] | None) -> DemoDevices:
    """The demo's devices: as listed, or for ``"auto"`` a span this machine can show.

    ``"auto"`` without a GPU plans over ``cpu, cpu`` (two stages on the same cores); with one GPU over the GPU
    and the CPU; with several over the GPUs. A ``ValueError`` for devices the machine lacks or budgets naming
    none of them.
    """
    found = find_devices(spec, memory=memory)
    auto = isinstance(spec, str) and spec.strip().lower() == "auto"
    if not auto:
        listed = ", ".join(str(d.device) for d in found)
        return DemoDevices(found, found, f"the devices listed: {listed}", auto=False)
    gpus = [d for d in found if d.kind != "cpu"]
    if not gpus:
        used = find_devices("cpu,cpu", memory=memory)
        why = "cpu, cpu: two pipeline stages on the CPU, since there is no GPU"
    elif len(gpus) == 1:
        used, why = found, f"{gpus[0].device} and the CPU"
    else:
        used, why = gpus, "the GPUs: " + ", ".join(str(d.device) for d in gpus)
    return DemoDevices(found, used, why, auto=True)


@dataclass(frozen=True)
class GradientCheck:
    """One step of the spanned model against the same model on one device (``device``), the same batch and
    loss."""

    device: str
    parameters: int
    max_abs: float
    max_rel: float
    loss: float
    reference_loss: float
    atol: float
    rtol: float
    ok: bool
    worst: str  # the parameter with the largest absolute difference

    def line(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        return (
            f"exact gradients: {verdict}: one step of the span against the same model on {self.device} "
            f"alone, the same batch: max abs diff {self.max_abs:.3e}, max rel diff {self.max_rel:.3e} over "
            f"{self.parameters} parameters (worst: {self.worst}); loss {self.loss:.6f} vs "
            f"{self.reference_loss:.6f} (atol={self.atol:g}, rtol={self.rtol:g})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def reference_copy(model: nn.Module, device: str) -> nn.Module:
    """A plain copy of ``model`` on ``device``, made before ``span`` moves the model: the one-device
    reference."""
    return copy.deepcopy(model).to(device)


def gradient_check(
    spanned: Spanned,
    reference: nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> GradientCheck:
    """``check_parity`` on one batch, summed up; both models' gradients are cleared afterwards (no weight
    changes)."""
    spanned.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    parity = check_parity(spanned, reference, inputs, target, loss_fn, atol=atol, rtol=rtol)
    worst = max(parity.grads, key=lambda g: g.max_abs)
    check = GradientCheck(
        device=str(next(reference.parameters()).device),
        parameters=len(parity.grads),
        max_abs=max(g.max_abs for g in parity.grads),
        max_rel=max(g.max_rel for g in parity.grads),
        loss=parity.loss,
        reference_loss=parity.reference_loss,
        atol=atol,
        rtol=rtol,
        ok=parity.ok,
        worst=worst.name,
    )
    spanned.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    return check


@dataclass
class OneDevice:
    """Plain PyTorch on one device: the losses of the first steps and the seconds of each (step and
    optimizer); ``ms_per_step`` is their median (the first steps' warm-up and a busy machine's spikes left
    out)."""

    device: str
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)

    @property
    def ms_per_step(self) -> float:
        return 1e3 * statistics.median(self.step_seconds) if self.step_seconds else 0.0

    def largest_difference(self, losses: list[float]) -> float:
        """The largest ``|loss - the span's loss|`` over the steps both ran."""
        return max((abs(a - b) for a, b in zip(self.losses, losses)), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "steps": len(self.losses),
            "losses": self.losses,
            "ms_per_step": self.ms_per_step,
        }


def one_device_run(
    model: nn.Module,
    batch: Callable[[int], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    steps: int,
    lr: float,
) -> OneDevice:
    """``steps`` steps of ``loss_fn(model(x), y).backward(); AdamW.step()``: what the span must equal,
    timed."""
    dev = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    run = OneDevice(str(dev))
    for step in range(steps):
        x, y = batch(step)
        x, y = x.to(dev), y.to(dev)
        synchronize(dev)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        value = float(loss.detach())
        synchronize(dev)
        run.step_seconds.append(time.perf_counter() - t0)
        run.losses.append(value)
    return run

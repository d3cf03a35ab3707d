"""Hook placement: for models ``torch.fx`` cannot trace (data-dependent control flow and such).

Each layer (``torchspan.layers``) lives on its stage's device and a forward pre-hook moves its inputs there
(the copies stay in autograd, so every parameter trains, CPU-placed ones included). The model's
own forward runs unchanged, so micro-batches run one after another: this mode does not pipeline.

While a step runs, the same hooks time each layer's forward (merged into one block per stage
visit) and mark when gradients reach each child's outputs, which bounds the backward blocks; the
saved activations are attributed to the stage whose child is running.

Usage (``span`` does this)::

    hp = HookPlacement(model, {"a": 0, "b": 1}, [cpu, cpu], recorder, meter, "32",
                       {"a": model.a, "b": model.b})
    hp.install(); out = model(x)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ...hardware import to_device
from ..layercall import LayerCalls
from ..memory import ActivationMeter
from ..record import Recorder
from ..ties import Hook, TiedCopies

__all__ = ["HookPlacement"]


class HookPlacement:
    """Input-moving hooks on a model's layers (name -> module, qualified names), plus per-step recording.

    ``copies``: the placement's ``TiedCopies``, so that a recompute reads tied parameters
    on its own device too.
    """

    def __init__(
        self,
        model: nn.Module,
        stage_of: dict[str, int],
        devices: Sequence[torch.device],
        recorder: Recorder,
        meter: ActivationMeter,
        precision: str,
        layers: Mapping[str, nn.Module],
        copies: TiedCopies | None = None,
    ) -> None:
        self.model = model
        self.layers = dict(layers)
        self.copies = copies
        self.calls = LayerCalls(self.layers, stage_of, devices, precision, copies)
        self.stage_of = dict(stage_of)
        self.devices = list(devices)
        self.recorder = recorder
        self.meter = meter
        self.precision = precision
        self._handles: list[Any] = []
        self._local = threading.local()
        self._recording = False
        self._mb = 0
        self._open: list[Any] = []  # [stage, start, last_end] of the forward block being built
        self._marks: list[tuple[float, int]] = []  # (time, stage) when gradients reached a child's output
        self.order: list[str] = []  # execution order seen in the first recorded forward

    # ------------------------------------------------------------------ hooks
    def install(self) -> None:
        """Register the hooks (idempotent)."""
        if self._handles:
            return
        for name, child in self.layers.items():
            if name not in self.stage_of:
                continue
            self._handles.append(child.register_forward_pre_hook(Hook(self._pre(name)), with_kwargs=True))
            self._handles.append(child.register_forward_hook(Hook(self._post(name))))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def current_stage(self) -> int:
        return getattr(self._local, "stage", 0)

    def _pre(self, name: str) -> Any:
        stage = self.stage_of[name]
        dev = self.devices[stage]

        def hook(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
            self._local.stage = stage
            if self._recording:
                if name not in self.order:
                    self.order.append(name)
                now = self.recorder.now()
                if not self._open or self._open[0] != stage:
                    self._close_forward()
                    self._open = [stage, now, now]
            return to_device(args, dev, non_blocking=dev.type == "cuda"), to_device(
                kwargs, dev, non_blocking=dev.type == "cuda"
            )

        return hook

    def _post(self, name: str) -> Any:
        stage = self.stage_of[name]

        def hook(_mod: nn.Module, _args: Any, output: Any) -> None:
            if not self._recording:
                return
            if self._open:
                self._open[2] = self.recorder.now()
            if torch.is_grad_enabled():
                for t in tree_leaves(output):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._mark(stage))

        return hook

    def _mark(self, stage: int) -> Any:
        def on_grad(_g: torch.Tensor) -> None:
            self._marks.append((self.recorder.now(), stage))

        return on_grad

    def _close_forward(self) -> None:
        if self._open:
            stage, start, end = self._open
            self.recorder.add(stage, self.devices[stage], self._mb, "forward", start, max(end, start))
            self._open = []

    # ------------------------------------------------------------------ one micro-batch
    @contextlib.contextmanager
    def recording(self, mb: int, recompute: bool) -> Iterator[None]:
        """Record the forward of micro-batch ``mb`` (wrap the model call in this); each layer runs by the
        call policy (``layercall``: autocast on its device, recomputed in backward when ``recompute``)."""
        self._recording, self._mb, self._open = True, mb, []
        try:
            with (
                self.calls.installed(lambda: recompute, may_recompute=recompute),
                self.meter.saving(self.current_stage),
            ):
                yield
        finally:
            self._close_forward()
            self._recording = False

    def backward(self, mb: int, loss: torch.Tensor) -> None:
        """``loss.backward()`` for micro-batch ``mb``, recording one backward block per stage visit."""
        self._marks = []
        start = self.recorder.now()
        if loss.requires_grad:
            loss.backward()
        end = self.recorder.now()
        marks = sorted(self._marks)
        if not marks:
            return
        blocks: list[list[Any]] = [[marks[0][1], start]]
        for t, stage in marks[1:]:
            if stage != blocks[-1][0]:
                blocks.append([stage, t])
        for i, (stage, t0) in enumerate(blocks):
            t1 = blocks[i + 1][1] if i + 1 < len(blocks) else end
            self.recorder.add(stage, self.devices[stage], mb, "backward", t0, t1)

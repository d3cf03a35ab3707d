"""Bytes per stage of a placed model: parameters, gradients, buffers, optimizer state, activations.

What ``Spanned.memory`` reports. Each tensor is counted once, on the stage of the layer that holds
it (the model's own tensors on the stage ``root_attrs`` gives them, else stage 0); saved
activations come from the ``ActivationMeter``'s peaks of the last step.

Usage: ``stage_memory(model, devices, groups, root_attrs, meter.peak, optimizer)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..layers import top_level_modules

__all__ = ["stage_memory"]


def _nbytes(t: torch.Tensor) -> int:
    """Bytes ``t`` holds in this process: a ``DTensor`` (a sharded replica's parameter) counts its local
    shard."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def stage_memory(
    model: nn.Module,
    devices: Sequence[torch.device],
    groups: Sequence[Sequence[str]],
    root_attrs: Mapping[str, int],
    activation_peaks: Sequence[int],
    optimizer: torch.optim.Optimizer | None = None,
    layers: Mapping[str, nn.Module] | None = None,
) -> list[dict[str, Any]]:
    """One dict per stage: ``stage``, ``device``, ``layers`` and bytes of ``params``, ``grads``,
    ``buffers``, ``optimizer`` (0 without an optimizer), ``activations`` (``activation_peaks[s]``),
    ``device_peak`` (``torch.cuda.max_memory_allocated`` on CUDA stages, else ``None``).
    ``layers``: name -> module (default: top-level children); ``root_attrs``' keys are qualified
    names of tensors held outside every layer. A tied parameter counts once, on its first layer's stage."""
    stage_of = {name: s for s, g in enumerate(groups) for name in g}
    owned: list[list[torch.Tensor]] = [[] for _ in devices]
    bufs: list[list[torch.Tensor]] = [[] for _ in devices]
    seen: set[int] = set()
    for name, layer in (layers if layers is not None else top_level_modules(model)).items():
        s = stage_of.get(name, 0)
        for p in layer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                owned[s].append(p)
        bufs[s].extend(layer.buffers())
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            owned[root_attrs.get(name, 0)].append(p)
    held = {id(b) for s in bufs for b in s}
    for name, b in model.named_buffers():
        if id(b) not in held:
            bufs[root_attrs.get(name, 0)].append(b)
    state = optimizer.state if optimizer is not None else {}
    per_stage: list[dict[str, Any]] = []
    for s, dev in enumerate(devices):
        opt_bytes = sum(
            _nbytes(v) for p in owned[s] for v in state.get(p, {}).values() if isinstance(v, torch.Tensor)
        )
        per_stage.append(
            {
                "stage": s,
                "device": str(dev),
                "layers": list(groups[s]),
                "params": sum(_nbytes(p) for p in owned[s]),
                "grads": sum(_nbytes(p.grad) for p in owned[s] if p.grad is not None),
                "buffers": sum(_nbytes(b) for b in bufs[s]),
                "optimizer": opt_bytes,
                "activations": activation_peaks[s],
                "device_peak": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
            }
        )
    return per_stage

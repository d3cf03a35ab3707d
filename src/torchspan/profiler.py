"""Per-layer costs of a model on a set of devices (``torchspan.profile``).

Usage::

    prof = torchspan.profile(model, torch.randn(32, 512), devices="cuda:0,cpu", optimizer="adam")
    prof.layers[0].param_bytes, prof.layers[0].forward_seconds(device=0, samples=8)

Bytes are per layer (parameters, gradients, optimizer state, buffers) or per sample (saved
activations, boundary output). Times follow ``fixed + samples * per_sample`` per device, measured on
devices that are present and estimated from FLOPs for described ones (``time_source`` says which).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .hardware import Device

__all__ = ["LayerCost", "Profile"]


@dataclass
class LayerCost:
    """Costs of one layer (a top-level child, named as in ``torchspan.split.execution_order``).

    Lists indexed by device follow ``Profile.devices``.
    """

    name: str
    kind: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    activation_bytes: float  # saved for backward, per sample
    output_bytes: float  # what crosses to the next layer, per sample
    flops: float  # forward FLOPs per sample
    forward_fixed: list[float] = field(default_factory=list)  # seconds per call, per device
    forward_per_sample: list[float] = field(default_factory=list)  # seconds per sample, per device
    backward_fixed: list[float] = field(default_factory=list)
    backward_per_sample: list[float] = field(default_factory=list)
    time_source: list[str] = field(default_factory=list)  # "measured" | "estimated: …" per device

    def forward_seconds(self, device: int, samples: float) -> float:
        return self.forward_fixed[device] + samples * self.forward_per_sample[device]

    def backward_seconds(self, device: int, samples: float) -> float:
        return self.backward_fixed[device] + samples * self.backward_per_sample[device]

    @property
    def state_bytes(self) -> int:
        """Memory that stays for the whole run: parameters, gradients, optimizer state, buffers."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buffer_bytes


@dataclass
class Profile:
    """Per-layer costs of a model for an example batch, on ``devices``."""

    layers: list[LayerCost]
    devices: list[Device]
    batch_size: int
    input_bytes: float  # model input, per sample
    optimizer: str
    dtype: str = "float32"

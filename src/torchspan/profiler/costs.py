"""What a profile holds, as pure data: per-layer costs (``LayerCost``) of a model on devices (``Profile``).

The planner reads these and nothing of the measuring code (``measure.profile`` fills them).
``MEMORY_KINDS`` names the kinds of memory a stage holds, as ``spanned.memory()`` measures them
and a plan predicts them (``StagePlan.<kind>`` bytes): one vocabulary for profile, plan, run and
pictures.

Usage::

    lay = LayerCost("fc", "Linear", param_bytes=40, grad_bytes=40, optimizer_bytes=80, buffer_bytes=0,
                    activation_bytes=16.0, output_bytes=8.0, flops=20.0)
    prof = Profile([lay], devices=[Device(torch.device("cpu"), "cpu")], batch_size=8, input_bytes=16.0,
                   optimizer="adam")
    prof.step_seconds(0), prof.layer("fc").state_bytes
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..hardware import Device, format_bytes

__all__ = ["LayerCost", "Profile", "MEMORY_KINDS"]

# kinds of memory a stage holds, in the order tables and pictures show them
MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "buffers")


@dataclass
class LayerCost:
    """Costs of one layer (a top-level child, named as in ``torchspan.layers.execution_order``).

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
    # Added by the profiler; defaults keep hand-built LayerCost objects valid.
    activation_fixed_bytes: float = 0.0  # saved for backward per call, independent of batch size
    output_fixed_bytes: float = 0.0  # boundary bytes per call, independent of batch size
    backward_flops: float = 0.0  # backward FLOPs per sample
    calls: int = 1  # times the layer runs in one forward
    # per sample: bytes this layer saves that an earlier layer saved too (usually its input, which the
    # previous layer kept for its own backward). Counted once above; a stage that STARTS at this layer
    # on another device holds its own copy of them, so add this for a stage's first layer.
    shared_activation_bytes: float = 0.0

    def forward_seconds(self, device: int, samples: float) -> float:
        return self.forward_fixed[device] + samples * self.forward_per_sample[device]

    def backward_seconds(self, device: int, samples: float) -> float:
        return self.backward_fixed[device] + samples * self.backward_per_sample[device]

    @property
    def state_bytes(self) -> int:
        """Memory that stays for the whole run: parameters, gradients, optimizer state, buffers."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buffer_bytes

    def saved_bytes(self, samples: float) -> float:
        """Bytes autograd keeps for this layer's backward while ``samples`` samples are in flight."""
        return self.activation_fixed_bytes + samples * self.activation_bytes


@dataclass
class Profile:
    """Per-layer costs of a model for an example batch, on ``devices``."""

    layers: list[LayerCost]
    devices: list[Device]
    batch_size: int
    input_bytes: float  # model input, per sample
    optimizer: str
    dtype: str = "float32"
    notes: list[str] = field(default_factory=list)
    # measured / estimated step time on present CPUs: how far the FLOP-based estimate is off here
    calibration: dict[str, float] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [lay.name for lay in self.layers]

    def layer(self, name: str) -> LayerCost:
        """The ``LayerCost`` called ``name``; ``KeyError`` listing the names otherwise."""
        for lay in self.layers:
            if lay.name == name:
                return lay
        raise KeyError(f"no layer {name!r} in this profile; layers are {', '.join(self.names)}")

    def step_seconds(self, device: int, samples: float | None = None) -> float:
        """Forward plus backward of every layer on ``devices[device]`` for ``samples`` (default: the
        batch)."""
        s = self.batch_size if samples is None else samples
        return sum(lay.forward_seconds(device, s) + lay.backward_seconds(device, s) for lay in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": [d.to_dict() for d in self.devices],
            "batch_size": self.batch_size,
            "input_bytes": self.input_bytes,
            "optimizer": self.optimizer,
            "dtype": self.dtype,
            "notes": list(self.notes),
            "calibration": dict(self.calibration),
            "layers": [dataclasses.asdict(lay) for lay in self.layers],
        }

    def __str__(self) -> str:
        b = self.batch_size
        head = (
            f"Profile: {len(self.layers)} layer(s), batch {b}, optimizer {self.optimizer}, dtype {self.dtype}"
        )
        devs = [
            f"[{i}] {d.device} {d.name} ({src})"
            for i, d in enumerate(self.devices)
            for src in [_short_source(self, i)]
        ]
        cols = [
            "layer",
            "kind",
            "params",
            "grads",
            "optim",
            "buffers",
            "act/sample",
            "out/sample",
            "MFLOP/sample",
        ]
        cols += [f"fwd+bwd ms [{i}]" for i in range(len(self.devices))]
        rows = [cols]
        for lay in self.layers:
            row = [
                lay.name,
                lay.kind,
                format_bytes(lay.param_bytes),
                format_bytes(lay.grad_bytes),
                format_bytes(lay.optimizer_bytes),
                format_bytes(lay.buffer_bytes),
                format_bytes(lay.activation_bytes),
                format_bytes(lay.output_bytes),
                f"{lay.flops / 1e6:.2f}",
            ]
            for i in range(len(self.devices)):
                t = (
                    lay.forward_seconds(i, b) + lay.backward_seconds(i, b)
                    if i < len(lay.forward_fixed)
                    else float("nan")
                )
                row.append(f"{t * 1e3:.3f}")
            rows.append(row)
        widths = [max(len(r[c]) for r in rows) for c in range(len(cols))]
        lines = [head, *devs]
        for j, r in enumerate(rows):
            lines.append(
                "  ".join(c.ljust(w) if k < 2 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths)))
            )
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _short_source(prof: Profile, i: int) -> str:
    if not prof.layers or i >= len(prof.layers[0].time_source):
        return "-"
    src = prof.layers[0].time_source[i]
    return "measured" if src == "measured" else "estimated"

"""A placement as data: ``Stage`` (layers ``[start, end)`` on one listed device), the bytes a stage
holds (``StageMemory``) and the cost model's verdict on a whole placement (``Evaluation``).

Usage::

    stages = [Stage(device=0, start=0, end=3), Stage(device=1, start=3, end=7)]
    ev = CostModel(profile, 8, "1f1b", "never").evaluate(stages)
    ev.fits, ev.over_budget(), ev.memory[0].total
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Stage", "StageMemory", "Evaluation"]


@dataclass(frozen=True)
class Stage:
    """Layers ``[start, end)`` on ``profile.devices[device]`` (an index into the device list)."""

    device: int
    start: int
    end: int


@dataclass(frozen=True)
class StageMemory:
    """Predicted bytes of one stage on its device."""

    params: int
    grads: int
    optimizer: int
    buffers: int
    activations: int
    workspace: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers + self.activations + self.workspace


@dataclass(frozen=True)
class Evaluation:
    """The cost model's verdict on one placement (see the module docstring for the formula)."""

    stages: tuple[Stage, ...]
    forward: tuple[float, ...]  # F_s, seconds per micro-batch
    backward: tuple[float, ...]  # Bw_s, seconds per micro-batch (without recompute)
    links: tuple[float, ...]  # c_in, then c_j for each boundary between stages
    memory: tuple[StageMemory, ...]
    latency_sum: float  # sum of lat_s and link times: the bubble part
    bottleneck: float  # slowest resource per micro-batch
    step_time: float
    # per physical device, in order of first use (names from ``physical_names``)
    devices: tuple[str, ...] = ()
    device_busy: tuple[float, ...] = ()  # R_p: seconds per micro-batch, summed over its stages
    device_memory: tuple[int, ...] = ()  # bytes, summed over its stages
    device_capacity: tuple[float, ...] = ()
    # per stage: seconds per micro-batch of tied-parameter copies (``planner.ties``), in its busy time and
    # latency
    ties: tuple[float, ...] = ()

    @property
    def fits(self) -> bool:
        """Every physical device holds the sum of its stages' bytes."""
        return all(m <= c for m, c in zip(self.device_memory, self.device_capacity))

    def over_budget(self) -> list[tuple[str, int, float]]:
        """``(device, bytes needed, capacity)`` for each physical device whose stages do not fit."""
        return [(d, m, c) for d, m, c in zip(self.devices, self.device_memory, self.device_capacity) if m > c]

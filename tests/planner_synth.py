"""Synthetic profiles and a brute-force reference for the planner tests (no model, no devices)."""

from __future__ import annotations

import itertools
import math
import random

import torch

from torchspan.hardware import Device
from torchspan.planner.cost import CostModel
from torchspan.planner.stages import Evaluation, Stage
from torchspan.profiler.costs import LayerCost, Profile


def device(
    kind: str,
    name: str,
    capacity: int | None,
    bandwidth: float | None = None,
    index: int = 0,
    *,
    present: bool = False,
    memory_bandwidth: float | None = None,
) -> Device:
    """A described device with a budget and a host link.

    ``present``: one found here, so that listing it twice is one device. ``memory_bandwidth``
    (bytes/s) prices gradient accumulation.
    """
    dev = torch.device("cpu") if kind == "cpu" else torch.device(kind, index)
    source = "found" if present else "test"
    extra = {"memory_bandwidth": memory_bandwidth} if memory_bandwidth else {}
    return Device(
        dev,
        name,
        total_memory=capacity,
        free_memory=capacity,
        host_bandwidth=bandwidth,
        source=source,
        extra=extra,
    )


def layer(
    name: str, params: int, act: float, out: float, speeds: list[float], fixed: float = 1e-5
) -> LayerCost:
    """A layer whose per-sample time on device d is ``1e-4 / speeds[d]`` (backward twice that)."""
    return LayerCost(
        name=name,
        kind="Linear",
        param_bytes=params,
        grad_bytes=params,
        optimizer_bytes=2 * params,
        buffer_bytes=0,
        activation_bytes=act,
        output_bytes=out,
        flops=1e6,
        forward_fixed=[fixed] * len(speeds),
        forward_per_sample=[1e-4 / s for s in speeds],
        backward_fixed=[fixed] * len(speeds),
        backward_per_sample=[2e-4 / s for s in speeds],
        time_source=["estimated: test"] * len(speeds),
    )


def random_profile(rng: random.Random, n_layers: int, devices: list[Device], batch: int = 8) -> Profile:
    speeds = [rng.choice([0.2, 1.0, 1.0, 3.0]) if d.kind != "cpu" else 0.1 for d in devices]
    layers = []
    for k in range(n_layers):
        jitter = [s * rng.uniform(0.5, 2.0) for s in speeds]
        lay = layer(
            f"l{k}",
            params=rng.randint(0, 4000),
            act=rng.uniform(0, 400),
            out=rng.uniform(1, 200),
            speeds=jitter,
            fixed=rng.uniform(0, 1e-4),
        )
        lay.shared_activation_bytes = rng.uniform(0, 100)
        lay.activation_fixed_bytes = rng.uniform(0, 50)
        layers.append(lay)
    return Profile(
        layers=layers, devices=devices, batch_size=batch, input_bytes=rng.uniform(1, 100), optimizer="adam"
    )


def adjacent(names: list[str]) -> bool:
    """True when equal names form one run (``a a b``, not ``a b a``)."""
    runs = [n for k, n in enumerate(names) if k == 0 or names[k - 1] != n]
    return len(runs) == len(set(runs))


def brute_force(cm: CostModel) -> Evaluation | None:
    """Best fitting placement by enumerating every device sequence and every split (tiny cases only).

    Every sequence of distinct list entries, duplicates of one physical device included, as long as
    each physical device's stages are adjacent (the search space: one run of layers per device).
    """
    L, D = cm.L, cm.D
    best: Evaluation | None = None
    for S in range(1, min(L, D) + 1):
        for devs in itertools.permutations(range(D), S):
            if not adjacent([cm.names[d] for d in devs]):
                continue
            for cuts in itertools.combinations(range(1, L), S - 1):
                bounds = (0, *cuts, L)
                stages = [Stage(devs[s], bounds[s], bounds[s + 1]) for s in range(S)]
                ev = cm.evaluate(stages)
                if ev.fits and (best is None or ev.step_time < best.step_time):
                    best = ev
    return best


def close(a: float, b: float, rtol: float = 1e-7) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=1e-15)

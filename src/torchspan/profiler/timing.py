"""Layer times: measured on present devices, estimated from FLOPs and bytes for described ones.

Measured: each layer runs alone on the inputs it received in a real forward (captured by hooks on
the layers), forward then backward with all-ones output gradients, ``warmup`` runs then
the median of ``repeats``; the model's buffers, gradients and RNG state are restored afterwards.
Estimated: per aten op ``max(flops / (peak * compute_efficiency), bytes / (bandwidth *
memory_efficiency))`` plus a per-op overhead (summed on CPUs; on asynchronous accelerators the
larger of launch time and device time).

Usage: ``fwd, bwd = time_layer(layer, calls, grad_mask, torch.device("cpu"), None, 2, 5)``.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..hardware import Device, catalog
from ..layers import buffer_slots, kept, module_entries

__all__ = [
    "Speed",
    "capture",
    "estimate",
    "fit",
    "host_speed_device",
    "on_device",
    "preserved",
    "speed_of",
    "synchronize",
    "time_layer",
]


def synchronize(dev: torch.device) -> None:
    """Wait for queued work on ``dev`` (CUDA, MPS); nothing to wait for on the CPU."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":  # pragma: no cover - Apple only
        torch.mps.synchronize()


@contextmanager
def preserved(model: nn.Module) -> Iterator[None]:
    """Restore buffers (e.g. BatchNorm statistics), gradients and RNG state after measuring.

    Python's garbage collector is paused meanwhile (as ``timeit`` does): a collection of the
    sizing pass's objects inside a timed region would add milliseconds to one layer.
    """
    grads = [(p, p.grad) for p in model.parameters()]
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    # by slot: moving a layer in place (``on_device``) swaps new tensors into its modules' _buffers
    with torch.random.fork_rng(devices=cuda), kept(buffer_slots([model])):
        try:
            yield
        finally:
            if was_enabled:
                gc.enable()
            for p, g in grads:
                p.grad = g


def capture(
    model: nn.Module,
    children: list[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
) -> dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    """Inputs every layer of ``children`` (the model's layers, name and module) receives in one real forward.

    No autograd graph is kept. Usage: ``calls = capture(model, [("head", model.head)], (x,), {})``.
    """
    calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {n: [] for n, _ in children}
    handles = []
    for child, next_name in module_entries(
        children
    ):  # one module at two entries: each call is the next entry's

        def pre(_m: nn.Module, a: Any, kw: Any, _next: Any = next_name) -> None:
            detached = tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, (a, kw))
            calls[_next()].append(detached)

        handles.append(child.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*args, **(kwargs or {}))
    except Exception as exc:
        text = str(exc).strip()
        why = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
        raise ValueError(
            f"{type(model).__name__} fails on example_inputs ({why}); pass inputs its forward accepts "
            "(shape, dtype, e.g. integer token ids for an Embedding)"
        ) from exc
    finally:
        for h in handles:
            h.remove()
    return calls


def _module_device(module: nn.Module) -> torch.device | None:
    devs = {t.device for t in list(module.parameters()) + list(module.buffers())}
    return devs.pop() if len(devs) == 1 else None


@contextmanager
def on_device(layer: nn.Module, dev: torch.device, dtype: torch.dtype | None) -> Iterator[nn.Module]:
    """``layer`` on ``dev`` in ``dtype``: moved in place and back, or a copy when it must be cast."""
    tensors = list(layer.parameters()) + list(layer.buffers())
    needs_cast = dtype is not None and any(t.is_floating_point() and t.dtype != dtype for t in tensors)
    home = _module_device(layer)
    if not tensors or (home == dev and not needs_cast):
        yield layer
        return
    if needs_cast or home is None:
        yield (
            copy.deepcopy(layer).to(device=dev, dtype=dtype)
            if dtype is not None
            else copy.deepcopy(layer).to(dev)
        )
        return
    layer.to(dev)
    try:
        yield layer
    finally:
        layer.to(home)


def time_layer(
    module: nn.Module,
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]],
    grad_mask: list[list[bool]],
    dev: torch.device,
    dtype: torch.dtype | None,
    warmup: int,
    repeats: int,
) -> tuple[float, float]:
    """Median forward and backward seconds of ``module`` over its recorded calls."""

    def to_dev(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.to(dev)
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    prepared = []
    for i, (a, kw) in enumerate(calls):
        leaves, spec = tree_flatten(tree_map(to_dev, (a, kw)))
        mask = (
            grad_mask[i] if i < len(grad_mask) and len(grad_mask[i]) == len(leaves) else [False] * len(leaves)
        )
        prepared.append((leaves, spec, mask))
    params = [p for p in module.parameters() if p.requires_grad]
    fwd: list[float] = []
    bwd: list[float] = []
    for it in range(warmup + repeats):
        inputs = []
        for leaves, spec, mask in prepared:
            fresh = [
                x.detach().requires_grad_(True).clone()
                if m and isinstance(x, torch.Tensor) and x.is_floating_point()
                else x
                for x, m in zip(leaves, mask)
            ]
            inputs.append(tree_unflatten(fresh, spec))
        for p in params:
            p.grad = None
        synchronize(dev)
        t0 = time.perf_counter()
        outs = [module(*a, **kw) for a, kw in inputs]
        synchronize(dev)
        t1 = time.perf_counter()
        roots = [t for t in tree_flatten(outs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        seeds = [torch.ones_like(t) for t in roots]
        synchronize(dev)
        t2 = time.perf_counter()
        if roots:
            torch.autograd.backward(roots, seeds)
        synchronize(dev)
        t3 = time.perf_counter()
        if it >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t3 - t2 if roots else 0.0)
        del outs, roots, seeds, inputs
    for p in params:
        p.grad = None
    return statistics.median(fwd), statistics.median(bwd)


def fit(points: dict[int, float]) -> tuple[float, float]:
    """``(fixed, per_sample)`` of the line through the timing points, both kept >= 0."""
    if len(points) == 1:
        ((s, t),) = points.items()
        return 0.0, t / s
    (s1, t1), (s2, t2) = sorted(points.items())[:2]
    per = (t2 - t1) / (s2 - s1)
    fixed = t1 - s1 * per
    if per < 0:  # noise (stalls only ever add time): the larger batch was faster; keep its time as fixed
        return t2, 0.0
    if fixed < 0:
        return 0.0, t2 / s2
    return fixed, per


@dataclass(frozen=True)
class Speed:
    flops: float
    bandwidth: float | None
    overhead: float
    asynchronous: bool
    label: str


def speed_of(device: Device, dtype: torch.dtype) -> Speed:
    peak, precision = catalog.flops_for(device, dtype)
    extra = device.extra if isinstance(device.extra, dict) else {}
    ce = float(extra.get("compute_efficiency", 1.0))
    me = float(extra.get("memory_efficiency", 1.0))
    bw = extra.get("memory_bandwidth")
    overhead = float(extra.get("kernel_overhead", 0.0))
    label = f"estimated: {precision} {peak / 1e12:.3g} TFLOP/s x {ce:g}"
    label += (
        f", {float(bw) / 1e9:.0f} GB/s x {me:g}"
        if bw
        else ", memory traffic not modelled (no bandwidth figure)"
    )
    label += f", {overhead * 1e6:.0f} us/op"
    return Speed(peak * ce, float(bw) * me if bw else None, overhead, device.kind != "cpu", label)


def host_speed_device(device: Device) -> Device:
    """A present CPU (or meta stand-in) with measured host figures filled in."""
    hs = catalog.measure_host()
    extra = dict(device.extra)
    extra.update(
        {
            "memory_bandwidth": hs.memory_bandwidth,
            "kernel_overhead": hs.op_overhead,
            "compute_efficiency": 1.0,
            "memory_efficiency": 1.0,
            "peak_flops_precision": "FP32 matmul, measured",
            "speed_source": hs.method,
        }
    )
    return dataclasses.replace(device, peak_flops=hs.flops, extra=extra)


def estimate(ops: list[tuple[float, float]], speed: Speed) -> float:
    if not ops:
        return 0.0
    work = 0.0
    for flops, moved in ops:
        t = flops / speed.flops if speed.flops > 0 else 0.0
        if speed.bandwidth:
            t = max(t, moved / speed.bandwidth)
        work += t
    launch = len(ops) * speed.overhead
    return max(work, launch) if speed.asynchronous else work + launch

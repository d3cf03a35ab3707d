"""Per-layer costs of a model on a set of devices (``torchspan.profile``).

Usage::

    prof = torchspan.profile(model, torch.randn(32, 512), devices="cuda:0,cpu", optimizer="adam")
    prof.layers[0].param_bytes, prof.layers[0].forward_seconds(device=0, samples=8)
    print(prof)                                  # one row per layer

Bytes are per layer (parameters, gradients, optimizer state, buffers) or per sample (saved
activations, boundary output). Times follow ``fixed + samples * per_sample`` per device, measured on
devices that are present and estimated from FLOPs for described ones (``time_source`` says which).

How each figure is obtained
    parameters, gradients, buffers  counted from the module (shared tensors counted once, in the
        first layer that owns them; gradients only for ``requires_grad`` parameters).
    optimizer state  one ``step()`` of the real optimizer class on ``meta`` copies of each distinct
        parameter shape, so any ``torch.optim`` optimizer (and most custom ones) is sized exactly,
        scalars such as Adam's ``step`` included; nothing is allocated.
    activations      a forward/backward under ``FakeTensorMode`` (no memory, no compute) with
        ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves is attributed to
        the layer running when it was saved, storages are counted once, and tensors that share a
        parameter's or buffer's storage are state, not activations. Run at batch B and 2B, the
        difference gives bytes per sample and the rest a fixed part; a third size checks linearity.
    FLOPs, traffic   ``torch.utils.flop_counter.FlopCounterMode`` plus a dispatch mode that adds
        the bytes every aten op reads and writes, per layer, forward and backward separately.
    times            present devices: each layer is run alone on the inputs it received in a real
        forward (captured by hooks on the top-level children), forward then backward, after
        ``warmup`` runs, median of ``repeats``, at batch B and B/4; the line through the two
        points gives ``fixed`` and ``per_sample``. Once per device model (kind and name): two
        present GPUs of one model share the first one's times, so that timing noise does not make
        identical devices look different to the planner. Described devices: per aten op,
        ``max(flops / (peak * compute_efficiency), bytes / (bandwidth * memory_efficiency))`` plus a
        per-op overhead (see ``torchspan.hardware.catalog``), evaluated at the same two batch sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..hardware import Device, catalog
from ..hardware import devices as find_devices
from ..layers import descends, model_layers, top_level_layers
from .costs import LayerCost, Profile
from .layersizes import layer_costs, note_glue, size_passes
from .optim_state import optimizer_spec
from .sizing import (
    Sizes,
    as_call,
    batch_size_of,
    float_dtype,
    input_bytes,
    meta_forward,
    parse_dtype,
    resize_batch,
)
from .timing import (
    Speed,
    capture,
    estimate,
    fit,
    host_speed_device,
    on_device,
    preserved,
    speed_of,
    time_layer,
)

__all__ = ["profile"]


def profile(
    model: nn.Module,
    example_inputs: Any,
    devices: Any = "auto",
    optimizer: Any = "adam",
    dtype: torch.dtype | str | None = None,
    *,
    warmup: int = 2,
    repeats: int = 5,
    measure: bool = True,
) -> Profile:
    """Measure and estimate per-layer costs of training ``model`` on ``example_inputs``.

    Usage::

        prof = torchspan.profile(model, torch.randn(32, 512), "a100-40gb*2,cpu", optimizer="adamw")

    ``example_inputs``: a batch tensor, a tuple of forward arguments, or a dict of keyword
    arguments (``{"input_ids": ids, "attention_mask": mask, "use_cache": False}``); dim 0 of the
    first tensor is the batch size. Layers are ``torchspan.layers.model_layers`` (blocks with
    qualified names for models built of repeated blocks; a tied parameter counts in its first layer).
    ``devices``: anything ``torchspan.devices`` accepts. ``optimizer``: a name (see ``OPTIMIZERS``), a
    ``torch.optim.Optimizer`` subclass or instance (its hyper-parameters, e.g. SGD momentum, decide the
    state). ``dtype``: profile as if floating parameters and inputs were cast to it (default: the model's).
    ``warmup``/``repeats``: timing runs per layer and batch size. ``measure=False`` estimates present devices
    too (from this CPU's measured speed).

    The model's parameters, buffers, gradients and RNG state are as before when this returns; the
    model runs in its current mode (call ``model.train()`` first for training figures).
    """
    _check_arguments(model, warmup, repeats)
    dtype = parse_dtype(dtype)
    args, kwargs = as_call(example_inputs)
    batch = batch_size_of((args, kwargs))
    devs = find_devices(devices)
    spec = optimizer_spec(optimizer)
    compute_dtype = float_dtype(model, dtype)
    layers_of = _layers(model, args, kwargs)  # the one layer list: sizing and timing get it from here
    notes: list[str] = []

    sizes_at, small = size_passes(model, layers_of, args, kwargs, batch, dtype, notes)
    layers = layer_costs(dict(layers_of), sizes_at, small, batch, spec, dtype, notes)
    note_glue(sizes_at[batch], notes)
    timing = _Timing(model, layers_of, (args, kwargs), batch, small, sizes_at, dtype, warmup, repeats, notes)
    out_devices, measured = _time_devices(timing, devs, layers, compute_dtype, measure)
    calibration = _calibration(devs, out_devices, measured, layers, sizes_at, batch, compute_dtype)
    return Profile(
        layers=layers,
        devices=out_devices,
        batch_size=batch,
        input_bytes=input_bytes((args, kwargs), dtype) / batch,
        optimizer=spec.label,
        dtype=str(compute_dtype).replace("torch.", ""),
        notes=notes,
        calibration=calibration,
    )


def _check_arguments(model: Any, warmup: Any, repeats: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__} is not an nn.Module; pass the model to profile")
    for name, value in (("warmup", warmup), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "repeats" else 0):
            raise ValueError(f"{name}={value!r} must be an int >= {1 if name == 'repeats' else 0}")


@dataclass
class _Timing:
    """What timing the layers needs: the model, its layers, the example call, the fake passes, the run
    counts."""

    model: nn.Module
    layers_of: list[tuple[str, nn.Module]]
    call: tuple[tuple[Any, ...], dict[str, Any]]
    batch: int
    small: int
    sizes_at: dict[int, Sizes]
    dtype: torch.dtype | None
    warmup: int
    repeats: int
    notes: list[str]


Times = dict[
    str, tuple[float, float, float, float]
]  # layer -> (forward fixed, per sample, backward fixed, per sample)


def _time_devices(
    timing: _Timing, devs: list[Device], layers: list[LayerCost], compute_dtype: torch.dtype, measure: bool
) -> tuple[list[Device], dict[tuple[str, str], Times]]:
    """Append every device's times to ``layers``: measured once per present device model, else estimated.

    Returns the profile's devices (a present CPU with this host's speed) and the measured times by device
    model.
    """
    notes = timing.notes
    model = timing.model
    meta_params = any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    if meta_params and measure:
        notes.append("parameters are on meta (no data): times on present devices are estimated, not measured")
    out_devices: list[Device] = []
    measured: dict[tuple[str, str], Times] = {}
    measured_on: dict[tuple[str, str], str] = {}
    for d in devs:
        present_cpu = d.present and d.kind in ("cpu", "meta")
        out_devices.append(host_speed_device(d) if present_cpu else d)
        can_measure = measure and d.present and d.kind != "meta" and not meta_params
        key = _model_key(d)
        if can_measure and key not in measured:
            t, base = timing, timing.sizes_at[timing.batch]
            measured[key] = _measure(
                t.model,
                t.layers_of,
                t.call,
                t.batch,
                t.small,
                base.order,
                base,
                d.device,
                t.dtype,
                t.warmup,
                t.repeats,
                notes,
            )
            measured_on[key] = str(d.device)
    for i, (d, dd) in enumerate(zip(devs, out_devices)):
        key = _model_key(d)
        if key in measured:
            if measured_on[key] != str(d.device):
                notes.append(
                    f"{d.device} ({d.name}) takes the times measured on {measured_on[key]}, the same model: "
                    "one set of times per model keeps the planner's devices interchangeable, not split by "
                    "timing noise"
                )
            for lay in layers:
                _append_times(lay, *measured[key][lay.name], "measured")
        else:
            _append_estimates(timing, i, d, dd, layers, compute_dtype)
    return out_devices, measured


def _append_estimates(
    timing: _Timing, i: int, d: Device, dd: Device, layers: list[LayerCost], compute_dtype: torch.dtype
) -> None:
    """Times of device ``i`` from its figures (FLOPs and bytes per op), at the two batch sizes of the fit."""
    try:
        speed = speed_of(catalog.with_figures(dd), compute_dtype)
    except ValueError as exc:
        raise ValueError(f"devices[{i}]={str(d.device)!r}: {exc}") from None
    label = speed.label + (" (meta has no speed of its own; this CPU's figures)" if d.kind == "meta" else "")
    for lay in layers:
        _append_times(
            lay, *_estimate_layer(timing.sizes_at, timing.small, timing.batch, lay.name, speed), label
        )


def _calibration(
    devs: list[Device],
    out_devices: list[Device],
    measured: dict[tuple[str, str], Times],
    layers: list[LayerCost],
    sizes_at: dict[int, Sizes],
    batch: int,
    compute_dtype: torch.dtype,
) -> dict[str, float]:
    """How well FLOP-based estimates match measurements on this machine: measured / estimated, per measured
    CPU."""
    calibration: dict[str, float] = {}
    for i, (d, dd) in enumerate(zip(devs, out_devices)):
        key = str(d.device)
        if _model_key(d) in measured and d.kind == "cpu" and key not in calibration:
            speed = speed_of(dd, compute_dtype)
            est = sum(sum(_estimate_pair(sizes_at, batch, lay.name, speed)) for lay in layers)
            meas = sum(lay.forward_seconds(i, batch) + lay.backward_seconds(i, batch) for lay in layers)
            if est > 0:
                calibration[key] = meas / est
    return calibration


def _layers(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, nn.Module]]:
    """``model_layers`` as (name, module) pairs; blocks are found by one forward (on meta inputs for a meta
    model)."""
    if not descends(model):
        return top_level_layers(model)
    homes = {t.device for t in list(model.parameters()) + list(model.buffers())}
    if len(homes) == 1:
        home = homes.pop()
        args, kwargs = tree_map(lambda t: t.to(home) if isinstance(t, torch.Tensor) else t, (args, kwargs))
    try:
        with meta_forward(
            model
        ):  # a meta model's forward under FakeTensorMode: data-dependent checks skipped
            found = model_layers(model, tuple(args), dict(kwargs))
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ValueError) and "layer" in str(exc):
            raise  # find_layers' own message: a module that cannot be one layer, a bad split point
        text = str(exc).strip()
        raise ValueError(
            f"{type(model).__name__} fails on example_inputs ({type(exc).__name__}: "
            f"{text.splitlines()[0] if text else ''}); pass inputs its forward accepts (shape, dtype, e.g. "
            "integer token ids for an Embedding; a dict for keyword arguments)"
        ) from exc
    except Exception as exc:
        text = str(exc).strip()
        raise ValueError(
            f"{type(model).__name__} fails on example_inputs ({type(exc).__name__}: "
            f"{text.splitlines()[0] if text else ''}); pass inputs its forward accepts (shape, dtype, e.g. "
            "integer token ids for an Embedding; a dict for keyword arguments)"
        ) from exc
    return [(layer.name, layer.module) for layer in found]


def _model_key(d: Device) -> tuple[str, str]:
    """Present devices measured once per model: ``('cpu', 'cpu')``, or the kind and name (``'NVIDIA H100 80GB
    HBM3'``)."""
    if d.kind in ("cpu", "meta"):
        return (d.kind, str(d.device))
    return (d.kind, d.name)


def _append_times(lay: LayerCost, ff: float, fp: float, bf: float, bp: float, source: str) -> None:
    lay.forward_fixed.append(ff)
    lay.forward_per_sample.append(fp)
    lay.backward_fixed.append(bf)
    lay.backward_per_sample.append(bp)
    lay.time_source.append(source)


def _estimate_pair(sizes_at: dict[int, Sizes], s: int, name: str, speed: Speed) -> tuple[float, float]:
    sz = sizes_at[s]
    return estimate(sz.ops.get((name, "forward"), []), speed), estimate(
        sz.ops.get((name, "backward"), []), speed
    )


def _estimate_layer(
    sizes_at: dict[int, Sizes], small: int, batch: int, name: str, speed: Speed
) -> tuple[float, float, float, float]:
    fwd: dict[int, float] = {}
    bwd: dict[int, float] = {}
    for s in {small, batch}:
        fwd[s], bwd[s] = _estimate_pair(sizes_at, s, name, speed)
    ff, fp = fit(fwd)
    bf, bp = fit(bwd)
    return ff, fp, bf, bp


def _measure(
    model: nn.Module,
    layers_of: list[tuple[str, nn.Module]],
    call: tuple[tuple[Any, ...], dict[str, Any]],
    batch: int,
    small: int,
    order: list[str],
    base: Sizes,
    dev: torch.device,
    dtype: torch.dtype | None,
    warmup: int,
    repeats: int,
    notes: list[str],
) -> Times:
    """Each layer timed alone on ``dev`` at the two batch sizes (rescaled to a whole-model pass when it lives
    there)."""
    children = dict(layers_of)
    fwd: dict[str, dict[int, float]] = {n: {} for n in order}
    bwd: dict[str, dict[int, float]] = {n: {} for n in order}
    # Layers timed alone run with warm caches and miss the glue between them; when the whole model
    # already lives on `dev`, one whole forward/backward per batch size rescales them (see _calibrate).
    whole_model = dtype is None and all(
        t.device == dev for t in list(model.parameters()) + list(model.buffers())
    )
    scales: list[tuple[int, float, float]] = []
    with preserved(model):
        for s in sorted({small, batch}):
            sub = (
                call
                if s == batch
                else resize_batch(
                    call, batch, s, lambda t, shape: t[: shape[0]] if tuple(t.shape) != shape else t
                )
            )
            calls = capture(model, layers_of, tuple(sub[0]), sub[1])
            for name in order:
                if not calls[name]:
                    fwd[name][s] = bwd[name][s] = 0.0
                    continue
                with on_device(children[name], dev, dtype) as module:
                    fwd[name][s], bwd[name][s] = time_layer(
                        module, calls[name], base.requires_grad[name], dev, dtype, warmup, repeats
                    )
            del calls
            if whole_model:
                _calibrate(model, tuple(sub[0]), order, fwd, bwd, s, dev, warmup, repeats, scales, sub[1])
    if scales:
        shown = ", ".join(f"batch {b}: forward x{f:.2f}, backward x{k:.2f}" for b, f, k in scales)
        notes.append(f"{dev}: per-layer times scaled to match a whole-model pass ({shown})")
    out = {}
    for name in order:
        ff, fp = fit(fwd[name])
        bf, bp = fit(bwd[name])
        out[name] = (ff, fp, bf, bp)
    return out


_SCALE_LIMITS = (0.5, 2.0)


def _calibrate(
    model: nn.Module,
    args: tuple[Any, ...],
    order: list[str],
    fwd: dict[str, dict[int, float]],
    bwd: dict[str, dict[int, float]],
    samples: int,
    dev: torch.device,
    warmup: int,
    repeats: int,
    scales: list[tuple[int, float, float]],
    kwargs: dict[str, Any] | None = None,
) -> None:
    """Scale the layers' times at ``samples`` so they add up to one whole-model forward/backward.

    The factor is clamped to ``_SCALE_LIMITS``: beyond that the per-layer figures are not trusted to
    be fixed by a single factor, and the clamped value is what the note reports.
    """
    whole_f, whole_b = time_layer(model, [(tuple(args), dict(kwargs or {}))], [], dev, None, warmup, repeats)
    sum_f = sum(fwd[n][samples] for n in order)
    sum_b = sum(bwd[n][samples] for n in order)
    lo, hi = _SCALE_LIMITS
    kf = min(hi, max(lo, whole_f / sum_f)) if sum_f > 0 and whole_f > 0 else 1.0
    kb = min(hi, max(lo, whole_b / sum_b)) if sum_b > 0 and whole_b > 0 else 1.0
    for n in order:
        fwd[n][samples] *= kf
        bwd[n][samples] *= kb
    scales.append((samples, kf, kb))

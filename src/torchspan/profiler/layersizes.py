"""The size side of ``torchspan.profile``: fake passes at three batch sizes and each layer's bytes and FLOPs.

``size_passes`` runs the model on fake tensors at the batch, twice it and a small batch (the time fit's two
points); ``layer_costs`` turns them into one ``LayerCost`` per layer without times: parameter, gradient,
optimizer state and buffer bytes (a shared tensor counts in its first layer), saved activations and outputs
per sample and fixed, FLOPs forward and backward. ``measure`` adds the times.

Usage::

    sizes_at, small = size_passes(model, layers_of, args, kwargs, batch, dtype, notes)
    layers = layer_costs(dict(layers_of), sizes_at, small, batch, optimizer_spec("adam"), dtype, notes)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .costs import LayerCost
from .optim_state import param_state_bytes
from .sizing import Sizes, nbytes_as, sizing_pass

__all__ = ["layer_costs", "note_glue", "size_passes"]


def _kind(module: nn.Module) -> str:
    return type(module).__name__


def size_passes(
    model: nn.Module,
    layers_of: list[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    batch: int,
    dtype: torch.dtype | None,
    notes: list[str],
) -> tuple[dict[int, Sizes], int]:
    """Fake passes at ``batch``, ``2 * batch`` and a smaller batch for the time fit: ``(sizes by batch,
    small)``.

    The small batch is ``>= 2`` samples (BatchNorm refuses one in training); a model that does not run
    at it gets ``small = batch`` and a note.
    """
    small = min(batch, max(2, batch // 4))
    sizes_at: dict[int, Sizes] = {}
    for s in sorted({small, batch, 2 * batch}, reverse=True):
        try:
            sizes_at[s] = sizing_pass(model, layers_of, args, batch, s, dtype, kwargs)
        except Exception as exc:
            if s == small and small != batch:
                notes.append(
                    f"the model does not run at batch {small} ({type(exc).__name__}); times are fit "
                    f"through 0 from batch {batch} alone"
                )
                small = batch
                continue
            raise ValueError(
                f"could not size {type(model).__name__} with fake tensors at batch {s} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); check that "
                "example_inputs fit the forward (shape, dtype); otherwise data-dependent Python control "
                "flow (e.g. `if x.sum() > 0`, `.item()`) or ops without fake/meta kernels prevent sizing"
            ) from exc
    return sizes_at, small


def layer_costs(
    children: dict[str, nn.Module],
    sizes_at: dict[int, Sizes],
    small: int,
    batch: int,
    spec: Any,
    dtype: torch.dtype | None,
    notes: list[str],
) -> list[LayerCost]:
    """One ``LayerCost`` per layer in call order, without times: state bytes, activations, outputs, FLOPs."""
    base = sizes_at[batch]
    owned: set[int] = set()  # a tensor shared by layers counts in the first one
    cache: dict[Any, int] = {}
    layers: list[LayerCost] = []
    for name in base.order:
        child = children[name]
        pb, gb, ob, bb = _state_bytes(child, owned, cache, spec, dtype)
        act_ps, act_fixed = _per_sample(sizes_at, batch, lambda sz, n=name: sz.saved[n])
        out_ps, out_fixed = _per_sample(sizes_at, batch, lambda sz, n=name: sz.output[n])
        shared_ps, _ = _per_sample(sizes_at, batch, lambda sz, n=name: sz.shared[n])
        fwd_f, _ = _per_sample(
            sizes_at, batch, lambda sz, n=name: sum(f for f, _ in sz.ops.get((n, "forward"), []))
        )
        bwd_f, _ = _per_sample(
            sizes_at, batch, lambda sz, n=name: sum(f for f, _ in sz.ops.get((n, "backward"), []))
        )
        if not _linear(sizes_at, small, batch, lambda sz, n=name: sz.saved[n]):
            notes.append(
                f"layer {name!r}: saved-activation bytes are not linear in the batch size; figures fit "
                f"batch {batch}..{2 * batch}"
            )
        layers.append(
            LayerCost(
                name=name,
                kind=_kind(child),
                param_bytes=pb,
                grad_bytes=gb,
                optimizer_bytes=ob,
                buffer_bytes=bb,
                activation_bytes=act_ps,
                output_bytes=out_ps,
                flops=fwd_f,
                activation_fixed_bytes=act_fixed,
                output_fixed_bytes=out_fixed,
                backward_flops=bwd_f,
                calls=base.calls[name],
                shared_activation_bytes=shared_ps,
            )
        )
    return layers


def _state_bytes(
    child: nn.Module, owned: set[int], cache: dict[Any, int], spec: Any, dtype: torch.dtype | None
) -> tuple[int, int, int, int]:
    """``(parameters, gradients, optimizer state, buffers)`` bytes of ``child``'s tensors not in ``owned``
    (added to it)."""
    pb = gb = ob = bb = 0
    for p in child.parameters():
        if id(p) in owned:
            continue
        owned.add(id(p))
        size = nbytes_as(p, dtype)
        pb += size
        if p.requires_grad:
            gb += size
        ob += param_state_bytes(spec, p, dtype, cache)
    for b in child.buffers():
        if id(b) in owned:
            continue
        owned.add(id(b))
        bb += nbytes_as(b, dtype)
    return pb, gb, ob, bb


def note_glue(base: Sizes, notes: list[str]) -> None:
    """A note when more than 5% of the FLOPs run in the model's own forward, outside every layer."""
    glue = sum(f for (n, _), ops in base.ops.items() if n is None for f, _ in ops)
    total = sum(f for ops in base.ops.values() for f, _ in ops)
    if total and glue / total > 0.05:
        notes.append(
            f"{glue / total:.0%} of FLOPs run outside the top-level children (in the model's own forward) "
            "and are not in any layer"
        )


def _per_sample(sizes_at: dict[int, Sizes], batch: int, get: Callable[[Sizes], float]) -> tuple[float, float]:
    """``(per_sample, fixed)`` from the passes at ``batch`` and ``2 * batch``."""
    a1 = float(get(sizes_at[batch]))
    a2 = float(get(sizes_at[2 * batch]))
    per = max(0.0, (a2 - a1) / batch)
    fixed = max(0.0, a1 - batch * per)
    return per, fixed


def _linear(sizes_at: dict[int, Sizes], small: int, batch: int, get: Callable[[Sizes], float]) -> bool:
    if small == batch:
        return True
    per, fixed = _per_sample(sizes_at, batch, get)
    predicted = fixed + small * per
    actual = float(get(sizes_at[small]))
    return abs(predicted - actual) <= 0.01 * max(predicted, actual) + 64

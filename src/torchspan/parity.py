"""Gradients against one device: the proof that a spanned step trains exactly like a plain one.

``check_parity`` runs one ``spanned.train_step`` and the same full batch through a plain copy of
the model on one device, then compares every parameter's gradient by qualified name.
``grad_differences`` is the comparison alone (a rank of a multi-process run compares the
parameters it holds). A gradient is *within* tolerance when every element satisfies
``|g - g_ref| <= atol + rtol * |g_ref|`` (the rule of ``torch.testing.assert_close``); a
gradient on one side only is never within.

Usage::

    reference = copy.deepcopy(model)                  # before span moves the model
    spanned = torchspan.span(model, devices="cpu,cpu", microbatches=4)
    result = check_parity(spanned, reference, x, y, nn.functional.mse_loss)
    assert result.ok, "\\n".join(result.failures())
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .runtime.spanned import Spanned

__all__ = ["GradDiff", "Parity", "grad_difference", "grad_differences", "check_parity"]


@dataclass(frozen=True)
class GradDiff:
    """How far one parameter's gradient is from the reference's.

    ``max_abs``: the largest ``|g - g_ref|``; ``max_rel``: that over the largest ``|g_ref|`` (0 when
    the reference gradient is all zeros); both ``inf`` when only one side has a gradient.
    """

    name: str
    max_abs: float
    max_rel: float
    within: bool

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values: an infinite difference (a gradient on one side only) as ``"inf"``."""
        return {
            "name": self.name,
            "max_abs": self.max_abs if math.isfinite(self.max_abs) else str(self.max_abs),
            "max_rel": self.max_rel if math.isfinite(self.max_rel) else str(self.max_rel),
            "within": self.within,
        }


@dataclass(frozen=True)
class Parity:
    """The result of :func:`check_parity`: per-parameter differences and both losses."""

    grads: tuple[GradDiff, ...]
    loss: float
    reference_loss: float
    atol: float
    rtol: float

    @property
    def same_loss(self) -> bool:
        return math.isclose(self.loss, self.reference_loss, rel_tol=max(self.rtol, 1e-6), abs_tol=self.atol)

    @property
    def ok(self) -> bool:
        """Every gradient within tolerance and the same loss."""
        return self.same_loss and all(g.within for g in self.grads)

    def under(self, prefix: str) -> list[GradDiff]:
        """The differences of parameters named ``prefix`` or ``prefix.…`` (one layer's)."""
        return [g for g in self.grads if g.name == prefix or g.name.startswith(prefix + ".")]

    def failures(self) -> list[str]:
        """One line per parameter out of tolerance, and one for a different loss."""
        lines = [
            f"{g.name}: max abs diff {g.max_abs:.3e}, max rel diff {g.max_rel:.3e} (atol={self.atol:g}, "
            f"rtol={self.rtol:g})"
            for g in self.grads
            if not g.within
        ]
        if not self.same_loss:
            lines.append(f"loss: spanned {self.loss:.6g}, one device {self.reference_loss:.6g}")
        return lines


def _pairs(
    model: nn.Module, reference: nn.Module, names: Collection[str] | None
) -> Iterator[tuple[str, nn.Parameter, nn.Parameter]]:
    ref = dict(reference.named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters(remove_duplicate=False):
        if names is not None and name not in names:
            continue
        if name not in ref:
            raise ValueError(
                f"parameter {name!r} of the model has no counterpart in reference; pass a copy of the same "
                "model made before spanning (`reference = copy.deepcopy(model)`)"
            )
        yield name, p, ref[name]


def grad_differences(
    model: nn.Module,
    reference: nn.Module,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    names: Collection[str] | None = None,
) -> list[GradDiff]:
    """Compare each parameter's ``.grad`` of ``model`` with the same-named one of ``reference``.

    ``names`` limits the comparison to those qualified names (e.g. the parameters one rank holds).
    Tied parameters appear under every name they have. Usage: ``grad_differences(model, ref)``.
    """
    if atol < 0 or rtol < 0:
        raise ValueError(f"atol={atol!r}, rtol={rtol!r}: tolerances must be >= 0, e.g. atol=1e-5, rtol=1e-4")
    return [
        grad_difference(name, p.grad, ref_p.grad, atol=atol, rtol=rtol)
        for name, p, ref_p in _pairs(model, reference, names)
    ]


def grad_difference(
    name: str,
    grad: torch.Tensor | None,
    reference_grad: torch.Tensor | None,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> GradDiff:
    """How far one gradient is from the reference's (``None`` = no gradient; on one side only: never within).

    Usage: ``grad_difference("0.weight", g, g_ref)`` (e.g. for gradients a rank sent back by name).
    """
    if atol < 0 or rtol < 0:
        raise ValueError(f"atol={atol!r}, rtol={rtol!r}: tolerances must be >= 0, e.g. atol=1e-5, rtol=1e-4")
    if (grad is None) != (reference_grad is None):
        return GradDiff(name, math.inf, math.inf, False)
    if grad is None or reference_grad is None:
        return GradDiff(name, 0.0, 0.0, True)
    g, rg = grad.detach().float().cpu(), reference_grad.detach().float().cpu()
    if g.shape != rg.shape:
        raise ValueError(
            f"gradient of {name!r} has shape {tuple(g.shape)} but the reference's has {tuple(rg.shape)}; "
            "pass a copy of the same model as reference"
        )
    diff = (g - rg).abs()
    worst = diff.max().item() if diff.numel() else 0.0
    scale = rg.abs().max().item() if rg.numel() else 0.0
    return GradDiff(
        name, worst, worst / scale if scale > 0 else 0.0, bool(torch.all(diff <= atol + rtol * rg.abs()))
    )


def _call(model: nn.Module, inputs: Any, device: torch.device) -> Any:
    """``model(inputs)`` the way ``train_step`` reads inputs: a tensor, a tuple of arguments, or keyword
    arguments."""

    def to(v: Any) -> Any:
        return v.to(device) if isinstance(v, torch.Tensor) else v

    if isinstance(inputs, dict):
        return model(**{k: to(v) for k, v in inputs.items()})
    if isinstance(inputs, tuple):
        return model(*(to(v) for v in inputs))
    return model(to(inputs))


def check_parity(
    spanned: Spanned,
    reference: nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> Parity:
    """One ``spanned.train_step(inputs, target, loss_fn)`` against ``loss_fn(reference(inputs),
    target).backward()``.

    ``reference`` is a plain copy of the spanned model made before spanning, on one device (its
    first parameter's, inputs are moved there). ``target`` may be a function of the reference's
    output returning the target (e.g. random values shaped like it); the spanned step then gets
    the same target. Gradients are added to ``.grad`` on both sides, so zero them first.
    """
    if not isinstance(spanned, Spanned):
        raise TypeError(f"spanned={type(spanned).__name__}; pass the result of torchspan.span(model, ...)")
    if not isinstance(reference, nn.Module) or reference is spanned.module:
        raise TypeError(
            "reference must be a separate copy of the model made before spanning: "
            "`reference = copy.deepcopy(model)`, then `spanned = torchspan.span(model, ...)`"
        )
    device = next((p.device for p in reference.parameters()), torch.device("cpu"))
    out = _call(reference, inputs, device)
    if callable(target) and not isinstance(target, torch.Tensor):
        target = target(out)
    reference_loss = loss_fn(out, target)
    reference_loss.backward()
    loss = spanned.train_step(inputs, target, loss_fn)
    grads = grad_differences(spanned.module, reference, atol=atol, rtol=rtol)
    return Parity(tuple(grads), float(loss), float(reference_loss.detach()), atol, rtol)

"""Calibrating an opaque loss on a batch: make the micro-batch weighting exact, or refuse before any backward.

``loss_spec`` cannot read what a lambda or a user function divides by. ``calibrate`` finds out from
a no-grad dry forward's per-micro-batch outputs: it compares the full-batch value
``loss_fn(concat(outputs), concat(targets))`` with the micro-batch losses weighted by sample share
(a mean) and summed (a sum). Exactly one match decides the weights; none, or an ambiguous value
(e.g. a zero loss), is a ``ValueError`` naming the loss, the values and the ways out, raised before
the optimizer can see a wrong ``.grad``. A user's ``loss_normalizer`` is verified the same way.
``LossChecks`` remembers each answer per loss and batch structure (sizes, target shapes and the
count of negative, i.e. padding, labels per chunk), so a training loop pays for one dry forward
on its first step and again only when the structure changes.

Usage::

    spec = calibrate(loss_spec(lambda o, t: (o * t).sum()), outputs, targets, sizes)   # spec.kind == "sum"
    checks = LossChecks()                                   # one per Spanned
    spec = checks.resolve(spec, targets, sizes, dry_outputs=run_forward_without_grad)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from ..layers.slots import buffer_slots, kept
from . import modelloss
from .lossweights import LossSpec
from .microbatch import NoSplit, gather

__all__ = ["calibrate", "batch_structure", "LossChecks", "dry_run", "loss_identity", "same_identity", "RTOL"]

RTOL = 1e-5  # relative tolerance of a match, for float32 losses (wider for half precision)
_ATOL = 1e-7  # absolute floor, relative to the largest weighted micro-batch loss
_KEEP = 32  # calibrations remembered per LossChecks


def _first_device(value: Any) -> torch.device | None:
    return next((t.device for t in tree_leaves(value) if isinstance(t, torch.Tensor)), None)


def _to(value: Any, device: torch.device | None) -> Any:
    if device is None:
        return value
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def _is_nosplit(v: Any) -> bool:
    return isinstance(v, NoSplit)


def _unwrap(v: Any) -> Any:
    return v.value if isinstance(v, NoSplit) else v


def _scalar(spec: LossSpec, value: Any, what: str) -> tuple[float, torch.dtype]:
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        got = (
            f"a tensor of shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor)
            else f"a {type(value).__name__}"
        )
        raise ValueError(
            f"loss_fn={spec.name} returned {got}; it must return a scalar (use reduction='mean' or 'sum'), "
            f"here on {what}"
        )
    return float(value), value.dtype


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b)) + atol


def calibrate(
    spec: LossSpec,
    outputs: Sequence[Any],
    targets: Sequence[Any],
    sizes: Sequence[int],
    *,
    target: Any = None,
) -> LossSpec:
    """``spec`` with exact weights decided from one batch's per-micro-batch ``outputs`` and ``targets``.

    Known and declared specs come back unchanged. An opaque spec becomes ``"samples"`` (a mean
    over samples) or ``"sum"`` when exactly one of them reproduces the full-batch value
    (``target``: the unsplit target, default the chunks concatenated); a ``"user"`` spec (a
    ``loss_normalizer``) must reproduce it. Otherwise raises ``ValueError`` naming the loss, the
    full-batch value, the weighted values and the ways out. Runs under ``no_grad``.
    """
    if not spec.needs_check:
        return spec
    if spec.kind == "model":
        return modelloss.verify(spec, outputs, targets)
    if not (len(outputs) == len(targets) == len(sizes)) or not sizes:
        raise ValueError(
            f"outputs, targets and sizes must have one entry per micro-batch; got {len(outputs)}, "
            f"{len(targets)}, {len(sizes)}"
        )
    if len(sizes) == 1:  # one micro-batch weighs 1 whatever the loss divides by: nothing to check
        return spec if spec.kind == "user" or spec.declared else spec.resolved("samples")
    verifying = spec.kind == "user" or spec.declared  # a declaration is checked, never trusted
    parts, full, rtol = _evaluate(spec, outputs, targets, target)
    if verifying:
        value, ok = _reproduces(spec, parts, full, rtol, targets, sizes)
        if ok:
            return spec
        values = [
            _reproduces(c, parts, full, rtol, targets, sizes)[0]
            for c in (spec.resolved("samples"), spec.resolved("sum"))
        ]
        raise ValueError(
            _refusal(
                spec, full, [value, *values], sizes, hints=_hints(spec, parts, full, rtol, targets, sizes)
            )
        )
    candidates = [spec.resolved("samples"), spec.resolved("sum")]
    checked = [_reproduces(c, parts, full, rtol, targets, sizes) for c in candidates]
    matches = [c for c, (_, ok) in zip(candidates, checked) if ok]
    if len(matches) == 1:
        return matches[0]
    values = [v for v, _ in checked]
    hints = [] if matches else _hints(spec, parts, full, rtol, targets, sizes)
    raise ValueError(_refusal(spec, full, values, sizes, ambiguous=len(matches) > 1, hints=hints))


def _evaluate(
    spec: LossSpec, outputs: Sequence[Any], targets: Sequence[Any], target: Any
) -> tuple[list[float], float, float]:
    """Each micro-batch's loss, the full batch's loss and the relative tolerance of a match (no grad)."""
    device = _first_device(outputs[0])
    with torch.no_grad():
        parts = [
            _scalar(spec, spec.loss_fn(out, _to(tgt, _first_device(out))), f"micro-batch {i}")[0]
            for i, (out, tgt) in enumerate(zip(outputs, targets))
        ]
        whole_target = (
            gather(list(targets)) if target is None else tree_map(_unwrap, target, is_leaf=_is_nosplit)
        )
        whole = gather(
            list(outputs), scalars="drop"
        )  # a model's own 0-d loss cannot be concatenated: the loss_fn reads logits
        full, dtype = _scalar(spec, spec.loss_fn(whole, _to(whole_target, device)), "the full batch")
    rtol = max(RTOL, 8 * torch.finfo(dtype).eps) if dtype.is_floating_point else RTOL
    return parts, full, rtol


def _reproduces(
    spec: LossSpec,
    parts: Sequence[float],
    full: float,
    rtol: float,
    targets: Sequence[Any],
    sizes: Sequence[int],
) -> tuple[float, bool]:
    """The micro-batch losses weighted by ``spec``, and whether that is the full-batch loss."""
    weights = spec.weights(targets, sizes)
    terms = [w * p for w, p in zip(weights, parts) if w != 0.0]
    value = math.fsum(terms)
    atol = _ATOL + rtol * max((abs(t) for t in terms), default=0.0)
    return value, _close(value, full, rtol, atol)


def _hints(
    spec: LossSpec,
    parts: Sequence[float],
    full: float,
    rtol: float,
    targets: Sequence[Any],
    sizes: Sequence[int],
) -> list[str]:
    """Token normalizers (``loss_normalizer=`` as a user writes it) that reproduce the full-batch loss on this
    batch: a refusal suggests only advice that works."""
    labels = [t for t in targets if isinstance(t, torch.Tensor)]
    if len(labels) != len(targets) or not labels or labels[0].is_floating_point() or labels[0].dim() == 0:
        return []
    negatives = (
        sorted({int(v) for t in labels for v in t[t < 0].unique().tolist()})
        if any((t < 0).any() for t in labels)
        else []
    )
    pad = negatives[0] if len(negatives) == 1 else -100
    found = []
    for text, fn in (
        (f"lambda y: (y != {pad}).sum()", lambda y: (y != pad).sum()),
        (f"lambda y: (y[..., 1:] != {pad}).sum()", lambda y: (y[..., 1:] != pad).sum()),
    ):
        if labels[0].dim() < 2 and "1:" in text:
            continue
        candidate = dataclasses.replace(spec, kind="user", user_normalizer=fn, declared=True)
        if _reproduces(candidate, parts, full, rtol, targets, sizes)[1]:
            found.append(f"loss_normalizer={text}")
    return found


def _refusal(
    spec: LossSpec,
    full: float,
    values: list[float],
    sizes: Sequence[int],
    *,
    ambiguous: bool = False,
    hints: Sequence[str] = (),
) -> str:
    split = f"{len(sizes)} micro-batches of {', '.join(map(str, sizes))} samples"
    works = (
        f" On this batch {' and '.join(hints)} reproduces it (checked): pass that to train_step."
        if hints
        else ""
    )
    if spec.kind == "user":
        return (
            f"loss_normalizer does not make loss_fn={spec.name} exact: the full-batch loss is {full:.8g} "
            f"but the micro-batch losses weighted by loss_normalizer add up to {values[0]:.8g} ({split}). "
            "It must return what the loss's mean divides by for a chunk's target; or declare "
            "loss_reduction='sum' / 'mean' instead." + works
        )
    if spec.declared:
        other = "mean" if spec.kind == "sum" else "sum"
        return (
            f"loss_reduction={spec.reduction!r} is declared for loss_fn={spec.name}, but it does not hold "
            f"on this batch: the full-batch loss is {full:.8g}, while its {split} give {values[0]:.8g} "
            f"weighted as declared ({values[1]:.8g} weighted by sample share, {values[2]:.8g} summed), so "
            "torchspan refuses before any backward. Drop loss_reduction (torchspan then calibrates it), or "
            f"declare loss_reduction={other!r} if that is what it does." + works
        )
    if ambiguous:
        head = (
            f"cannot tell from this batch whether loss_fn={spec.name} is a mean or a sum: the full-batch "
            f"loss {full:.8g} equals both the sample-share weighting ({values[0]:.8g}) and the sum "
            f"({values[1]:.8g}) of its {split} (e.g. a loss of 0)"
        )
    else:
        head = (
            f"loss_fn={spec.name} is not a per-sample mean or a sum: the full-batch loss is {full:.8g}, "
            f"but its {split} give {values[0]:.8g} weighted by sample share and {values[1]:.8g} summed"
        )
    return (
        f"{head}, so torchspan cannot weight it to the single-device gradient and refuses before any "
        "backward. Declare it: loss_reduction='sum' (it adds per-sample losses), loss_reduction='mean' (it "
        "averages over samples), or loss_normalizer=callable returning what its mean divides by for a "
        "chunk's target." + works
    )


def batch_structure(targets: Sequence[Any], sizes: Sequence[int]) -> tuple[Any, ...]:
    """What a calibration holds for: the split, each target's shapes and dtypes, and the count of
    negative integer labels per chunk (padding such as -100 changes what a token mean divides by)."""
    key: list[Any] = [tuple(sizes)]
    for t in targets:
        for leaf in tree_leaves(t):
            if isinstance(leaf, torch.Tensor):
                negatives = -1
                if not leaf.is_floating_point() and not leaf.is_complex() and leaf.dtype != torch.bool:
                    negatives = int((leaf < 0).sum())
                key.append((tuple(leaf.shape), leaf.dtype, negatives))
            else:
                key.append(type(leaf).__name__)
    return tuple(key)


def loss_identity(fn: Any) -> tuple[Any, ...]:
    """Objects that make a loss the same loss, compared with ``is``: a lambda re-created each step
    with the same code and the same captured objects is the same loss."""
    if isinstance(fn, types.FunctionType):
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell
                cells.append(None)
        return (
            fn.__code__,
            fn.__globals__,
            *(fn.__defaults__ or ()),
            *(fn.__kwdefaults__ or {}).values(),
            *cells,
        )
    return (fn,)


class LossChecks:
    """Calibrations remembered per loss and batch structure (the last ``32``)."""

    def __init__(self) -> None:
        self._entries: list[tuple[tuple[Any, ...], tuple[Any, ...], str, LossSpec]] = []
        self.calibrations = 0  # dry forwards run so far (for tests and timing)

    def resolve(
        self,
        spec: LossSpec,
        targets: Sequence[Any],
        sizes: Sequence[int],
        dry_outputs: Callable[[], Sequence[Any]],
        *,
        target: Any = None,
        shards: bool = False,
    ) -> LossSpec:
        """``spec`` made exact: unchanged when known, else calibrated (or, declared, verified) on
        ``dry_outputs()`` (the per-micro-batch outputs of a no-grad forward of this batch), which runs only
        when this loss has not been checked on a batch of this structure yet. ``shards``: this batch is part
        of a larger one (data-parallel replicas), so even one chunk is weighed against the others."""
        if not spec.needs_check:
            return spec
        if len(sizes) == 1 and spec.kind == "model" and not shards:
            return spec  # the whole batch in one chunk: the model's own loss is the loss, whatever it adds
        if len(sizes) == 1 and spec.kind != "model":
            return calibrate(spec, [None], targets, sizes)  # weight 1: nothing to run
        ident = loss_identity(spec.loss_fn) + loss_identity(spec.user_normalizer)
        structure = batch_structure(targets, sizes)
        for i, (known_ident, known_structure, kind, decided) in enumerate(self._entries):
            if known_structure == structure and kind == spec.kind and same_identity(known_ident, ident):
                self._entries.append(self._entries.pop(i))
                return decided if decided.loss_fn is spec.loss_fn else spec.resolved(decided.kind)
        self.calibrations += 1
        decided = calibrate(spec, list(dry_outputs()), targets, sizes, target=target)
        self._entries.append((ident, structure, spec.kind, decided))
        del self._entries[:-_KEEP]
        return decided


def same_identity(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two ``loss_identity`` tuples name the same loss (element by element, ``is``)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


@contextlib.contextmanager
def dry_run(module: nn.Module, devices: Sequence[torch.device]) -> Iterator[None]:
    """A forward that leaves no trace: no autograd graph, the random state forked (the real step
    draws the same dropout masks) and every buffer of ``module`` restored (BatchNorm statistics)."""
    cuda = sorted({d.index if d.index is not None else 0 for d in devices if d.type == "cuda"})
    with torch.no_grad(), torch.random.fork_rng(devices=cuda), kept(buffer_slots([module])):
        yield

"""The model's own loss: ``train_step(batch)`` with ``labels`` in the batch, as transformers users train.

A data collator puts ``labels`` in the batch and the model returns ``output.loss``: most transformers
users never write a loss. torchspan splits the batch into micro-batches (and data-parallel shards),
and each chunk's ``output.loss`` is the model's *mean* over that chunk, so the chunk is weighed by
its share of what the whole batch's mean divides by. That depends on the loss the model computes:

==========================  ============================================  ===================================
the model's loss            recomputed from the chunk's logits            a chunk's normalizer
==========================  ============================================  ===================================
causal LM (shifted by one)  ``CE(logits[..., :-1, :], labels[..., 1:])``  ``(labels[..., 1:] != -100).sum()``
token mean (masked LM,      ``CE(logits, labels)``                        ``(labels != -100).sum()``
seq2seq, token or
sequence classification)
regression / multi-label    ``MSE`` / ``BCE with logits``                 samples
==========================  ============================================  ===================================

torchspan does not trust a class name: on the first batch (and whenever the batch's structure
changes) it recomputes every candidate from a dry forward's logits and keeps the one that equals
``output.loss`` on every chunk (``verify``). A loss that is none of these — an MoE router's
auxiliary loss added to it, a custom loss — is refused before any backward when the batch is split,
naming both values; one chunk on one process needs no weighting and is used as is.

Usage (``Spanned.train_step`` does this)::

    inputs, target, spec = model_loss(batch)               # target: batch["labels"]; spec.kind == "model"
    spec = verify(spec, dry_outputs, label_chunks)          # the normalizer the model's mean divides by
    weights = spec.weights(label_chunks, sizes)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .lossweights import LossSpec
from .microbatch import split_sizes, split_value

__all__ = [
    "ModelLoss",
    "MODEL_LOSS",
    "model_loss",
    "own_loss",
    "verify",
    "combiner",
    "same_value",
    "IGNORE_INDEX",
]

IGNORE_INDEX = -100  # transformers' ignore index for padded labels


class ModelLoss:
    """``loss_fn(output, labels) -> output.loss``: the loss the model computed from the ``labels`` it was
    given."""

    name = "the model's own output.loss"

    def __call__(self, output: Any, labels: Any = None) -> torch.Tensor:
        loss = own_loss(output)
        if loss is None:
            raise ValueError(
                "train_step(batch) uses the model's own loss, but the model returned "
                f"{type(output).__name__} without a loss: give it labels (batch['labels']) it computes a "
                "loss from, or pass train_step(batch, target, loss_fn)"
            )
        return loss

    def __repr__(self) -> str:
        return "ModelLoss()"


MODEL_LOSS = ModelLoss()  # one instance: a loss check is remembered per loss object


def own_loss(output: Any) -> torch.Tensor | None:
    """``output.loss`` of a transformers ``ModelOutput`` or dict, or the first element of a tuple output."""
    if isinstance(output, Mapping):
        value = output.get("loss")
    elif hasattr(output, "loss"):
        value = output.loss
    elif isinstance(output, (tuple, list)) and output:
        value = output[0]
    else:
        value = None
    return value if isinstance(value, torch.Tensor) and value.dim() == 0 else None


def _logits(output: Any) -> torch.Tensor | None:
    value = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    return value if isinstance(value, torch.Tensor) else None


def model_loss(
    inputs: Any, target: Any = None, loss_reduction: str | None = None, loss_normalizer: Any = None
) -> tuple[Any, Any, LossSpec]:
    """``(inputs, labels, spec)`` for ``train_step(batch)`` without a loss function (see the module
    docstring).

    Raises ``ValueError`` naming the fix when the batch has no ``labels`` or a target or declaration is given
    too.
    """
    if not isinstance(inputs, Mapping) or inputs.get("labels") is None:
        got = (
            f"a dict with keys {sorted(inputs)}"
            if isinstance(inputs, Mapping)
            else f"a {type(inputs).__name__}"
        )
        raise ValueError(
            f"train_step(batch) without loss_fn uses the model's own loss, which needs batch['labels'] "
            f"(what a transformers data collator adds); got {got}. Add labels to the batch, or pass "
            "train_step(inputs, target, loss_fn)"
        )
    if target is not None:
        raise ValueError(
            "train_step(batch, target) without loss_fn: the model's own loss reads its labels from "
            "batch['labels']; drop target, or pass loss_fn=... to compute the loss from the outputs and "
            "target yourself"
        )
    if loss_reduction is not None or loss_normalizer is not None:
        raise ValueError(
            "loss_reduction= / loss_normalizer= describe a loss_fn you pass; the model's own loss is "
            "verified against its logits instead (torchspan.runtime.modelloss). Drop them, or pass "
            "loss_fn=..."
        )
    if (
        inputs.get("num_items_in_batch") is not None
    ):  # transformers' contract: each chunk's loss is its sum / that
        return (
            inputs,
            inputs["labels"],
            LossSpec(MODEL_LOSS, f"{ModelLoss.name} over num_items_in_batch", "sum"),
        )
    return inputs, inputs["labels"], LossSpec(MODEL_LOSS, ModelLoss.name, "model")


# ---------------------------------------------------------------------- candidates


def shifted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """What a causal LM's token mean divides by: labels after the first position that are not ignored."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def tokens(labels: torch.Tensor) -> torch.Tensor:
    """What a token mean (masked LM, seq2seq, token/sequence classification) divides by: labels not
    ignored."""
    return (labels != IGNORE_INDEX).sum()


def samples(labels: torch.Tensor) -> int:
    """What a per-sample (or per-element) mean divides by, in proportion: the chunk's rows."""
    return int(labels.shape[0]) if labels.dim() else 1


def _causal(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    if labels.dim() < 2 or logits.dim() != labels.dim() + 1 or logits.shape[:-1] != labels.shape:
        return None
    return F.cross_entropy(
        logits[..., :-1, :].float().flatten(0, -2),
        labels[..., 1:].flatten().to(logits.device),
        ignore_index=IGNORE_INDEX,
    )


def _token(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    if labels.is_floating_point() or logits.shape[:-1] != labels.shape:
        return None
    return F.cross_entropy(
        logits.float().flatten(0, -2), labels.flatten().to(logits.device), ignore_index=IGNORE_INDEX
    )


def _regression(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    if not labels.is_floating_point() or logits.numel() != labels.numel():
        return None
    return F.mse_loss(logits.float().reshape(-1), labels.float().reshape(-1).to(logits.device))


def _multilabel(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    if not labels.is_floating_point() or logits.shape != labels.shape:
        return None
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float().to(logits.device))


# (name, the model's loss recomputed from logits, what its mean divides by), in the order they are tried
CANDIDATES: list[
    tuple[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None], Callable[[torch.Tensor], Any]]
] = [
    ("a causal-LM token mean (labels shifted by one)", _causal, shifted_tokens),
    ("a token mean over labels != -100", _token, tokens),
    ("a per-sample mean squared error", _regression, samples),
    ("a per-element binary cross-entropy", _multilabel, samples),
]


def same_value(a: float, b: float) -> bool:
    """Whether two losses agree to float32 rounding (both NaN counts as agreeing: a chunk of padding only)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= 1e-4 * max(abs(a), abs(b)) + 1e-6


def verify(
    spec: LossSpec, outputs: Sequence[Any], targets: Sequence[Any], items: float | None = None
) -> LossSpec:
    """``spec`` with the normalizer the model's own loss divides by: the candidate that reproduces
    ``output.loss`` from ``output.logits`` on every chunk. ``ValueError`` (before any backward) when none
    does. ``items``: the ``num_items_in_batch`` the model was given (transformers' contract: each chunk's loss
    is its sum over that count), so a candidate's mean is scaled by its count over ``items`` before
    comparing."""
    if spec.kind != "model":
        return spec
    seen: list[tuple[float, list[float | None]]] = []
    with torch.no_grad():
        for out, labels in zip(outputs, targets):
            loss, logits = own_loss(out), _logits(out)
            if loss is None or logits is None or not isinstance(labels, torch.Tensor):
                raise ValueError(_unverifiable(out, loss, logits))
            values = [_counted(fn(logits, labels), norm(labels), items) for _, fn, norm in CANDIDATES]
            seen.append((float(loss), [None if v is None else float(v) for v in values]))
    for i, (name, _, normalizer) in enumerate(CANDIDATES):
        if all(vals[i] is not None and same_value(own, vals[i]) for own, vals in seen):  # type: ignore[arg-type]
            return dataclasses.replace(spec, user_normalizer=normalizer, name=f"{ModelLoss.name} ({name})")
    own, vals = seen[0]
    tried = (
        ", ".join(f"{n}: {v:.6g}" for (n, _, _), v in zip(CANDIDATES, vals) if v is not None)
        or "none applies to these labels"
    )
    raise ValueError(
        f"torchspan cannot weigh the model's own loss exactly over a split batch: on a chunk the model's "
        f"output.loss is {own:.6g}, but recomputed from its logits and labels it is not a mean torchspan "
        f"can split ({tried}). An auxiliary loss added to it (e.g. an MoE router's load-balancing loss: "
        "output_router_logits=True with router_aux_loss_coef > 0) does not add up over micro-batches or "
        "shards. Train with microbatches=1 in one process, turn the auxiliary loss off, or pass "
        "train_step(batch, target, loss_fn) with your own loss"
    )


def _counted(mean: torch.Tensor | None, count: Any, items: float | None) -> torch.Tensor | None:
    """A candidate's mean as the model returns it: given ``num_items_in_batch``, its sum over that count."""
    if mean is None or items is None:
        return mean
    return mean * (float(count) / items) if float(count) else torch.zeros_like(mean)


def combiner(kwargs: Mapping[str, Any], outs: Sequence[Any], total: int, device: torch.device) -> Any:
    """``combine(chunk losses)`` for a forward split into micro-batches and given ``labels``: the whole
    batch's loss, each chunk weighed by its share of the model's normalizer (verified against the logits);
    with ``num_items_in_batch`` (transformers' Trainer) each chunk's loss is already its sum over that count,
    so the chunks add up. ``None`` where there is nothing to combine."""
    labels = kwargs.get("labels")
    if labels is None or len(outs) < 2 or any(own_loss(o) is None for o in outs):
        return None
    sizes = split_sizes(total, len(outs))
    chunks = split_value(labels, len(outs), total, name="labels")
    items = kwargs.get("num_items_in_batch")
    items = None if items is None else float(items)
    spec = verify(LossSpec(MODEL_LOSS, ModelLoss.name, "model"), outs, chunks, items)
    weights = [1.0] * len(outs) if items is not None else spec.weights(chunks, sizes)

    def combine(losses: list[torch.Tensor]) -> torch.Tensor:
        return sum(
            (part.to(device) * w for part, w in zip(losses, weights) if w != 0.0),
            torch.zeros((), device=device),
        )

    return combine


def _unverifiable(out: Any, loss: Any, logits: Any) -> str:
    missing = "a loss" if loss is None else "logits"
    return (
        f"train_step(batch) uses the model's own loss over a split batch, which torchspan checks against "
        f"the model's logits; the model returned {type(out).__name__} without {missing}. Return a "
        "ModelOutput with loss and logits (transformers models do), or pass train_step(batch, target, "
        "loss_fn)"
    )

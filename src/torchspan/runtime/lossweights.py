"""The loss contract: weights that make per-chunk losses add up to the full-batch loss, exactly.

A ``reduction="mean"`` loss divides by a normalizer. For most losses it is the number of samples
(or elements, the same share since every sample has the same shape), so chunk ``i`` weighs
``n_i / N``. For ``CrossEntropyLoss`` / ``NLLLoss`` with class weights or ignored targets
(``ignore_index``, e.g. padding in a language model) it is the sum of the class weights of the
non-ignored targets, so a chunk weighs ``W_i / W``; a ``reduction="sum"`` loss weighs 1 per chunk.
``loss_spec`` reads which from the loss itself: loss modules, ``torch.nn.functional`` losses and
``functools.partial`` of either, whatever their keyword arguments. Any other callable is *opaque*
(``spec.kind == "opaque"``) until the user declares ``loss_reduction=`` / ``loss_normalizer=`` or
``torchspan.runtime.losscheck`` calibrates it on a batch.

Usage::

    spec = loss_spec(loss_fn, loss_reduction=None, loss_normalizer=None)
    weights = spec.weights(target_chunks, sizes)            # or total=all-reduced normalizer sum
    loss = weighted_loss(loss_fn, out, target, weights[i])
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import types
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LossSpec",
    "loss_spec",
    "describe_loss",
    "resolve_reduction",
    "microbatch_weights",
    "weighted_loss",
    "is_torch_loss",
    "class_weight_sum",
    "legacy_reduction",
    "TORCH_LOSSES",
]

Kind = Literal["sum", "samples", "class_weights", "user", "model", "opaque"]

_MEAN_LIKE = ("mean", "batchmean")

# Two-argument (input, target) losses whose mean divides by the number of samples or elements.
_SAMPLE_MEAN_FUNCTIONS = frozenset(
    {
        F.mse_loss,
        F.l1_loss,
        F.smooth_l1_loss,
        F.huber_loss,
        F.binary_cross_entropy,
        F.binary_cross_entropy_with_logits,
        F.kl_div,
        F.poisson_nll_loss,
        F.soft_margin_loss,
        F.multilabel_soft_margin_loss,
        F.multilabel_margin_loss,
        F.multi_margin_loss,
        F.hinge_embedding_loss,
    }
)
_CLASS_INDEX_FUNCTIONS = frozenset({F.cross_entropy, F.nll_loss})
# every torch.nn.functional loss whose normalizer torchspan reads (the loss modules call these)
TORCH_LOSSES = _SAMPLE_MEAN_FUNCTIONS | _CLASS_INDEX_FUNCTIONS
_SAMPLE_MEAN_MODULES = (
    nn.MSELoss,
    nn.L1Loss,
    nn.SmoothL1Loss,
    nn.HuberLoss,
    nn.BCELoss,
    nn.BCEWithLogitsLoss,
    nn.KLDivLoss,
    nn.PoissonNLLLoss,
    nn.SoftMarginLoss,
    nn.MultiLabelSoftMarginLoss,
    nn.MultiLabelMarginLoss,
    nn.MultiMarginLoss,
    nn.HingeEmbeddingLoss,
)
_CLASS_INDEX_MODULES = (nn.CrossEntropyLoss, nn.NLLLoss)


@dataclasses.dataclass(frozen=True, eq=False)
class LossSpec:
    """What one ``loss_fn`` divides by, so chunk losses can be weighted into the full-batch loss.

    ``kind``: ``"sum"`` (weight 1 per chunk), ``"samples"`` (mean over samples or elements),
    ``"class_weights"`` (``CrossEntropyLoss``/``NLLLoss``: class weights of non-ignored targets),
    ``"user"`` (``loss_normalizer(target)``), ``"model"`` (the model's own ``output.loss``, its normalizer
    ``user_normalizer`` found by ``modelloss.verify``) or ``"opaque"`` (not known: calibrate first).
    ``declared`` says the kind came from the user's ``loss_reduction=`` rather than the loss.
    """

    loss_fn: Callable[..., Any] = dataclasses.field(repr=False)
    name: str
    kind: Kind
    class_weight: torch.Tensor | None = dataclasses.field(default=None, repr=False)
    ignore_index: int = -100
    user_normalizer: Callable[[Any], Any] | None = dataclasses.field(default=None, repr=False)
    declared: bool = False

    @property
    def reduction(self) -> str | None:
        """``"sum"``, ``"mean"``, or ``None`` while the loss is opaque."""
        return None if self.kind == "opaque" else "sum" if self.kind == "sum" else "mean"

    @property
    def needs_check(self) -> bool:
        """True when only a calibration on a batch can make the weights exact (or verify a user
        normalizer)."""
        return self.kind in ("opaque", "user", "model") or self.declared

    def resolved(self, kind: Kind) -> LossSpec:
        """This spec with ``kind`` decided (by a calibration)."""
        return dataclasses.replace(self, kind=kind)

    def normalizer(self, target: Any, size: int) -> float:
        """The quantity this loss's mean divides by for one chunk of ``size`` samples with ``target``.

        The sample count for ``"samples"`` and ``"sum"`` (a sum's weights are 1 whatever it is:
        use ``weights``, not a ratio of normalizers), the class-weight sum of non-ignored targets for
        ``"class_weights"``, ``float(loss_normalizer(target))`` for ``"user"``.
        """
        if self.kind == "opaque":
            raise ValueError(self._opaque_message())
        if self.kind == "class_weights":
            found = _class_weight_sum(target, self.class_weight, self.ignore_index)
            return float(size) if found is None else found
        if self.kind in ("user", "model"):
            if self.user_normalizer is None:  # a model's own loss before modelloss.verify
                raise ValueError(self._opaque_message())
            return _user_value(self.user_normalizer, target)
        return float(size)

    def weights(
        self, targets: Sequence[Any], sizes: Sequence[int], total: float | None = None
    ) -> list[float]:
        """The factor for each chunk's loss so that their sum is the full-batch loss.

        ``total``: the full batch's normalizer when these chunks are only part of it (data-parallel
        ranks pass the all-reduced sum of ``normalizer``); by default the sum over these chunks. A
        chunk whose normalizer is 0 weighs exactly 0 (``weighted_loss`` then adds 0, never NaN).
        """
        if len(targets) != len(sizes):
            raise ValueError(
                f"targets has {len(targets)} chunk(s) but sizes has {len(sizes)}; give one target per chunk"
            )
        if self.kind == "sum":
            return [1.0] * len(sizes)
        if self.kind == "model" and self.user_normalizer is None and len(sizes) == 1 and total is None:
            return [1.0]  # the whole batch in one chunk: the model's own loss is the loss
        parts = [self.normalizer(t, n) for t, n in zip(targets, sizes)]
        whole = sum(parts) if total is None else float(total)
        if not math.isfinite(whole) or whole < 0:
            raise ValueError(
                f"total={total!r} is not a finite normalizer >= 0; pass the sum of spec.normalizer over "
                "the full batch"
            )
        if whole == 0:
            # every target of the batch ignored: the full-batch mean is 0/0 = nan on one device, and here too
            n = sum(sizes)
            return [s / n for s in sizes]
        return [p / whole for p in parts]

    def _opaque_message(self) -> str:
        return (
            f"loss_fn={self.name} is opaque: torchspan cannot tell what its mean divides by. Calibrate it "
            "(torchspan.runtime.losscheck.calibrate) or declare loss_reduction='sum' / 'mean' or "
            "loss_normalizer=callable"
        )


def describe_loss(loss_fn: Callable[..., Any]) -> str:
    """A short readable name: ``CrossEntropyLoss(reduction='sum')``, ``partial(cross_entropy, ...)``,
    ``<lambda> at train.py:12``."""
    if isinstance(loss_fn, functools.partial):
        kw = ", ".join(f"{k}={_short(v)}" for k, v in loss_fn.keywords.items())
        inner = [describe_loss(loss_fn.func), *(_short(a) for a in loss_fn.args)]
        return f"partial({', '.join(inner + ([kw] if kw else []))})"
    if isinstance(loss_fn, nn.Module):
        reduction = getattr(loss_fn, "reduction", None)
        return (
            f"{type(loss_fn).__name__}(reduction={reduction!r})"
            if isinstance(reduction, str)
            else type(loss_fn).__name__
        )
    if isinstance(loss_fn, types.FunctionType):
        code = loss_fn.__code__
        where = (
            f" at {code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}"
            if loss_fn.__name__ == "<lambda>"
            else ""
        )
        return f"{loss_fn.__name__}{where}"
    return getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    return repr(value)


def loss_spec(
    loss_fn: Callable[..., Any],
    loss_reduction: str | None = None,
    loss_normalizer: Callable[[Any], Any] | None = None,
) -> LossSpec:
    """The ``LossSpec`` of ``loss_fn``: read from a known loss, declared by the user, or opaque.

    ``loss_reduction`` (``"mean"``/``"sum"``) declares an opaque loss's reduction and must agree
    with a known loss's own; ``loss_normalizer(target) -> number`` gives what a mean loss divides
    by for one chunk (e.g. ``lambda y: (y != -100).sum()`` for a token mean). Raises ``TypeError``
    for non-callables and ``ValueError`` for contradictions and losses that do not reduce.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn={loss_fn!r} is not callable; pass e.g. torch.nn.functional.mse_loss")
    if loss_reduction is not None and loss_reduction not in ("mean", "sum"):
        raise ValueError(
            f"loss_reduction={loss_reduction!r} is not one of 'mean', 'sum' (or None to read it from loss_fn)"
        )
    if loss_normalizer is not None and not callable(loss_normalizer):
        raise TypeError(
            f"loss_normalizer={loss_normalizer!r} is not callable; pass e.g. lambda y: (y != -100).sum()"
        )
    name = describe_loss(loss_fn)
    known = _known(loss_fn, name)
    if known is None:
        if loss_normalizer is not None:
            if loss_reduction == "sum":
                raise ValueError(
                    f"loss_reduction='sum' with loss_normalizer= for loss_fn={name}: a normalizer is what "
                    "a mean divides by; drop loss_normalizer for a summing loss, or loss_reduction for a mean"
                )
            return LossSpec(loss_fn, name, "user", user_normalizer=loss_normalizer, declared=True)
        if loss_reduction is None:
            return LossSpec(loss_fn, name, "opaque")
        return LossSpec(loss_fn, name, "sum" if loss_reduction == "sum" else "samples", declared=True)
    reduction, class_weight, ignore_index, class_index = known
    if reduction == "none":
        raise ValueError(
            f"loss_fn={name} returns one loss per element; train_step needs a scalar. Use reduction='mean' "
            "or 'sum', or wrap it: lambda out, y: loss_fn(out, y).mean()"
        )
    own = "sum" if reduction == "sum" else "mean" if reduction in _MEAN_LIKE else None
    if own is None:
        raise ValueError(f"loss_fn={name} has reduction={reduction!r}; use reduction='mean' or 'sum'")
    if loss_reduction is not None and loss_reduction != own:
        raise ValueError(
            f"loss_reduction={loss_reduction!r} contradicts loss_fn={name}; drop loss_reduction (torchspan "
            f"reads it from the loss) or pass loss_reduction={own!r}"
        )
    if own == "sum":
        if loss_normalizer is not None:
            raise ValueError(
                f"loss_normalizer= given for loss_fn={name}, which sums: a sum divides by nothing; drop "
                "loss_normalizer"
            )
        return LossSpec(loss_fn, name, "sum")
    if loss_normalizer is not None:
        return LossSpec(loss_fn, name, "user", user_normalizer=loss_normalizer, declared=True)
    if class_index:
        return LossSpec(loss_fn, name, "class_weights", class_weight=class_weight, ignore_index=ignore_index)
    return LossSpec(loss_fn, name, "samples")


def is_torch_loss(loss_fn: Callable[..., Any]) -> bool:
    """Whether ``loss_fn`` is one of torch's own losses (a loss module with torch's ``forward``, a
    ``torch.nn.functional`` loss, a ``functools.partial`` of either with keywords only): it reads its
    arguments (and its own class weights) and nothing else."""
    return _known(loss_fn, "") is not None


def _known(loss_fn: Callable[..., Any], name: str) -> tuple[str, torch.Tensor | None, int, bool] | None:
    """(reduction, class weights, ignore_index, divides by class weights) of a loss torch defines; None if
    opaque."""
    if isinstance(loss_fn, functools.partial):
        if loss_fn.args:
            return None  # positional arguments bound: not the (input, target) call torch documents
        if not loss_fn.keywords:
            return _known(loss_fn.func, name)
        if loss_fn.func not in TORCH_LOSSES:
            return None
        return _functional(loss_fn.func, dict(loss_fn.keywords))
    if isinstance(loss_fn, nn.Module):
        if not isinstance(loss_fn, _SAMPLE_MEAN_MODULES + _CLASS_INDEX_MODULES):
            return None
        if type(loss_fn).forward is not _torch_forward(type(loss_fn)):
            return None  # a subclass with its own forward may divide by anything
        if isinstance(loss_fn, _CLASS_INDEX_MODULES):
            return loss_fn.reduction, loss_fn.weight, loss_fn.ignore_index, True
        return loss_fn.reduction, None, -100, False
    if loss_fn in TORCH_LOSSES:
        return _functional(loss_fn, {})
    return None


def _torch_forward(cls: type) -> Any:
    """The ``forward`` of the nearest torch loss class ``cls`` derives from."""
    for base in cls.__mro__:
        if base in _SAMPLE_MEAN_MODULES or base in _CLASS_INDEX_MODULES:
            return base.forward
    return None


def _functional(
    fn: Callable[..., Any], keywords: dict[str, Any]
) -> tuple[str, torch.Tensor | None, int, bool]:
    reduction = keywords.get("reduction", "mean")
    if "size_average" in keywords or "reduce" in keywords:  # torch's deprecated spelling of the reduction
        reduction = torch.nn._reduction.legacy_get_string(
            keywords.get("size_average"), keywords.get("reduce"), emit_warning=False
        )
    if fn in _CLASS_INDEX_FUNCTIONS:
        return reduction, keywords.get("weight"), int(keywords.get("ignore_index", -100)), True
    return reduction, None, -100, False


def _class_weight_sum(target: Any, weight: torch.Tensor | None, ignore_index: int) -> float | None:
    """Sum of class weights over the non-ignored class-index targets; None for probability targets."""
    if not isinstance(target, torch.Tensor) or target.is_floating_point():
        return None  # probability targets: the mean is over samples
    keep = target != ignore_index
    if weight is None:
        return float(keep.sum())
    picked = target[keep]
    return float(weight.detach().to(picked.device)[picked].sum()) if picked.numel() else 0.0


def class_weight_sum(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int) -> float:
    """What ``CrossEntropyLoss``/``NLLLoss``'s mean divides by for class-index ``target``: the class weights
    of the targets that are not ``ignore_index`` (their count without weights)."""
    found = _class_weight_sum(target, weight, ignore_index)
    return float(target.numel()) if found is None else found


def legacy_reduction(kwargs: dict[str, Any], default: str = "mean") -> str:
    """The reduction a torch loss call's keywords ask for, torch's deprecated ``size_average``/``reduce``
    included."""
    if kwargs.get("size_average") is not None or kwargs.get("reduce") is not None:
        return torch.nn._reduction.legacy_get_string(
            kwargs.get("size_average"), kwargs.get("reduce"), emit_warning=False
        )
    return kwargs.get("reduction") or default


def _user_value(fn: Callable[[Any], Any], target: Any) -> float:
    value = fn(target)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"loss_normalizer returned a tensor of shape {tuple(value.shape)}; it must return one "
                "number per chunk, e.g. lambda y: (y != -100).sum()"
            )
        value = value.item()
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            f"loss_normalizer returned {value!r}; it must return a finite number >= 0 (what the loss's "
            "mean divides by for this target), e.g. lambda y: (y != -100).sum()"
        )
    return float(value)


# ---------------------------------------------------------------------- earlier names, kept for callers


def resolve_reduction(loss_fn: Callable[..., Any], loss_reduction: str | None) -> str:
    """``"mean"`` or ``"sum"``: ``loss_spec(...).reduction``, with ``"mean"`` for opaque callables."""
    return loss_spec(loss_fn, loss_reduction).reduction or "mean"


def microbatch_weights(
    loss_fn: Callable[..., Any], targets: Sequence[Any], sizes: Sequence[int], reduction: str
) -> list[float]:
    """``loss_spec(loss_fn, reduction).weights(targets, sizes)``: the reduction as declared, never
    calibrated."""
    return loss_spec(loss_fn, reduction).weights(targets, sizes)


def weighted_loss(
    loss_fn: Callable[..., Any],
    out: Any,
    target: Any,
    weight: float,
    calling: contextlib.AbstractContextManager[Any] | None = None,
) -> torch.Tensor:
    """``loss_fn(out, target) * weight``; a zero-weight chunk (all targets ignored) adds exactly 0.

    (Its own mean would be 0/0 = nan, and nan * 0 is still nan.) Raises ``ValueError`` when
    ``loss_fn`` does not return a scalar. ``calling``: a context around the call of ``loss_fn`` alone.
    """
    leaves = torch.utils._pytree.tree_leaves(out)
    if out is None or isinstance(out, (bool, int, float, complex)):
        raise ValueError(
            "the model's forward returned "
            f"{'None' if out is None else f'a {type(out).__name__} ({_short(out)})'}, which holds no "
            "tensor, so there is nothing to compute the loss from and no graph to run backward through: "
            "return the outputs as tensors (e.g. logits), not None or a Python number"
        )
    if weight == 0.0:
        # outputs only: a model's own 0-d loss of such a chunk is nan (0/0), and nan * 0 is nan
        outputs = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0]
        if outputs:
            return sum(t.sum() for t in outputs) * 0.0  # keeps the graph so backward still runs
    if calling is None:
        loss = loss_fn(out, target)
    else:
        with calling:
            loss = loss_fn(out, target)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else f"a {type(loss).__name__}"
        )
        raise ValueError(
            f"loss_fn={describe_loss(loss_fn)} returned {got}; it must return a scalar (use "
            "reduction='mean' or 'sum')"
        )
    return loss * weight

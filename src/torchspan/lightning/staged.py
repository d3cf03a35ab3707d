"""A pipeline across ranks under Lightning: the step run where the loss is applied, its gradients at
``backward``.

``Runner.loss`` is what a torch loss applied to a ``Deferred`` output (``lightning.deferred``) returns: it
runs ``spanned.train_step(inputs, target, criterion)`` on every rank of the pipeline (the micro-batches by the
schedule, each weighed by its exact share of the global batch's loss, as ``train_step`` weighs them), keeps
the gradients it made aside, and returns the global batch's loss as a tensor whose backward adds them,
scaled by what reached it: Lightning's ``loss / accumulate_grad_batches`` and a precision plugin's scale are
honoured as on one device, a loss that never reaches ``backward`` adds nothing. The criterion is the torch
loss module of the function applied, its arguments the ones given, with the recorded shape changes and the
target's rows (``y.flatten()`` of ``(B, T)`` labels) put back around it by a forward pre-hook.

Checkpoints: each rank holds its stage's weights and optimizer state; ``gathered_state`` /
``gathered_optimizer_state`` put every stage's into one state dict on every rank (what Lightning writes
from rank 0), ``local_optimizer_state`` keeps a rank's part of it when resuming.

Usage (``SpanStrategy`` does this)::

    runner = Runner(spanned)
    out = deferred_outputs(spanned.module, (x,), {}, runner)
    loss = F.cross_entropy(out, y)          # the pipeline's step; loss.backward() adds its gradients
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from ..runtime.lossweights import legacy_reduction
from ..runtime.microbatch import split_sizes
from .deferred import Deferred, refuse, replay

__all__ = ["Runner", "defer_training", "gathered_state", "gathered_optimizer_state", "local_optimizer_state"]

_MODULES: dict[Any, type[nn.Module]] = {
    F.cross_entropy: nn.CrossEntropyLoss,
    F.nll_loss: nn.NLLLoss,
    F.mse_loss: nn.MSELoss,
    F.l1_loss: nn.L1Loss,
    F.smooth_l1_loss: nn.SmoothL1Loss,
    F.huber_loss: nn.HuberLoss,
    F.binary_cross_entropy: nn.BCELoss,
    F.binary_cross_entropy_with_logits: nn.BCEWithLogitsLoss,
    F.kl_div: nn.KLDivLoss,
    F.poisson_nll_loss: nn.PoissonNLLLoss,
    F.soft_margin_loss: nn.SoftMarginLoss,
    F.multilabel_soft_margin_loss: nn.MultiLabelSoftMarginLoss,
    F.multilabel_margin_loss: nn.MultiLabelMarginLoss,
    F.multi_margin_loss: nn.MultiMarginLoss,
    F.hinge_embedding_loss: nn.HingeEmbeddingLoss,
}


class _Stashed(torch.autograd.Function):
    """The step's loss value; its backward adds the step's gradients times what reached the loss."""

    @staticmethod
    def forward(
        ctx: Any, value: torch.Tensor, grads: list[torch.Tensor | None], *params: torch.Tensor
    ) -> torch.Tensor:
        ctx.grads = grads
        return value.clone()

    @staticmethod
    def backward(ctx: Any, scale: torch.Tensor) -> Any:
        grads = [None if g is None else g * scale.to(g.dtype) for g in ctx.grads]
        ctx.grads = []
        return (None, None, *grads)


class Runner:
    """Runs the pipeline's training step for a loss applied to a deferred output (see the module
    docstring)."""

    def __init__(self, spanned: Any) -> None:
        self.spanned = spanned
        self.device = torch.device(spanned.devices[-1])

    def loss(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """``func(output, target, ...)``: the step run, the global batch's loss returned (with its
        gradients)."""
        try:
            bound = inspect.signature(func).bind(*args, **kwargs).arguments
        except TypeError as exc:
            raise refuse(f"{func.__name__} was called with arguments torchspan cannot read ({exc})") from None
        out, target = bound.pop("input", None), bound.pop("target", None)
        if not isinstance(out, Deferred) or any(
            isinstance(t, Deferred) for t in tree_leaves((target, bound))
        ):
            raise refuse(
                f"{func.__name__} compares two of the pipeline's outputs, or takes one as its target"
            )
        reduction = legacy_reduction(bound, default="mean")
        if reduction not in ("mean", "sum", "batchmean"):
            raise refuse(
                f"{func.__name__}(..., reduction={reduction!r}) returns a loss per element, reduced by "
                "code torchspan cannot read"
            )
        bound.pop("size_average", None), bound.pop("reduce", None)
        try:
            criterion = _MODULES[func](**{**bound, "reduction": reduction})
        except TypeError as exc:
            raise refuse(
                f"{func.__name__} was called with arguments its loss module does not take ({exc})"
            ) from None
        rows_target, k = _rows(out, target, func.__name__)
        if out._chain or k > 1:
            _check_rows(out, k, self.spanned.microbatches, func.__name__)
        criterion.register_forward_pre_hook(_around(out, k))
        call = out._call
        if call.args and call.kwargs:
            raise refuse(
                "the spanned model was called with positional and keyword arguments together; pass one kind"
            )
        return self._step(call.args if call.args else call.kwargs, rows_target, criterion, out.dtype)

    def own_loss(self, call: Any) -> torch.Tensor:
        """The step on the model's own loss (``model(**batch).loss``; ``call``: that forward, keyword
        arguments with ``labels``), exact as ``spanned.train_step(batch)`` is; the global batch's loss."""
        if call.args:
            raise refuse(
                "the model's own loss of a forward called with positional arguments; call it with keywords, "
                "model(**batch) with labels in the batch"
            )
        return self._step(call.kwargs, None, None, call.metas[call.own_loss].dtype)

    def _step(
        self, inputs: Any, target: torch.Tensor | None, criterion: nn.Module | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """The pipeline's step (``criterion`` None: the model's own loss), its gradients kept aside for the
        returned loss's backward."""
        params = [p for p in self.spanned.module.parameters() if p.requires_grad and p.device.type != "meta"]
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            value = self.spanned.train_step(inputs, target, criterion)  # None, None: the model's own loss
            grads = [None if p.grad is None else p.grad.as_subclass(torch.Tensor) for p in params]
        finally:
            for p, g in zip(params, earlier):
                p.grad = g
        value = value.detach().to(self.device, dtype if dtype.is_floating_point else value.dtype)
        if not params:  # a stage with nothing to train: Lightning's backward reaches nothing here
            return value.requires_grad_()
        return _Stashed.apply(value, grads, *params)


def _rows(out: Deferred, target: Any, name: str) -> tuple[torch.Tensor, int]:
    """The target cut by the batch's rows (``(B * k, ...)`` as ``(B, k, ...)``) and ``k``."""
    rows = out._call.rows
    if not isinstance(target, torch.Tensor) or target.dim() == 0:
        raise refuse(
            f"{name}'s target is {type(target).__name__}, not a tensor with the batch's {rows} rows on dim 0"
        )
    k, rest = divmod(int(target.shape[0]), rows)
    if rest or k == 0:
        raise refuse(
            f"{name}'s target has {target.shape[0]} rows on dim 0, not a multiple of the batch's {rows}"
        )
    return (target if k == 1 else target.reshape(rows, k, *target.shape[1:])), k


def _around(out: Deferred, k: int) -> Any:
    """The criterion's forward pre-hook: the micro-batch's output through the recorded changes, its target's
    rows joined."""
    leaf, chain = out._leaf, out._chain

    def hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        output, target = args[0], args[1]
        output = replay(chain, tree_leaves(output)[leaf])
        return (output, target if k == 1 else target.reshape(-1, *target.shape[2:]), *args[2:])

    return hook


def _check_rows(out: Deferred, k: int, microbatches: int, name: str) -> None:
    """The recorded changes keep rows apart (each row of the result from one row of the output, ``k`` per row,
    in order) for the batch and for every micro-batch size: else a micro-batch's loss would not be its
    rows'."""
    meta = out._call.metas[out._leaf]
    rows = out._call.rows
    if meta.dim() == 0 or meta.shape[0] != rows:
        raise refuse(f"{name} is applied to an output of shape {tuple(meta.shape)}, not {rows} rows on dim 0")
    for size in sorted({rows, *split_sizes(rows, min(microbatches, rows))}):
        ids = torch.arange(size).view(size, *[1] * (meta.dim() - 1)).expand(size, *meta.shape[1:])
        try:
            got = replay(out._chain, ids, shape_only=True)
        except RuntimeError:
            got = replay(out._chain, ids.contiguous(), shape_only=True)
        want = torch.arange(size).repeat_interleave(k)
        if (
            got.dim() == 0
            or got.shape[0] != size * k
            or not bool((got.reshape(size * k, -1) == want[:, None]).all())
        ):
            raise refuse(
                f"the shape changes before {name} mix the batch's rows (a micro-batch of {size} rows would "
                "not give its own rows' losses); keep the batch on dim 0, e.g. out.flatten(0, 1) with "
                "y.flatten()"
            )


# ---------------------------------------------------------------------- checkpoints


def _gather(mine: Any) -> list[Any]:
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return parts


def _real(value: Any) -> bool:
    return not (isinstance(value, torch.Tensor) and value.device.type == "meta")


def gathered_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a LightningModule's, other stages' entries ``meta``) with every stage's values, on every
    rank: a collective over the job."""
    mine = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items() if _real(v)}
    full: dict[str, Any] = {}
    for part in _gather(mine):
        for key, value in part.items():
            full.setdefault(key, value)
    missing = [k for k in state if k not in full]
    if missing:
        raise RuntimeError(f"no rank of the pipeline holds {missing[:3]}: the stages do not cover the model")
    return {k: full[k] for k in state}


def _local_indices(optimizer: torch.optim.Optimizer) -> set[int]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {i for i, p in enumerate(params) if p.device.type != "meta"}


def gathered_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict with every stage's parameters' state (each rank steps its own): a
    collective."""
    state = optimizer.state_dict()
    local = _local_indices(optimizer)
    mine = {
        i: tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, s)
        for i, s in state["state"].items()
        if i in local
    }
    merged: dict[int, Any] = {}
    for part in _gather(mine):
        for i, s in part.items():
            merged.setdefault(i, s)
    return {"state": dict(sorted(merged.items())), "param_groups": state["param_groups"]}


def local_optimizer_state(optimizer: torch.optim.Optimizer, full: dict[str, Any]) -> None:
    """Load this rank's part of a gathered optimizer state (its stage's parameters)."""
    local = _local_indices(optimizer)
    optimizer.load_state_dict(
        {
            "state": {i: s for i, s in full["state"].items() if i in local},
            "param_groups": full["param_groups"],
        }
    )


def defer_training(spanned: Any) -> None:
    """``spanned``'s training forward (module in training mode, gradients on) returns deferred outputs whose
    loss runs the step; evaluation (``eval()`` or ``no_grad``) runs the pipeline's forward as it is."""
    from .deferred import deferred_outputs

    runner = Runner(spanned)
    plain = spanned.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if spanned.module.training and torch.is_grad_enabled():
            return deferred_outputs(spanned.module, args, kwargs, runner)
        return plain(*args, **kwargs)

    spanned.forward = forward

"""Gradient norms and clipping, exact for every strategy: ``Spanned.clip_grad_norm_``.

``torch.nn.utils.clip_grad_norm_`` takes one norm over the gradients it is given. In one process
(stages on several devices, or a data-parallel replica whose ``.grad`` already holds the summed
gradient) that is every gradient of the model, so torch's call is right there. On a rank of a
pipeline it sees this stage's gradients only and clips each stage by its own norm.

``clip_grad_norm_`` here gives what torch gives on one device with the whole model:

- every process takes the per-tensor norms of the gradients it counts (a parameter tied across
  stages counts on the lowest stage holding it; replicas hold the same gradients, so the norms
  are summed over one replica's pipeline only) and puts each in its slot of the model's parameter
  order; across ranks one all-reduce of ``2 x len(named parameters)`` float64 values (norms and
  "present" flags) gives every rank all of them;
- the total is ``torch.linalg.vector_norm`` of that list stacked in the order one device stacks it
  (grouped by dtype, model order within), so the same number for any ``norm_type`` (``inf``: the
  max), and ``error_if_nonfinite`` raises as torch does, on every rank;
- every gradient this process holds (tied copies included) is scaled by
  ``min(max_norm / (total + 1e-6), 1)``, as torch scales them.
- a sharded replica's gradients are ``DTensor`` shards (FSDP2): each rank takes its shards' norms, one
  all-reduce over the shard group combines them per parameter in float64 (``sum of norm ** p``, then the
  root; ``max``/``min`` for ``inf``/``-inf``), and each rank scales its own shards. With CPU offload the
  shards live on the CPU; the all-reduce runs on the group's device (pytorch#148532's crash does not arise).

``guard_plain_clip(ranks)`` (after each training step of a pipeline rank) makes torch's own
``torch.nn.utils.clip_grad_norm_`` (and ``get_total_norm``) over that rank's gradients raise ``RuntimeError``
naming ``spanned.clip_grad_norm_``, before it scales anything, without replacing anything in ``torch``:
each gradient the rank holds becomes a ``_StageGradient`` (its class swapped in place; every op on it runs
as on the plain tensor, ``clip_grad_value_`` and the optimizer included) whose ``__torch_function__`` refuses
an op called from torch's total-norm function. Other tensors, and other models' clips, never pass through it.

Usage::

    loss = spanned.train_step(x, y, loss_fn)
    norm = spanned.clip_grad_norm_(1.0)     # = clip_grad_norm_(model.parameters(), 1.0) on one device
    optimizer.step()
"""

from __future__ import annotations

import copy
import math
import sys
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

__all__ = ["Holding", "clip_grad_norm", "guard_plain_clip", "holding", "total_norm"]


@dataclass
class Holding:
    """What this process holds of a model's gradients.

    ``local``: its trainable parameters (scaled by a clip); ``counted``: ids of those whose norms
    count here (``None``: all); ``across``: whether the norms are summed over ``group`` (a pipeline's
    ranks; ``None`` is the default group), through tensors on ``comm``; ``device``: where a rank's total
    lives.
    """

    module: nn.Module
    local: list[nn.Parameter]
    counted: set[int] | None = None
    across: bool = False
    group: Any = None
    comm: torch.device = torch.device("cpu")
    device: torch.device = torch.device("cpu")


def holding(module: nn.Module, executor: Any) -> Holding:
    """This process's ``Holding`` for ``module`` run by ``executor`` (a pipeline rank holds a
    ``RankStage``)."""
    ranks = getattr(executor, "ranks", None)
    if ranks is not None and ranks.mesh.stages > 1:
        counted = {id(p) for p in ranks.norm_parameters()}
        return Holding(
            module, ranks.local_parameters(), counted, True, ranks.pipe_group, ranks.comm, ranks.device
        )
    local = [p for p in module.parameters() if p.requires_grad and p.device.type != "meta"]
    return Holding(module, local)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard (a sharded replica's gradient), else ``t`` itself (shares storage: scaling
    it scales ``t``)."""
    return t.to_local() if isinstance(t, DTensor) else _plain(t)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A marked plain gradient as a plain alias (same storage) for the foreach kernels; any other tensor as it
    is."""
    return t.as_subclass(torch.Tensor) if type(t) is _StageTensor else t


def _tensor_norms(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> list[torch.Tensor]:
    """Each gradient's ``norm_type``-norm, computed per (device, dtype) group as torch computes it; a sharded
    gradient (a ``DTensor``) is the norm of its shards' norms across the ranks holding them
    (``_sharded_norms``)."""
    norms: list[Any] = [None] * len(grads)
    if not grads:
        return norms
    sharded = [
        i for i, g in enumerate(grads) if isinstance(g, DTensor) and any(p.is_shard() for p in g.placements)
    ]
    if sharded:
        return _sharded_norms(grads, sharded, norm_type, foreach)
    grouped = _group_tensors_by_device_and_dtype([grads], with_indices=True)  # type: ignore[list-item]
    for (device, _), ([tensors], indices) in grouped.items():
        if (foreach is None and _has_foreach_support(tensors, device)) or (
            foreach and _device_has_foreach_support(device)
        ):
            values = list(torch._foreach_norm(tensors, norm_type))
        elif foreach:
            raise RuntimeError(
                f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
            )
        else:
            values = [torch.linalg.vector_norm(g, norm_type) for g in tensors]
        for i, v in zip(indices, values):
            norms[i] = v
    return norms


def _sharded_norms(
    grads: list[torch.Tensor], sharded: list[int], norm_type: float, foreach: bool | None
) -> list[torch.Tensor]:
    """Norms of gradients some of which are ``DTensor`` shards: each rank's shard norms, combined in float64
    by an all-reduce over each dimension of the shards' mesh (a sum of ``norm ** p``, a max for ``inf``, a min
    for ``-inf``, a sum for 0; a term held on a ``Replicate`` dimension divided by its copies), per mesh."""
    local = [_local(g) for g in grads]
    present = [i for i, t in enumerate(local) if t.numel() > 0]
    found = _tensor_norms([local[i] for i in present], norm_type, foreach) if present else []
    inf = math.isinf(norm_type)
    neutral = (
        (float("inf") if norm_type < 0 else 0.0) if inf else 0.0
    )  # an empty shard: the identity of the combination
    values = [torch.tensor(neutral, dtype=torch.float64)] * len(grads)
    for i, n in zip(present, found):
        values[i] = n.detach().to("cpu", torch.float64)
    out = [values[i].to(local[i].device, local[i].dtype) for i in range(len(grads))]
    meshes: dict[Any, list[int]] = {}  # FSDP2 over tp: 2-D DTensors beside 1-D ones (a whole tied layer)
    for i in sharded:
        meshes.setdefault(grads[i].device_mesh, []).append(i)  # type: ignore[attr-defined]
    for mesh, held in meshes.items():
        comm = (
            torch.device(mesh.device_type, torch.cuda.current_device())
            if mesh.device_type == "cuda"
            else torch.device(mesh.device_type)
        )
        buf = torch.stack([values[i] for i in held]).to(comm)
        if not inf:  # a copy on each of r ranks of a Replicate mesh dimension counts once: its term / r
            copies = [
                math.prod(mesh.size(d) for d, p in enumerate(grads[i].placements) if p.is_replicate())
                for i in held
            ]  # type: ignore[attr-defined]
            buf = (buf.pow(norm_type) if norm_type != 0 else buf) / torch.tensor(
                copies, dtype=buf.dtype, device=comm
            )
        op = (dist.ReduceOp.MIN if norm_type < 0 else dist.ReduceOp.MAX) if inf else dist.ReduceOp.SUM
        for d in range(mesh.ndim):  # over every mesh dimension: the sum (or max) over all its ranks
            dist.all_reduce(buf, op=op, group=mesh.get_group(d))
        if not inf and norm_type != 0:
            buf = buf.pow(1.0 / norm_type)
        for j, i in enumerate(held):
            out[i] = buf[j].to(local[i].device, local[i].dtype)
    return out


def _slots(module: nn.Module) -> tuple[list[torch.dtype], dict[int, int]]:
    """Every named parameter's dtype (duplicates included: the same list on every rank) and, per
    parameter object, the slot of its first name (where one device's ``parameters()`` yields it)."""
    dtypes: list[torch.dtype] = []
    slot: dict[int, int] = {}
    for i, (_, p) in enumerate(module.named_parameters(remove_duplicate=False)):
        dtypes.append(p.dtype)
        slot.setdefault(id(p), i)
    return dtypes, slot


def _stacked(
    order: Sequence[int], dtypes: Sequence[torch.dtype], value: Any, device: torch.device
) -> torch.Tensor:
    """Norms of the ``order`` slots stacked as one device stacks them: by dtype (first seen first), slot order
    within."""
    groups: dict[torch.dtype, list[int]] = {}
    for s in order:
        groups.setdefault(dtypes[s], []).append(s)
    return torch.stack([value(s).to(device, dt) for dt, slots in groups.items() for s in slots])


def total_norm(
    h: Holding, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None
) -> torch.Tensor:
    """The norm of every gradient of the model (counted once), as one device's ``get_total_norm``;
    across ranks a collective: every rank of the job calls it."""
    norm_type = float(norm_type)
    dtypes, slot = _slots(h.module)
    params = [p for p in h.local if p.grad is not None and (h.counted is None or id(p) in h.counted)]
    norms = _tensor_norms([_plain(p.grad) for p in params], norm_type, foreach)  # type: ignore[misc]
    if h.across:
        buf = torch.zeros(2, len(dtypes), dtype=torch.float64, device=h.comm)
        if params:
            where = torch.tensor([slot[id(p)] for p in params], device=h.comm)
            buf[0, where] = torch.stack([n.to(h.comm, torch.float64) for n in norms])
            buf[1, where] = 1.0
        dist.all_reduce(buf, group=h.group)
        present = buf[1].nonzero().flatten().tolist()
        if not present:
            return torch.tensor(0.0, device=h.device)
        total = torch.linalg.vector_norm(_stacked(present, dtypes, lambda s: buf[0, s], h.device), norm_type)
    else:
        if not params:
            return torch.tensor(0.0)
        by_slot = {slot[id(p)]: n for p, n in zip(params, norms)}
        total = torch.linalg.vector_norm(
            _stacked(sorted(by_slot), dtypes, by_slot.__getitem__, params[0].grad.device), norm_type
        )  # type: ignore[union-attr]
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise _nonfinite_error(norm_type)
    return total


def _nonfinite_error(norm_type: float) -> RuntimeError:
    return RuntimeError(
        f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
        "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
        "`error_if_nonfinite=False`"
    )


def _scale_grads(
    params: Iterable[nn.Parameter], max_norm: float, total: torch.Tensor, foreach: bool | None
) -> None:
    """``grad *= min(max_norm / (total + 1e-6), 1)`` for every gradient, as ``clip_grads_with_norm_``."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for (device, _), ([tensors], _) in _group_tensors_by_device_and_dtype([grads]).items():  # type: ignore[list-item]
        if (foreach is None and _has_foreach_support(tensors, device)) or (
            foreach and _device_has_foreach_support(device)
        ):
            torch._foreach_mul_(tensors, coef.to(device))
        elif foreach:
            raise RuntimeError(
                f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
            )
        else:
            for g in tensors:
                g.mul_(coef.to(device))


def clip_grad_norm(
    h: Holding,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    overflowed: bool = False,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole model's gradients (see the module docstring).

    ``overflowed``: an fp16 step whose gradients overflowed was dropped (``.grad`` is None until the
    optimizer's skipped step): the norm is ``inf``, as torch's clip after ``unscale_`` would find."""
    with torch.no_grad():
        if overflowed:
            if error_if_nonfinite:
                raise _nonfinite_error(float(norm_type))
            return torch.tensor(float("inf"), device=h.device if h.across else None)
        total = total_norm(h, norm_type, error_if_nonfinite, foreach)
        _scale_grads(h.local, max_norm, total, foreach)
        return total


# ---------------------------------------------------------------------- torch's own clip on a pipeline rank
_GUARDED: weakref.WeakSet[Any] = weakref.WeakSet()  # RankStages of pipelines: their gradients are one stage's
_TOTAL_NORM = frozenset(
    {"_get_total_norm", "clip_grad_norm_"}
)  # torch's functions taking a clip's total norm (2nd: torch < 2.6)


def _in_torch_total_norm(frame: Any) -> bool:
    """Whether ``frame`` (the Python caller of a torch op) is torch's own total norm, ``get_total_norm`` /
    ``clip_grad_norm_`` in ``torch.nn.utils.clip_grad`` (a comprehension inside it counts as it, Python <
    3.12)."""
    while frame is not None and frame.f_code.co_name.startswith("<"):
        frame = frame.f_back
    return (
        frame is not None
        and frame.f_code.co_name in _TOTAL_NORM
        and frame.f_globals.get("__name__") == "torch.nn.utils.clip_grad"
    )


def _refusal(args: Sequence[Any]) -> RuntimeError:
    """The ``RuntimeError`` for torch's own norm over a pipeline rank's gradients (``args``: the torch
    op's)."""
    touched = {
        id(t)
        for a in args
        for t in (a if isinstance(a, (list, tuple)) else [a])
        if isinstance(t, _StageGradient)
    }
    where, stages = "this rank", "one stage"
    for ranks in list(_GUARDED):
        if any(id(p.grad) in touched for p in ranks.local_parameters() if p.grad is not None):
            where, stages = (
                f"rank {ranks.info.rank}",
                f"stage {ranks.stage} of a {ranks.mesh.stages}-stage pipeline",
            )
    return RuntimeError(
        f"torch.nn.utils.clip_grad_norm_ on {where} sees only the gradients of {stages}, so it would clip "
        "each stage by its own norm and the update would differ from one device's. Call "
        "spanned.clip_grad_norm_(max_norm, norm_type) instead: the same arguments and return value, the "
        "norm taken over every stage's gradients (nothing was clipped)"
    )


class _StageGradient:
    """A pipeline rank's gradient (``guard_plain_clip`` swaps the class of that tensor object, nothing else):
    every torch op on it runs as on the plain tensor, results plain, except one called by torch's own total
    norm, which raises (``_refusal``). Copies and pickles are the plain class (they load without
    torchspan)."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        if _in_torch_total_norm(sys._getframe(1)):
            raise _refusal(args)
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})

    def _unmarked(self) -> Any:
        """The same gradient as its plain class (an alias: same storage)."""
        return self.as_subclass(torch.Tensor) if type(self) is _StageTensor else self.detach()  # type: ignore[attr-defined]

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._unmarked().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        memo[id(self)] = copied = copy.deepcopy(self._unmarked(), memo)
        return copied

    def __repr__(self, **kwargs: Any) -> str:
        return self._unmarked().__repr__(**kwargs)


class _StageTensor(_StageGradient, torch.Tensor):
    __slots__ = ()


class _StageDTensor(_StageGradient, DTensor):  # a sharded stage's gradient (FSDP2)
    __slots__ = ()


_MARKED: dict[type, type] = {
    torch.Tensor: _StageTensor,
    DTensor: _StageDTensor,
}  # the gradients a stage holds


def guard_plain_clip(ranks: Any) -> None:
    """After a training step: ``torch.nn.utils.clip_grad_norm_`` (or ``get_total_norm``) over ``ranks``'
    gradients (a ``RankStage``'s) raises, naming ``spanned.clip_grad_norm_``, before it scales anything.

    Each gradient this rank holds gets the class ``_StageGradient`` (its ``__torch_function__`` sees torch's
    own total norm calling it); nothing in ``torch`` is replaced, other tensors and other models are
    untouched."""
    _GUARDED.add(ranks)
    for p in ranks.local_parameters():
        marked = _MARKED.get(type(p.grad))
        if marked is not None:
            p.grad.__class__ = marked

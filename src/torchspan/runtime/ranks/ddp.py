"""The data-parallel replica's engine when it is not sharded: DistributedDataParallel, reducing by DDP's own
C++ path.

``DataParallelReplica`` (``ranks.dataparallel``) writes the loss contract once; what reduces the gradients
is its engine: ``DDPEngine`` here, or ``ShardedEngine`` (``ranks.sharded``, FSDP2). DDP divides each gradient
bucket by the world size ``W`` as it copies it in, all-reduces it, and leaves ``.grad`` as views into the
buckets; the replica backpropagates its weighted loss times ``W`` (``grad_scale``), so the buckets hold the
sum of every rank's weighted gradient: one device's gradient of the global batch. Gradients accumulated in
``.grad`` over earlier calls are the same on every rank, so DDP's mean keeps them: accumulation over calls
costs what raw DDP's plain ``backward()`` each call costs, less the copy back (``benchmarks/distributed.py``).
The step's loss rides in the first bucket as the gradient of one scalar ``carrier`` parameter (no all-reduce
of its own).

Usage (``DataParallelReplica`` does this)::

    engine = DDPEngine(module, device, group, bucket_cap_mb=25.0, find_unused_parameters=False,
                       sync_buffers=True)
    engine.fresh()             # a step starts: the carrier holds no loss
    out = engine(x)            # a training forward through DDP
    # .grad: every rank's gradient summed
    engine.carrying(loss, loss).backward(torch.tensor(engine.grad_scale))
    total = engine.loss_of()   # every rank's loss summed
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map

from ..layercall import autocast_for

__all__ = ["DDPEngine"]


def _sum_hook(engine: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook of ``DDPEngine(by_sum=True)``: all-reduce a gradient bucket by SUM (no bucket is
    divided)."""
    work = dist.all_reduce(bucket.buffer(), group=engine.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP checks the hook's annotations as objects; ``from __future__ import annotations`` made them strings.
_sum_hook.__annotations__.update(bucket=dist.GradBucket, engine=Any)
_sum_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


class _GradTimes(torch.autograd.Function):
    """The identity on ``t``; backward multiplies its gradient by ``factor`` and gives ``carrier`` a zero
    gradient (a replica's outputs for a backward the user runs: DDP divides the all-reduced sum by the world
    size, so the outputs' gradients are multiplied by it, and the carrier, which DDP expects a gradient for,
    gets one that adds nothing)."""

    @staticmethod
    def forward(ctx: Any, factor: float, carrier: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
        ctx.factor, ctx.carrier = factor, (carrier.dtype, carrier.device) if carrier is not None else None
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None, torch.Tensor]:
        zero = (
            torch.zeros((), dtype=ctx.carrier[0], device=ctx.carrier[1]) if ctx.carrier is not None else None
        )
        return None, zero, grad * ctx.factor


class _CarryLoss(torch.autograd.Function):
    """``carrier * value`` whose backward gives ``carrier`` the gradient ``value`` times the incoming one.
    ``value`` is kept on ``ctx``, not saved for backward, so the saved-activation meter does not count the
    loss as an activation (a step that saves nothing else, an empty shard's, reports none)."""

    @staticmethod
    def forward(ctx: Any, carrier: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx.value = value
        return carrier.detach() * value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.value, None


class _Carried(nn.Module):
    """What DDP wraps: the model and one scalar parameter, ``carrier``, whose gradient carries the step's loss
    through DDP's first bucket (its ``.grad`` after a step: the ranks' weighted losses summed), so no
    all-reduce of its own."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.model = module
        self.carrier = nn.Parameter(torch.zeros((), dtype=dtype, device=device))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)


def _buffer_option(sync: bool) -> dict[str, bool]:
    """DDP's per-forward buffer sync flag under its name in this PyTorch (renamed in 2.13)."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": sync}
    return {"broadcast_buffers": sync}


class DDPEngine:
    """The replica's engine when it is not sharded: ``DistributedDataParallel`` (which broadcasts rank 0's
    parameters and buffers at construction) with DDP's own C++ reduction: each bucket is divided by the world
    size ``W`` as it is copied in, then all-reduced, and every backward the replica runs is of its loss times
    ``W`` (``grad_scale``), so the buckets sum the ranks' weighted gradients. Gradients accumulated over calls
    stay in ``.grad``, the same on every rank: DDP's mean keeps them and adds this call's sum, so no gradient
    is set aside. ``.grad`` tensors are views into DDP's buckets (``gradient_as_bucket_view``: nothing is
    copied back; a reference to an old ``.grad`` kept across ``zero_grad()`` sees the next step's values, as
    with DDP's option).

    The step's loss rides in the buckets too: DDP wraps the model with one scalar parameter, ``carrier``, and
    each backward adds ``carrier * loss.detach()``, so ``carrier.grad`` ends as the ranks' weighted losses
    summed (``loss_of``) and the loss needs no all-reduce of its own (no carrier with
    ``find_unused_parameters``, which would find it unused, or parameters of another dtype than
    float32/float64).

    ``by_sum=True`` (fp16, where a loss times ``W`` would overflow sooner than one device's and skip other
    steps): a SUM comm hook, ``grad_scale`` 1, ``.grad`` its own tensors, and ``sets_aside``: the replica sets
    earlier gradients aside during a backward (DDP would reduce them again) and adds them back.

    An engine (this, or ``ShardedEngine`` in ``ranks.sharded``) gives the replica: ``engine(*args)`` (a
    training forward), ``inference`` (under ``no_grad``), ``no_sync()`` (backwards inside accumulate
    unreduced), ``autocast``, ``train(mode)``, ``state_dict``/``load_state_dict`` and ``collective_forward``
    (whether every forward is a collective); ``grad_scale``, ``sets_aside``, ``carrier`` and ``summing``
    (``ShardedEngine``: FSDP2 adds each call's reduce-scattered shard to ``.grad`` itself: scale 1, nothing
    set aside, no carrier, outputs as they are)."""

    collective_forward = False  # under no_grad the plain module runs: no collective

    def __init__(
        self, module: nn.Module, device: torch.device, group: Any, by_sum: bool = False, **ddp: Any
    ) -> None:
        module.to(device)
        self.module, self.group = module, group
        ids = [device.index] if device.type == "cuda" else None
        sync = ddp.pop("sync_buffers")
        dtype = next((p.dtype for p in module.parameters() if p.requires_grad), None)
        self.carrier: nn.Parameter | None = None
        wrapped: nn.Module = module
        if not by_sum and not ddp.get("find_unused_parameters") and dtype in (torch.float32, torch.float64):
            wrapped = _Carried(module, dtype, device)  # type: ignore[arg-type]
            self.carrier = wrapped.carrier
        self.ddp = DistributedDataParallel(
            wrapped,
            device_ids=ids,
            process_group=group,
            gradient_as_bucket_view=not by_sum,
            **ddp,
            **_buffer_option(sync),
        )
        self.sets_aside = by_sum
        self.grad_scale = (
            1.0 if by_sum else float(dist.get_world_size(group))
        )  # DDP divides each bucket by the group's size
        if by_sum:
            self.ddp.register_comm_hook(self, _sum_hook)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)

    def carrying(self, scaled: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """What to backpropagate for ``scaled`` (the loss, or a scaler's scaling of it): plus ``carrier *
        loss`` (the value only) with a carrier, so its gradient collects the loss."""
        if self.carrier is None:
            return scaled
        return scaled + _CarryLoss.apply(self.carrier, loss.detach().to(self.carrier.dtype))

    def fresh(self) -> None:
        """Before a step's first backward: the carrier starts from no gradient (it holds one step's loss
        only)."""
        if self.carrier is not None:
            self.carrier.grad = None

    def loss_of(self) -> torch.Tensor:
        """After a step: its loss, the ranks' weighted losses summed (a copy: the carrier's gradient is a
        bucket view)."""
        assert self.carrier is not None and self.carrier.grad is not None
        return self.carrier.grad.detach().clone()

    def summing(self, out: Any) -> Any:
        """``out`` (a forward's outputs) for a backward the user runs: gradients multiplied by ``W`` on the
        way in, so DDP's mean is the sum of every rank's loss gradient (and the carrier gets a zero
        gradient)."""
        if self.grad_scale == 1.0 and self.carrier is None:
            return out
        c = self.carrier
        return tree_map(
            lambda t: (
                _GradTimes.apply(self.grad_scale, c, t)
                if isinstance(t, torch.Tensor) and t.requires_grad
                else t
            ),
            out,
        )

    def inference(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return self.ddp.no_sync()

    def autocast(self, device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
        return autocast_for(device, precision)

    def train(self, mode: bool) -> None:
        self.ddp.train(mode)

    def state_dict(self, *, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict)

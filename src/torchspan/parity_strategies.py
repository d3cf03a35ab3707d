"""The strategies ``torchspan.parity_ranks.compare_strategies`` can run: one training step each, as data.

``LOCAL`` holds the ones that run in the calling process (``single``, ``local-pipeline``); ``RANKED`` the
multi-process ones, each a :class:`RankStrategy` (its process count for an ``nproc``, and the step every rank
runs, module-level so that it pickles). A new strategy is one more entry (tests add theirs with
``monkeypatch.setitem``).

Usage::

    RANKED["dp"].processes(2, StepOptions())      # -> 2
    loss = LOCAL["single"](model, x, y, F.mse_loss, StepOptions())
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .runtime.ranks import shard_batch

__all__ = ["LOCAL", "RANKED", "RankStep", "RankStrategy", "StepOptions", "forward"]


@dataclass(frozen=True)
class StepOptions:
    """How the pipelined strategies cut and run the model; ``loss_reduction`` is passed to ``train_step``."""

    microbatches: int = 4
    schedule: str = "gpipe"
    recompute: str = "never"
    balance: tuple[int, ...] | None = None
    devices: tuple[str, ...] = ("cpu", "cpu")
    loss_reduction: str | None = None
    tp_plan: tuple[tuple[str, str], ...] | None = (
        None  # tensor parallel: (module pattern, style) pairs, else the model's
    )


# A step on one rank: (model with the initial weights, global inputs, global target, loss_fn, options,
# rank, world size) -> the loss; afterwards the parameters the rank holds (not meta) carry .grad.
RankStep = Callable[[nn.Module, Any, Any, Callable[..., Any], StepOptions, int, int], torch.Tensor]


@dataclass(frozen=True)
class RankStrategy:
    """A multi-process strategy: ``processes(nproc, options)`` is its process count (a ``ValueError`` stating
    the equation when ``nproc`` cannot host it) and ``step`` runs on every rank (module-level: it is
    pickled)."""

    processes: Callable[[int, StepOptions], int]
    step: RankStep
    backend: str = "gloo"  # the ranks' process group ("cpu:gloo,cuda:nccl" where a step computes on GPUs)


def forward(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple, else ``model(inputs)``."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


# ---------------------------------------------------------------------------------------- strategies
def _single(
    model: nn.Module, inputs: Any, target: Any, loss_fn: Callable[..., Any], opts: StepOptions
) -> torch.Tensor:
    loss = loss_fn(forward(model, inputs), target)
    loss.backward()
    return loss.detach()


def _local_pipeline(
    model: nn.Module, inputs: Any, target: Any, loss_fn: Callable[..., Any], opts: StepOptions
) -> torch.Tensor:
    from .runtime.build import span

    spanned = span(
        model,
        devices=list(opts.devices),
        balance=list(opts.balance) if opts.balance else None,
        microbatches=opts.microbatches,
        schedule=opts.schedule,
        recompute=opts.recompute,
    )
    return spanned.train_step(inputs, target, loss_fn, loss_reduction=opts.loss_reduction)


def _dp_processes(nproc: int, opts: StepOptions) -> int:
    if nproc < 2:
        raise ValueError(
            f"dp and fsdp split the batch over processes: nproc={nproc} runs nothing data-parallel; pass "
            "--nproc-per-node 2 or more"
        )
    return nproc


def _dp_step(
    model: nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Callable[..., Any],
    opts: StepOptions,
    rank: int,
    world: int,
) -> torch.Tensor:
    from .runtime.build import span

    spanned = span(model)  # launched, one stage: an exact data-parallel replica
    xs, ts = shard_batch((inputs, target), rank, world)
    return spanned.train_step(xs, ts, loss_fn, loss_reduction=opts.loss_reduction)


def _fsdp_step(
    model: nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Callable[..., Any],
    opts: StepOptions,
    rank: int,
    world: int,
) -> torch.Tensor:
    from .runtime.build import span

    spanned = span(model, shard=True)  # launched, one stage: the replica sharded by FSDP2
    xs, ts = shard_batch((inputs, target), rank, world)
    return spanned.train_step(xs, ts, loss_fn, loss_reduction=opts.loss_reduction)


def _offload_processes(nproc: int, opts: StepOptions) -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        raise ValueError(
            "fsdp-offload needs a GPU: FSDP2's CPU offload keeps parameters, gradients and optimizer state "
            "in CPU memory and computes on the GPU, and this machine has none; compare fsdp instead"
        )
    if nproc > gpus:
        raise ValueError(
            f"fsdp-offload runs one process per GPU: --nproc-per-node {nproc} > {gpus} GPU(s); pass "
            f"--nproc-per-node {gpus}"
        )
    return nproc


def _offload_step(
    model: nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Callable[..., Any],
    opts: StepOptions,
    rank: int,
    world: int,
) -> torch.Tensor:
    from .runtime.build import span

    spanned = span(model, shard=True, offload="cpu")  # pragma: no cover - needs a GPU
    xs, ts = shard_batch((inputs, target), rank, world)
    return spanned.train_step(xs, ts, loss_fn, loss_reduction=opts.loss_reduction)


def _pipeline_processes(nproc: int, opts: StepOptions) -> int:
    stages = len(opts.balance) if opts.balance else nproc
    if nproc < 2:
        raise ValueError(
            f"rank-pipeline needs a stage per process: nproc={nproc} pipelines nothing; pass "
            "--nproc-per-node 2 or more"
        )
    if stages != nproc:
        raise ValueError(
            f"rank-pipeline runs one stage per process: pp({stages}) != nproc({nproc}); "
            f"give --balance with {nproc} entries or --nproc-per-node {stages}"
        )
    return nproc


def _hybrid_shape(nproc: int, opts: StepOptions) -> tuple[int, int]:
    """``(dp, pp)`` of the hybrid mesh: ``pp = len(balance)`` (default 2), ``dp = nproc // pp`` (at least
    2)."""
    pp = len(opts.balance) if opts.balance else 2
    dp = max(2, nproc // pp)
    if dp * pp != nproc:
        raise ValueError(
            f"hybrid needs {dp * pp} processes ({pp} stages x {dp} replicas): dp({dp}) * pp({pp}) != "
            f"nproc({nproc}); pass --nproc-per-node {dp * pp}"
        )
    return dp, pp


def _hybrid_processes(nproc: int, opts: StepOptions) -> int:
    dp, pp = _hybrid_shape(nproc, opts)
    return dp * pp


def _span_ranked(model: nn.Module, stages: int, opts: StepOptions) -> Any:
    from .runtime.build import span

    return span(
        model,
        devices=["cpu"] * stages,
        balance=list(opts.balance) if opts.balance else None,
        microbatches=opts.microbatches,
        schedule=opts.schedule,
        recompute=opts.recompute,
    )


def _pipeline_step(
    model: nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Callable[..., Any],
    opts: StepOptions,
    rank: int,
    world: int,
) -> torch.Tensor:
    spanned = _span_ranked(model, world, opts)
    return spanned.train_step(inputs, target, loss_fn, loss_reduction=opts.loss_reduction)


def _hybrid_step(
    model: nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Callable[..., Any],
    opts: StepOptions,
    rank: int,
    world: int,
) -> torch.Tensor:
    dp, pp = _hybrid_shape(world, opts)
    spanned = _span_ranked(model, pp, opts)
    xs, ts = shard_batch((inputs, target), rank // pp, dp)  # rank = replica * pp + stage (Mesh)
    return spanned.train_step(xs, ts, loss_fn, loss_reduction=opts.loss_reduction)


def _tp_processes(nproc: int, opts: StepOptions) -> int:
    if nproc < 2:
        raise ValueError(
            f"tp splits each layer over processes: nproc={nproc} splits nothing; pass --nproc-per-node 2 "
            "or more"
        )
    return nproc


def _tp_fsdp_processes(nproc: int, opts: StepOptions) -> int:
    if nproc < 4 or nproc % 2:
        raise ValueError(
            f"tp-fsdp is dp_shard(nproc / 2) x tp(2): nproc={nproc} must be 4 or another even count >= 4"
        )
    return nproc


def _tp_step(
    model: nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Callable[..., Any],
    opts: StepOptions,
    rank: int,
    world: int,
) -> torch.Tensor:
    from .runtime.build import span

    spanned = span(
        model, tp=world, tp_plan=dict(opts.tp_plan) if opts.tp_plan else None
    )  # every rank the whole batch
    return spanned.train_step(inputs, target, loss_fn, loss_reduction=opts.loss_reduction)


def _tp_fsdp_step(
    model: nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Callable[..., Any],
    opts: StepOptions,
    rank: int,
    world: int,
) -> torch.Tensor:
    from .runtime.build import span

    spanned = span(model, tp=2, shard=True, tp_plan=dict(opts.tp_plan) if opts.tp_plan else None)
    xs, ts = shard_batch((inputs, target), *spanned.data_parallel)  # a tp pair shares its replica's rows
    return spanned.train_step(xs, ts, loss_fn, loss_reduction=opts.loss_reduction)


LocalStep = Callable[[nn.Module, Any, Any, Callable[..., Any], StepOptions], torch.Tensor]
LOCAL: dict[str, LocalStep] = {"single": _single, "local-pipeline": _local_pipeline}
RANKED: dict[str, RankStrategy] = {
    "dp": RankStrategy(_dp_processes, _dp_step),
    "rank-pipeline": RankStrategy(_pipeline_processes, _pipeline_step),
    "hybrid": RankStrategy(_hybrid_processes, _hybrid_step),
    "fsdp": RankStrategy(_dp_processes, _fsdp_step),
    "fsdp-offload": RankStrategy(_offload_processes, _offload_step, backend="cpu:gloo,cuda:nccl"),
    "tp": RankStrategy(_tp_processes, _tp_step),
    "tp-fsdp": RankStrategy(_tp_fsdp_processes, _tp_fsdp_step),
}

"""Which executor runs a span: the one place that knows every executor.

In one process: ``PipelinedExecutor`` (stage functions of an ``nn.Sequential`` or an fx split),
``OwnForwardExecutor`` (the model's own forward, micro-batches pipelined by threads) or, where
threads cannot pipeline, ``SerialExecutor``. In a launched job: ``ReplicaExecutor`` (one stage:
an exact data-parallel replica per rank, DDP or sharded by FSDP2), ``RankPipelineExecutor`` (stage functions, one stage per
rank) or ``RankOwnForwardExecutor`` (the model's own forward on every rank, its stage for real).

Usage (``span`` does this)::

    executor = choose(model, layout(model, plan, devices, balance), settings, recorder, meter, planned=False, even=True)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ..layers import discovery
from .executor import Executor, Settings
from .layout import Layout
from .local.pipelined import PipelinedExecutor
from .local.serial import SerialExecutor
from .local.threaded import OwnForwardExecutor
from .memory import ActivationMeter
from .ranks.ownforward import RankOwnForwardExecutor
from .ranks.pipelined import RankPipelineExecutor
from .ranks.replicated import ReplicaExecutor
from .record import Recorder

__all__ = ["choose", "replica"]


def replica(
    model: nn.Module, device: torch.device | None, settings: Settings, recorder: Recorder, meter: ActivationMeter, **sharding: Any
) -> Executor:
    """This rank's data-parallel replica of the whole model (a launched job with one stage); ``sharding``:
    ``shard``, ``reshard_after_forward``, ``offload`` (a sharded replica: FSDP2, ``ranks.sharded``)."""
    names = [n for n, _ in discovery.top_level_layers(model)]
    return ReplicaExecutor(model, names, settings, recorder, meter, device=device, **sharding)


def choose(
    model: nn.Module,
    lay: Layout,
    settings: Settings,
    recorder: Recorder,
    meter: ActivationMeter,
    *,
    planned: bool,
    even: bool,
    split_points: Any = None,
    no_split: Any = None,
    stacklevel: int = 2,
) -> Executor:
    """The executor for ``lay`` (``planned``: its groups come from a plan; ``even``: an even split
    the first call's recorded order may redo). ``stacklevel``: where a warning points (the caller's caller)."""
    options = dict(balance_given=not planned, layers=lay.layer_set, even=even, split_points=split_points, no_split=no_split)
    if lay.ranked is not None and lay.mode == "own-forward":  # the model's own forward on every rank, its stage for real
        return RankOwnForwardExecutor(model, lay.groups, settings, recorder, meter, *lay.ranked, **options)
    if lay.ranked is not None:
        return RankPipelineExecutor(model, lay.mode, lay.graph, lay.groups, settings, recorder, meter, *lay.ranked)
    if lay.mode != "own-forward":
        return PipelinedExecutor(model, lay.mode, lay.graph, lay.devices, lay.groups, settings, recorder, meter)
    unthreaded = OwnForwardExecutor.unsupported(lay.devices, settings.microbatches, settings.recompute)
    if not unthreaded:  # the model's own forward, one thread per micro-batch
        return OwnForwardExecutor(model, lay.devices, lay.groups, settings, recorder, meter, **options)
    if len(lay.devices) > 1:  # one stage has nothing to pipeline: nothing to warn about
        _warn_serial(lay.why, unthreaded, stacklevel + 1)
    return SerialExecutor(model, lay.devices, lay.groups, settings, recorder, meter, **options)


def _warn_serial(why: str, unthreaded: str, stacklevel: int) -> None:
    warnings.warn(
        f"torchspan: {why}; using hook placement (mode 'own-forward-serial'). Each layer lives on its device and "
        f"inputs are moved to it, but micro-batches run one after another (no pipelining): {unthreaded}.",
        UserWarning,
        stacklevel=stacklevel + 1,
    )

"""Which executor runs a span: the one place that knows every executor.

In one process: ``PipelinedExecutor`` (stage functions of an ``nn.Sequential`` or an fx split),
``OwnForwardExecutor`` (the model's own forward, micro-batches pipelined by threads) or, where
threads cannot pipeline, ``SerialExecutor``. In a launched job: ``ReplicaExecutor`` (one stage:
an exact data-parallel replica per rank, DDP or sharded by FSDP2), ``RankPipelineExecutor`` (stage functions,
one stage per rank) or ``RankOwnForwardExecutor`` (the model's own forward on every rank, its stage for real);
with ``shard`` and replicas, each stage sharded over its replicas (pipeline x sharded, ``ranks.stageshard``).

Usage (``span`` does this)::

    executor = choose(model, layout(model, plan, devices, balance), settings, recorder, meter,
                      planned=False, even=True)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from .. import schedule as sched
from ..layers import discovery
from .executor import Executor, Settings
from .layout import Layout
from .local.looped import looped_workers
from .local.pipelined import PipelinedExecutor
from .local.serial import SerialExecutor
from .local.threaded import OwnForwardExecutor
from .local.worker import worker_groups
from .memory import ActivationMeter
from .ranks.ownforward import RankOwnForwardExecutor
from .ranks.ownlooped import check_looped
from .ranks.pipelined import RankPipelineExecutor
from .ranks.replicated import ReplicaExecutor
from .ranks.tpstages import tp_pipeline_executor
from .record import Recorder

__all__ = ["check_pipeline_sharding", "choose", "replica"]


def _check_one_stage_per_worker(lay: Layout, settings: Settings, shard: Any = None) -> None:
    """The model's own forward with several stages per rank runs looped (``ranks.ownlooped``, which checks
    them); in one process, ``interleaved-1f1b`` needs the stages looped over the devices' workers."""
    workers = lay.ranked[0].stages if lay.ranked is not None else len(set(lay.devices))
    if lay.ranked is not None and len(lay.groups) > workers:  # several stages per rank: ranks.ownlooped
        check_looped(
            len(lay.groups),
            workers,
            settings.schedule,
            settings.recompute,
            bool(shard),
            settings.microbatches,
        )
    elif lay.ranked is None and settings.schedule == "interleaved-1f1b":
        _check_local_interleaved(lay, settings)


def _check_local_interleaved(lay: Layout, settings: Settings) -> None:
    """``ValueError`` unless the stages are looped over the workers (stage ``s`` on worker ``s % P``) and the
    micro-batches come in rounds of ``P``: the threads then take Megatron's turns per worker
    (``threaded``)."""
    n = len(lay.groups)
    p = looped_workers(worker_groups(lay.devices, per_stage=settings.workers == "stage"), n)
    if p is None:
        devices = [str(d) for d in lay.devices]
        distinct = list(dict.fromkeys(devices))
        fix = (
            f"pass devices={[distinct[s % len(distinct)] for s in range(n)]}"
            if n % len(distinct) == 0
            else "give each device the same number of stages"
        )
        raise ValueError(
            f"schedule='interleaved-1f1b' runs stage s on worker s % P (looped); devices={devices} do not "
            f"place the {n} stages so: {fix}, or use schedule='1f1b'"
        )
    sched.looped_ranks(settings.microbatches, n, p)


def replica(
    model: nn.Module,
    device: torch.device | None,
    settings: Settings,
    recorder: Recorder,
    meter: ActivationMeter,
    **sharding: Any,
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
    sharding: dict[str, Any] | None = None,
    weights: Any = None,
) -> Executor:
    """The executor for ``lay`` (``planned``: its groups come from a plan; ``even``: an even split
    the first call's recorded order may redo). ``stacklevel``: where a warning points (the caller's caller).
    ``sharding``: ``shard`` and ``reshard_after_forward`` for a pipeline across ranks
    (``check_pipeline_sharding``). ``weights``: a meta-built model's values, for a pipeline across ranks (each
    rank materializes its stage)."""
    options = dict(
        balance_given=not planned,
        layers=lay.layer_set,
        even=even,
        split_points=split_points,
        no_split=no_split,
    )
    shard = check_pipeline_sharding(lay, sharding)
    if lay.mode == "own-forward":
        _check_one_stage_per_worker(lay, settings, shard)
    if lay.ranked is not None and settings.tp is not None:  # a pipeline of tensor-parallel stages (3-D)
        return tp_pipeline_executor(model, lay, settings, recorder, meter, **options)
    if (
        lay.ranked is not None and lay.mode == "own-forward"
    ):  # the model's own forward on every rank, its stage for real
        return RankOwnForwardExecutor(
            model, lay.groups, settings, recorder, meter, *lay.ranked, **shard, weights=weights, **options
        )
    if lay.ranked is not None:
        return RankPipelineExecutor(
            model,
            lay.mode,
            lay.graph,
            lay.groups,
            settings,
            recorder,
            meter,
            *lay.ranked,
            **shard,
            weights=weights,
        )
    if lay.mode != "own-forward":
        return PipelinedExecutor(
            model, lay.mode, lay.graph, lay.devices, lay.groups, settings, recorder, meter
        )
    unthreaded = OwnForwardExecutor.unsupported(lay.devices, settings.microbatches, settings.recompute)
    if not unthreaded:  # the model's own forward, one thread per micro-batch
        return OwnForwardExecutor(model, lay.devices, lay.groups, settings, recorder, meter, **options)
    if len(lay.devices) > 1:  # one stage has nothing to pipeline: nothing to warn about
        _warn_serial(lay.why, unthreaded, stacklevel + 1)
    return SerialExecutor(model, lay.devices, lay.groups, settings, recorder, meter, **options)


def check_pipeline_sharding(lay: Layout, sharding: dict[str, Any] | None) -> dict[str, Any]:
    """The sharding keywords of a pipeline across ranks (``{}`` without ``shard``); ``ValueError`` where
    stages are not replicated across ranks (nothing to shard a stage over) or offload is asked with stages."""
    if not sharding or not sharding.get("shard"):
        return {}
    stages = len(lay.groups)
    if sharding.get("offload") is not None:
        raise ValueError(
            f"offload={sharding['offload']!r} with {stages} pipeline stages is not supported: offload "
            "shards one stage (span(model, shard=True, offload='cpu') without balance); pipeline x sharded "
            "keeps each stage's shards on its device"
        )
    if lay.ranked is None or lay.ranked[0].replicas == 1:
        where = (
            f"pp({stages}) x dp(1)" if lay.ranked is not None else f"{stages} pipeline stages in one process"
        )
        raise ValueError(
            f"shard=True with {where}: each stage is sharded over its data-parallel replicas, and here a "
            "stage has one rank; launch replicas x stages processes (e.g. torchspan launch --nproc-per-node "
            f"{2 * stages} for {stages} stages x 2 replicas), shard one stage (no balance), or pipeline "
            "without shard=True"
        )
    return {"shard": True, "reshard_after_forward": sharding.get("reshard_after_forward", True)}


def _warn_serial(why: str, unthreaded: str, stacklevel: int) -> None:
    warnings.warn(
        f"torchspan: {why}; using hook placement (mode 'own-forward-serial'). Each layer lives on its "
        "device and inputs are moved to it, but micro-batches run one after another (no pipelining): "
        f"{unthreaded}.",
        UserWarning,
        stacklevel=stacklevel + 1,
    )

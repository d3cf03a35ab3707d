"""``torchspan.plan``: profile a model on devices, then search the fastest placement that fits.

Usage::

    plan = torchspan.plan(model, torch.randn(32, 512), devices="cuda:0,cpu", memory={"cuda:0": "8GiB"})
    print(plan)                     # one row per stage, predicted step time, peak memory per device
    spanned = torchspan.span(model, plan)

**Strategies**: a cluster plan weighs replicas (DDP), sharded (FSDP2), sharded + offload (states in host
memory, the optimizer step on the CPU), pipeline, hybrid, pipeline x sharded and tensor parallel x sharded
with one cost model (``planner.strategies``, ``planner.sharded``); ``plan.comparison`` (printed as a table, in
``to_dict()``) has each one's predicted step, peak memory per device and whether it fits; the winner is the
plan (``plan.shard``, ``plan.offload``), which ``span(model, plan)`` runs on every rank of a job of
``plan.world_size`` processes. A one-process plan stays one; when nothing fits one process, sharded + offload
on its first accelerator (run by ``span(model, plan)`` in a process group of one) is planned when it fits.
``host_memory``: one node's host memory for offloaded states (default: this machine's free memory for present
devices, 3 x the node's accelerator memory for described ones). ``tp``: tensor-parallel degrees a cluster plan
prices (``planner.tensorparallel``: ``"auto"``, 2, 4 and 8 dividing the devices per node; an int fixes one, 1
prices none); ``plan.tp`` is the chosen one, run by ``span(model, plan)``
(``runtime.ranks.tensorparallel.planned``: on fewer ranks, shrunk).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..hardware import devices as find_devices
from ..hardware import parse_memory
from ..profiler.costs import LayerCost, Profile
from .cluster import cluster_search
from .errors import PlanError
from .optimize import search
from .plans import Plan
from .ties import TieCost
from .topology import Cluster

__all__ = ["plan", "recompute_alias"]


def plan(
    model: nn.Module,
    example_inputs: Any,
    devices: Any = "auto",
    memory: Mapping[str, int | float | str] | None = None,
    microbatches: int | str = "auto",
    schedule: str = "auto",
    recompute: str = "auto",
    optimizer: Any = "adam",
    *,
    dtype: torch.dtype | str | None = None,
    nodes: int | None = None,
    interconnect: str | None = None,
    intra_link: str | None = None,
    data_parallel: int | str = "auto",
    checkpoint: str | None = None,
    host_memory: int | float | str | None = None,
    tp: int | str = "auto",
) -> Plan:
    """The fastest placement of ``model``'s layers on ``devices`` within every memory budget.

    ``example_inputs``: one training batch (a tensor, a tuple of forward arguments, or a dict of
    keyword arguments such as ``{"input_ids": ids, "use_cache": False}``; dim 0 is the batch). The
    plan places ``torchspan.layers.model_layers`` (blocks by qualified name, e.g. ``transformer.h.3``),
    and ``span(model, plan)`` accepts it for the same model. ``devices``/``memory``: as ``torchspan.devices``
    (described devices such as ``"a100-40gb*2,cpu"`` are planned from FLOP estimates). ``microbatches`` (int
    or ``"auto"``), ``schedule`` (``"gpipe"``, ``"1f1b"``, ``"zero-bubble"``, ``"merged-weights"``,
    ``"auto"``: 1F1B or merged-weights, whichever is predicted faster within the budgets), ``recompute``
    (``"never"``, ``"except_last"``, ``"always"``, ``"auto"``; activation recompute): fix a setting or let the
    search choose. ``checkpoint=``: the old name of ``recompute=`` (a ``FutureWarning``).
    ``optimizer`` sizes optimizer state (e.g. ``"sgd"``, ``"adam"``).

    Raises ``PlanError`` (a ``ValueError``) when nothing fits, with needed vs available memory per
    device and checked ways to make it fit.

    Clusters: ``nodes=N`` machines each with ``devices`` (one node's list, e.g. ``"h100-80gb*8"``),
    ``interconnect`` between them and ``intra_link`` inside one (``hardware.links`` names: ``nvlink``,
    ``pcie4``, ``ib-400g``, ``eth-25g``, ...) give a data x pipeline plan (``planner.cluster``:
    ``plan.data_parallel``, ``plan.stage_ranks``, ``plan.predicted_times``). ``nodes`` of None or 1
    with no ``intra_link`` and ``data_parallel="auto"`` plans one process, as without them.

    Strategies, ``host_memory`` and ``tp``: see the module docstring.
    """
    from ..profiler.measure import profile

    recompute = recompute_alias(recompute, checkpoint, "auto")
    devs = find_devices(devices, memory)
    one_process = (
        (nodes is None or nodes == 1) and intra_link is None and data_parallel == "auto" and tp in ("auto", 1)
    )
    # the cluster is checked before the (slow) profile
    cluster = (
        None
        if one_process
        else Cluster.describe(devs, nodes or 1, intra=intra_link, interconnect=interconnect)
    )
    host = None if host_memory is None else parse_memory(host_memory, name="host_memory")
    prof = profile(model, example_inputs, devs, optimizer=optimizer, dtype=dtype)
    ties = tie_costs(model, [lay.name for lay in prof.layers])
    result = _search(prof, cluster, ties, host, microbatches, schedule, recompute, data_parallel, tp)
    if not result.ties:  # the searches record (and charge) the ties they were given
        record_ties(result, model)
    return result


def _search(
    prof: Profile,
    cluster: Cluster | None,
    ties: list[TieCost],
    host: float | None,
    microbatches: int | str,
    schedule: str,
    recompute: str,
    data_parallel: int | str,
    tp: int | str,
) -> Plan:
    """One process (``cluster`` None): ``search``, or sharded + offload when nothing else fits; else
    ``cluster_search``."""
    if cluster is None:
        try:
            result = search(
                prof, microbatches=microbatches, schedule=schedule, recompute=recompute, ties=ties
            )
        except PlanError as exc:
            offloaded = offload_one_process(prof, exc, ties, host, microbatches, schedule, recompute)
            if offloaded is None:
                raise
            result = offloaded
    else:
        result = cluster_search(
            prof,
            cluster,
            microbatches=microbatches,
            schedule=schedule,
            recompute=recompute,
            data_parallel=data_parallel,
            ties=ties,
            host_memory=host,
            tp=tp,
        )
    return result


def offload_one_process(
    prof: Profile,
    error: PlanError,
    ties: list[TieCost],
    host_memory: float | None,
    microbatches: int | str,
    schedule: str,
    recompute: str,
) -> Plan | None:
    """When nothing fits one process: sharded + offload on ``prof``'s first accelerator (world size 1: its
    states in host memory, only the gathered layers and activations on the device), or ``None`` when there is
    none or it does not fit either (the caller raises ``error``)."""
    first = next((d for d, dev in enumerate(prof.devices) if dev.kind not in ("cpu", "meta")), None)
    if first is None:
        return None
    one = dataclasses.replace(
        prof, devices=[prof.devices[first]], layers=[_only(lay, first) for lay in prof.layers]
    )
    try:
        result = cluster_search(
            one,
            Cluster.describe(one.devices, 1),
            microbatches=microbatches,
            schedule=schedule,
            recompute=recompute,
            data_parallel=1,
            ties=ties,
            host_memory=host_memory,
        )
    except (PlanError, ValueError):
        return None
    if not result.offload:
        return None
    summary = str(error).splitlines()[0]
    result.notes.insert(
        0,
        (
            f"nothing fits one process ({summary}); sharded + offload on {one.devices[0].device} does: "
            "span(model, plan) runs it in a process group of one (in a plain process, or torchspan launch "
            "--nproc-per-node 1 train.py)"
        ),
    )
    return result


def _only(lay: LayerCost, d: int) -> LayerCost:
    """``lay`` with the times of device ``d`` alone."""
    return dataclasses.replace(
        lay,
        forward_fixed=[lay.forward_fixed[d]],
        forward_per_sample=[lay.forward_per_sample[d]],
        backward_fixed=[lay.backward_fixed[d]],
        backward_per_sample=[lay.backward_per_sample[d]],
        time_source=[lay.time_source[d]] if lay.time_source else [],
    )


def recompute_alias(recompute: str, checkpoint: str | None, default: str) -> str:
    """``recompute``, or the value given under its old name ``checkpoint=`` (with a ``FutureWarning``).

    Usage: ``recompute = recompute_alias(recompute, checkpoint, "auto")``.
    """
    if checkpoint is None:
        return recompute
    warnings.warn(
        f"checkpoint= is now recompute= (activation recompute; 'checkpoint' names saved files); "
        f"pass recompute={checkpoint!r}",
        FutureWarning,
        stacklevel=3,
    )
    if recompute != default and recompute != checkpoint:
        raise ValueError(
            f"recompute={recompute!r} and checkpoint={checkpoint!r} disagree; checkpoint= is the old name of "
            "recompute=, pass recompute= alone"
        )
    return checkpoint


def tie_costs(model: nn.Module, layer_names: list[str]) -> list[TieCost]:
    """Each Parameter two or more of ``layer_names`` hold, as the cost models take it (structural ties
    only)."""
    names = sorted(layer_names, key=len, reverse=True)  # longest first: the finest layer holding a name
    order = {n: i for i, n in enumerate(layer_names)}
    groups: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for qualified, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), (param, []))[1].append(qualified)
    out = []
    for param, qualified in groups.values():
        held = {next((n for n in names if q == n or q.startswith(n + ".")), None) for q in qualified} - {None}
        if len(held) >= 2:
            out.append(
                TieCost(
                    qualified[0], tuple(sorted(order[n] for n in held)), param.numel() * param.element_size()
                )
            )  # type: ignore[index]
    return sorted(out, key=lambda t: (t.layers, t.name))


def record_ties(result: Plan, model: nn.Module) -> None:
    """Fill ``result.ties``: each Parameter that two or more of the plan's layers hold (GPT-2's
    ``transformer.wte.weight`` is ``lm_head.weight``), with those layers, their stages and its bytes; a tie
    split across stages also gets a note.

    Structural ties only (the same Parameter under several qualified names); the runtime finds the rest when
    built.
    """
    names = sorted(result.layers, key=len, reverse=True)  # longest first: the finest layer holding a name

    def layer_of(qualified: str) -> str | None:
        return next((n for n in names if qualified == n or qualified.startswith(n + ".")), None)

    order = {n: i for i, n in enumerate(result.layers)}
    groups: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for qualified, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), (param, []))[1].append(qualified)
    for param, qualified in groups.values():
        layers = sorted({lay for lay in map(layer_of, qualified) if lay is not None}, key=order.__getitem__)
        if len(layers) < 2:
            continue
        stages = sorted({i for i in map(result.stage_of, layers) if i is not None})
        nbytes = param.numel() * param.element_size()
        result.ties.append({"name": qualified[0], "layers": layers, "stages": stages, "bytes": nbytes})
        if len(stages) > 1:
            result.notes.append(
                f"tied parameter {qualified[0]} is used on stages {', '.join(map(str, stages))} "
                f"({', '.join(layers)}): span keeps a copy on each device and sums its gradients "
                f"({nbytes:,} bytes per copy); put those layers on one stage to avoid it"
            )

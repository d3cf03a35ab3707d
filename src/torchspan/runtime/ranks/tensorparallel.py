"""Tensor parallelism on DTensor: each layer's weights split over the ``tp`` ranks of a ``DeviceMesh``.

``span(model, tp=N)`` in a job of ``N`` processes applies
``torch.distributed.tensor.parallel.parallelize_module`` over a one-dimensional ``DeviceMesh`` named ``tp``
(``init_device_mesh``), by a plan:

- a transformers model's own ``config.base_model_tp_plan`` (its attention and MLP projections column- then
  row-wise: the heads and the MLP width split, one all-reduce after each block half), prefixed with the base
  model's name; the head stays whole on every rank, so the logits and the model's own loss are one device's;
- or ``tp_plan={"blocks.*.mlp.up": "colwise", ...}``: module-name patterns (``*`` matches one name) to torch's
  styles by name (``"colwise"``, ``"rowwise"``, ``"colwise_rep"`` (outputs gathered), ``"rowwise_rep"``,
  ``"sequence_parallel"``; transformers' ``"colwise_gather_output"`` and ``"rowwise_split_input"`` too) or
  ``ParallelStyle`` objects (used as given). A plan naming ``"sequence_parallel"`` norms runs them on sequence
  shards, its row-wise projections reduce-scattering into them and its column-wise ones gathering from them
  (``ranks.sequenceparallel``).

Every rank runs the same batch; the rest of the span (micro-batches, recompute, precision, the loss contract)
is the one-process runtime on this rank's device, whose collectives DTensor runs inside the layers. A
parameter tied to one outside its module (tied embeddings) keeps its module whole. Gradients are ``DTensor``
shards (``.full_tensor()`` is one device's); ``state_dict()`` gathers full tensors.

Usage (``span`` does this)::

    mesh = tp_mesh(2)                                   # DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",))
    parallelize(model, mesh, tp_plan=None)              # the model's own plan, or ValueError naming tp_plan=
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .env import init_distributed, rank_info
from .sequenceparallel import SEQUENCE_DIM, sequence_hooks

__all__ = [
    "tp_mesh",
    "parallelize",
    "tensor_parallel",
    "planned",
    "planned_stages",
    "tp_styles",
    "full_tensors",
    "STYLES",
]

STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "sequence_parallel")
ALIASES = {
    "colwise_gather_output": "colwise_rep",
    "rowwise_split_input": "rowwise_rep",
}  # transformers' names


def tp_mesh(tp: Any, shard: bool = False, given: Any = None) -> Any:
    """The job's ``DeviceMesh`` (``ranks.devicemesh``): ``("tp",)`` over every process, or with ``shard``
    ``("dp_shard", "tp")``, ``tp`` innermost (torchtitan's order: a node's neighbouring ranks split the
    layers), the degrees checked as one equation; ``given``: a user's ``span(mesh=)``, checked against
    them."""
    from .devicemesh import job_mesh

    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be an int >= 1 (the processes each layer is split over)")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    dp = world // tp if shard else 1
    fix = f"launch a multiple of {tp} processes" if shard else f"launch {tp} processes or pass shard=True"
    advice = (
        "tensor parallelism splits each layer over tp ranks, and only sharded replicas (shard=True) hold "
        f"the rest; {fix}"
    )
    degrees, keep = ({"dp_shard": dp, "tp": tp}, ("dp_shard", "tp")) if shard else ({"tp": tp}, ("tp",))
    return job_mesh(rank_info().device.type, degrees, keep=keep, given=given, advice=advice)


def tensor_parallel(
    model: nn.Module, tp: Any, tp_plan: Any, settings: Any, sharding: dict[str, Any], **others: Any
) -> list[Any] | None:
    """``span``'s ``tp=``: the job's mesh made (``settings.mesh``), ``model`` on this rank's device from rank
    0's weights, split over the ``tp`` dimension; with ``shard=True`` the replica is then sharded over
    ``dp_shard`` (``sharding["process_group"]``). Returns the devices the rest runs on. Refuses what does not
    compose yet."""
    from ..placement import parse_devices
    from .sharded import broadcast_module

    devices, plan = others.pop("devices", None), others.pop("plan", None)
    if plan is not None and plan.tp > 1:  # the planner's tensor parallel x sharded, on the launched world
        tp = planned(model, plan, tp, sharding)
    given = [k for k, v in {**others, "offload": sharding.get("offload")}.items() if v is not None]
    given += ["plan"] if plan is not None and plan.tp == 1 else []
    given += ["devices"] if devices is not None and len(parse_devices(devices)) > 1 else []
    if given:
        raise ValueError(
            f"span(model, tp={tp!r}) with {', '.join(given)}=: tensor parallelism composes with sharded "
            "replicas (shard=True), and a pipeline of tensor-parallel stages runs in a launched job with "
            "balance=/devices= and no plan (ranks.tpstages); offload and plans beside it are not built "
            "yet. Drop them, or drop tp="
        )
    init_distributed()
    mesh = settings.mesh = tp_mesh(tp, shard=bool(sharding["shard"]), given=settings.mesh)
    info = rank_info()
    model.to(info.device)
    broadcast_module(model, None, info.device if "nccl" in str(info.backend) else torch.device("cpu"))
    parallelize(model, mesh["tp"] if sharding["shard"] else mesh, tp_plan)
    if sharding["shard"]:
        sharding["process_group"] = mesh["dp_shard"]
    return [info.device]


def planned(model: nn.Module, plan: Any, tp: Any, sharding: dict[str, Any]) -> int:
    """``span(model, plan)`` for a plan with ``plan.tp > 1`` (``planner.tensorparallel``): the ``tp`` it runs
    on the launched world, ``sharding["shard"]`` set where replicas remain (FSDP2 over ``dp_shard``, as
    planned).

    On the plan's world: its ``tp x dp_shard``. On fewer ranks (a cluster's plan tried on 2-4 processes):
    "shrunk", ``tp = gcd(plan.tp, WORLD_SIZE)`` ranks per replica and sharded replicas over the rest, with a
    ``UserWarning`` (the gradients are one device's in any layout; the plan's predicted times and memory are
    its own world's). Refused: a ``tp=`` other than the plan's, several stages, layers the model lacks, ranks
    not tp-innermost, one process, a larger job, a world sharing no degree with ``plan.tp``."""
    import math
    import warnings

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    n, t, dp = plan.world_size, plan.tp, plan.data_parallel
    what = (
        f"plan.tp={t}: this plan splits each layer over {t} ranks ({dp} replica(s) of {t} ranks, {n} "
        "processes)"
    )
    run = f"span(model, tp={t}, shard=True)" if dp > 1 else f"span(model, tp={t})"
    if tp is not None and tp != t:
        raise ValueError(
            f"span(model, plan, tp={tp!r}): {what}; drop tp= to run the plan, or re-plan with tp={tp}"
        )
    if len(plan.stages) != 1 or plan.stage_ranks != [list(range(n))]:
        raise ValueError(
            f"{what} on {len(plan.stages)} stage(s), ranks {plan.stage_ranks}: span(model, plan) runs one "
            "stage with tp innermost (the planner's tensor parallel x sharded), several by planned_stages "
            "(tensor parallel x pipeline). Re-plan"
        )
    unknown = [name for name in plan.layers if name not in dict(model.named_modules())]
    if unknown:
        raise ValueError(
            f"{what}, of layers {unknown} that {type(model).__name__} does not have: re-plan for this model"
        )
    if world == 1 or world > n:
        raise ValueError(
            f"{what}; WORLD_SIZE is {world}: run span(model, plan) in a launched job of {n} processes "
            f"(torchspan launch --nproc-per-node ...), or of fewer that {t} shares a degree with (it runs "
            f"shrunk), as {run} would"
        )
    if world < n:
        t = math.gcd(t, world)
        if t == 1:
            raise ValueError(
                f"{what}; WORLD_SIZE({world}) shares no degree with it: launch a multiple of 2 processes"
            )
        dp = world // t
        warnings.warn(
            f"span(model, plan): the plan is for {n} ranks (tp {plan.tp} x dp_shard {plan.data_parallel}); "
            f"it runs shrunk on the {world} launched as tp {t} x dp_shard {dp} (tp = gcd(plan.tp, "
            "WORLD_SIZE)): the gradients are one device's, the plan's predicted times and memory are for "
            f"{n} ranks",
            UserWarning,
            stacklevel=5,  # planned, tensor_parallel, build._spanned, span: the caller's line
        )
    sharding["shard"] = dp > 1
    return t


def planned_stages(model: nn.Module, plan: Any, tp: Any) -> tuple[int, list[int]]:
    """``span(model, plan)`` for the planner's tensor parallel x pipeline (``plan.tp > 1``, several stages,
    ``planner.tppipeline``): ``(tp, balance)`` for the 3-D path (``ranks.tpstages``) on the launched world.

    On the plan's world: its ``pp x dp x tp``. On fewer ranks: "shrunk", the plan's stages kept, ``tp =
    gcd(plan.tp, WORLD_SIZE / pp)`` and replicas over the rest, with a ``UserWarning``. Refused
    (``ValueError``): a ``tp=`` other than the plan's, ranks not ``pp x dp x tp`` with ``tp`` innermost,
    layers the model lacks, one process, a larger job, a world that ``pp`` does not divide or that leaves
    ``tp`` 1."""
    import math
    import warnings

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    n, t, dp, pp = plan.world_size, plan.tp, plan.data_parallel, len(plan.stages)
    what = f"plan.tp={t} with {pp} stages: this plan runs pp {pp} x dp {dp} x tp {t} ({n} processes)"
    run = f"span(model, tp={t}, balance={plan.balance})"
    if tp is not None and tp != t:
        raise ValueError(
            f"span(model, plan, tp={tp!r}): {what}; drop tp= to run the plan, or re-plan with tp={tp}"
        )
    rows = [[(s * dp + r) * t + k for r in range(dp) for k in range(t)] for s in range(pp)]
    if plan.stage_ranks != rows:
        raise ValueError(
            f"{what}, on ranks {plan.stage_ranks}: span(model, plan) runs the mesh pp x dp_replicate x tp, "
            f"tp innermost (ranks {rows}). Re-plan with torchspan.plan(..., nodes=...)"
        )
    unknown = [name for name in plan.layers if name not in dict(model.named_modules())]
    if unknown:
        raise ValueError(
            f"{what}, of layers {unknown} that {type(model).__name__} does not have: re-plan for this model"
        )
    if world == 1 or world > n or world % pp:
        raise ValueError(
            f"{what}; WORLD_SIZE is {world}: run span(model, plan) in a launched job of {n} processes "
            f"(torchspan launch --nproc-per-node ...), or of fewer, a multiple of the {pp} stages that "
            f"leaves tp > 1 (it runs shrunk), as {run} would"
        )
    if world < n:
        t = math.gcd(t, world // pp)
        if t == 1:
            raise ValueError(
                f"{what}; WORLD_SIZE({world}) leaves {world // pp} rank(s) per stage, sharing no degree with "
                f"tp {plan.tp}: launch {pp} x a multiple of 2 processes"
            )
        warnings.warn(
            f"span(model, plan): the plan is for {n} ranks (pp {pp} x dp {dp} x tp {plan.tp}); it runs "
            f"shrunk on the {world} launched as pp {pp} x dp {world // (pp * t)} x tp {t} (the stages "
            "kept, tp = gcd(plan.tp, WORLD_SIZE / pp)): the gradients are one device's, the plan's predicted "
            f"times and memory are for {n} ranks",
            UserWarning,
            stacklevel=4,  # planned_stages, build._spanned, span: the caller's line
        )
    return t, list(plan.balance)


def tp_styles(model: nn.Module, tp_plan: Mapping[str, Any] | None) -> dict[str, Any]:
    """``{module name: ParallelStyle}`` for every module ``model`` holds that the plan names (see the module
    doc)."""
    plan = dict(tp_plan) if tp_plan is not None else _own_plan(model)
    if not plan:
        raise ValueError(
            f"span(model, tp=...): {type(model).__name__} has no tensor-parallel plan of its own (a "
            "transformers config's base_model_tp_plan); pass tp_plan={'module.name.pattern': 'colwise' | "
            "'rowwise' | ...}, e.g. tp_plan={'0': 'colwise', '2': 'rowwise'} for Linear -> act -> Linear"
        )
    names = [n for n, _ in model.named_modules() if n]
    chosen: dict[str, Any] = {}
    sequence = any(style == "sequence_parallel" for style in plan.values())  # rowwise then reduce-scatters
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern) and _same_depth(n, pattern)]
        if not hits:
            raise ValueError(
                f"tp_plan[{pattern!r}] names no module of {type(model).__name__}; its modules are e.g. "
                f"{names[:6]}"
            )
        for name in hits:
            chosen[name] = _style(style, pattern, sequence)
    return chosen


def parallelize(
    model: nn.Module, mesh: Any, tp_plan: Mapping[str, Any] | None = None, within: Any = None
) -> dict[str, Any]:
    """``model``'s planned modules split over ``mesh`` in place (``parallelize_module``); returns the plan
    applied. ``within``: only the modules under these names (a pipeline stage's layers,
    ``ranks.tpstages``)."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    styles = tp_styles(model, tp_plan)
    if within is not None:
        styles = {n: s for n, s in styles.items() if any(n == w or n.startswith(w + ".") for w in within)}
    tied = _tied_elsewhere(model, styles)
    if tied:
        styles = {n: s for n, s in styles.items() if n not in tied}
    _check_divisible(model, styles, mesh.size())
    parallelize_module(model, mesh, styles)
    if any(isinstance(s, SequenceParallel) for s in styles.values()) and _named_sequence(model, tp_plan):
        sequence_hooks(
            model, styles, mesh
        )  # the layouts around sequence-sharded norms (ranks.sequenceparallel)
    return styles


def full_tensors(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every ``DTensor`` gathered into its full tensor (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def _own_plan(model: nn.Module) -> dict[str, Any]:
    """A transformers model's ``config.base_model_tp_plan``, prefixed with its base model's attribute."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix) and getattr(model, prefix) is not model:
        return {f"{prefix}.{k}": v for k, v in plan.items()}
    return dict(plan)


def _same_depth(name: str, pattern: str) -> bool:
    return name.count(".") == pattern.count(".")


def _named_sequence(model: nn.Module, tp_plan: Mapping[str, Any] | None) -> bool:
    """Whether the plan names ``"sequence_parallel"`` (the hooks keep torchspan's layouts; style objects are
    the user's)."""
    plan = dict(tp_plan) if tp_plan is not None else _own_plan(model)
    return any(style == "sequence_parallel" for style in plan.values())


def _style(style: Any, pattern: str, sequence: bool = False) -> Any:
    """A plan entry's ``ParallelStyle``; in a plan with ``"sequence_parallel"`` (``sequence``), ``"rowwise"``
    reduce-scatters into the sequence-sharded stream (``ranks.sequenceparallel``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        SequenceParallel,
    )

    if isinstance(style, ParallelStyle):
        return style
    style = ALIASES.get(style, style)
    made = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: (
            RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM), use_local_output=False)
            if sequence
            else RowwiseParallel()
        ),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": lambda: SequenceParallel(),
    }.get(style)
    if made is None:
        names = ", ".join(map(repr, STYLES + tuple(ALIASES)))
        raise ValueError(f"tp_plan[{pattern!r}]={style!r} is not one of {names} or a ParallelStyle")
    return made()


def _tied_elsewhere(model: nn.Module, styles: Mapping[str, Any]) -> set[str]:
    """Planned modules holding a parameter that another module holds too (kept whole: splitting would untie
    it)."""
    holders: dict[int, set[str]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(name)
    return {n for n in styles for p in model.get_submodule(n).parameters() if len(holders.get(id(p), ())) > 1}


def _check_divisible(model: nn.Module, styles: Mapping[str, Any], tp: int) -> None:
    """Every split dimension divides by ``tp`` (DTensor would pad it; a head count must split evenly)."""
    for name in styles:
        weight = getattr(model.get_submodule(name), "weight", None)
        if weight is not None and weight.dim() == 2 and weight.shape[0] % tp and weight.shape[1] % tp:
            raise ValueError(
                f"{name}.weight has shape {tuple(weight.shape)}: neither dimension divides by tp={tp}"
            )
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp:
            raise ValueError(
                f"config.{key}={heads} does not divide by tp={tp}: each rank must hold whole heads"
            )

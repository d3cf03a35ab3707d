"""``span(model, ...)``: arguments → settings → layers and stages → the executor that runs them.

``span`` reads straight down: its arguments are checked (``_check_arguments``), its settings made
(``span_settings``), the model cut into stages (``runtime.layout``) and the executor chosen
(``runtime.choose``, the one place that knows every executor). It returns the ``Spanned`` façade.

In a launched job (a process group of size > 1: ``torchspan launch``/``torchrun`` and
``torchspan.init_distributed()``; a script launched without that call joins its job in ``span``, as
``init_distributed()`` would, rather than train as one lone process per rank), ``span(model)`` with one stage
(no ``balance``, one device or none, or a one-stage plan) returns this rank's exact data-parallel replica
(``runtime.ranks.replicated``: ``train_step`` on the rank's shard leaves every rank the single-device gradient
of all shards, ``microbatches``, ``precision`` and ``recompute`` as in one process; ``join(optimizer)`` for
uneven epoch ends); with more stages, a pipeline across ranks: stage functions for an ``nn.Sequential`` or
fx-traceable model (``runtime.ranks.pipelined``), else the model's own forward on every rank with the other
stages' layers on ``meta`` (``runtime.ranks.ownforward``: transformers models, wrappers around
``ModuleList``s).

``shard=True`` (or a plan's ``shard``), one stage: that replica sharded by FSDP2, ``mode == "sharded"``
(``runtime.ranks.sharded``: ``.grad`` a ``DTensor`` shard; ``reshard_after_forward`` True is ZeRO-3, False
ZeRO-2; ``offload="cpu"``: states in CPU memory, needs a GPU). In a plain process it opens a process group of
one (``init_distributed()``): one GPU training with offload. With several stages in a launched job of replicas
x stages ranks: each stage sharded over its replicas (``runtime.ranks.stageshard``).
``per_shard_batchnorm=True``: a replica's BatchNorm normalises its shard alone (else refused; one process: no
effect).

``tp=N``/``tp_plan=`` (or a plan's ``tp``): each layer split over ``N`` processes, with ``shard=True`` FSDP2
over the rest (``runtime.ranks.tensorparallel``; a plan on fewer ranks than it was made for runs shrunk). With
``balance=``/``devices=`` naming several stages in a launched job: a pipeline of tensor-parallel stages with
replicas, ``pp x dp_replicate x tp`` (``runtime.ranks.tpstages``).
``mesh``: the job's ``DeviceMesh`` to use, checked against the span's degrees (else built: ``spanned.mesh``,
``runtime.ranks.devicemesh``).

Usage: ``spanned = span(model, devices=["cpu", "cpu"], balance=[2, 2], microbatches=4)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..planner.api import recompute_alias
from ..planner.plans import Plan
from ..schedule import PRECISIONS, RECOMPUTE_MODES, SCHEDULES
from .choose import choose, replica
from .executor import Settings
from .facade import dressed
from .fp16 import SpanScaler
from .layout import Layout, layout
from .memory import ActivationMeter
from .metainit import bind, materialize, meta_slots, restore
from .nonfinite import NONFINITE
from .placement import parse_devices
from .ranks.env import init_distributed, join_launched_job
from .ranks.mesh import launched_stages
from .ranks.metaweights import check_weights, fill
from .ranks.replicated import launched_replica
from .ranks.sharded import check_shard_options
from .ranks.tensorparallel import planned_stages, tensor_parallel
from .ranks.tpstages import tp_pipeline
from .record import Recorder
from .spanned import Spanned

__all__ = ["span", "span_settings"]


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")
    return str(value)


def _given(value: Any, planned: Any, default: Any) -> Any:
    """An argument of ``span``: what the caller passed, else the plan's value, else the default."""
    if value is not None:
        return value
    return planned if planned is not None else default


def _check_arguments(
    model: nn.Module, plan: Plan | None, devices: Any, balance: Any, weights: Any = None
) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"span(model=...) needs an nn.Module, got {type(model).__name__}")
    if isinstance(model, Spanned):
        raise TypeError("model is already a Spanned; pass spanned.module to span it again")
    _check_meta(model, devices, weights)
    if plan is None:
        return
    if not isinstance(plan, Plan):
        raise TypeError(
            f"plan={type(plan).__name__} is not a torchspan Plan; pass torchspan.plan(...)'s result, "
            "Plan.load(path), or use devices=[...] and balance=[...] instead"
        )
    if devices is not None or balance is not None:
        raise ValueError(
            "pass either plan or devices/balance, not both: the plan already says where each layer goes"
        )


def span_settings(
    plan: Plan | None, microbatches: Any, schedule: Any, recompute: Any, precision: Any, workers: Any
) -> Settings:
    """``Settings`` from ``span``'s arguments: each one given, else the plan's, else the default
    (validated)."""
    microbatches = _given(microbatches, plan.microbatches if plan else None, 1)
    schedule = _given(schedule, plan.schedule if plan else None, "gpipe")
    recompute = _given(recompute, plan.recompute if plan else None, "never")
    precision = _given(precision, None, "32")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be an int >= 1")
    _choice("schedule", schedule, SCHEDULES)
    _choice("recompute", recompute, RECOMPUTE_MODES)
    precision = _choice("precision", str(precision), PRECISIONS)
    _choice("workers", workers, ("device", "stage"))
    return Settings(microbatches, schedule, recompute, precision, workers)


def _loss_options(settings: Settings, nonfinite: str, loss_reduction: str | None) -> None:
    """``span``'s loss options into ``settings``: ``nonfinite`` and the plain loop's declared
    ``loss_reduction``."""
    settings.nonfinite = _choice("nonfinite", nonfinite, NONFINITE)
    if loss_reduction is not None:
        settings.loss_reduction = _choice("loss_reduction", loss_reduction, ("mean", "sum"))


def _check_workers(settings: Settings, devices: list[torch.device]) -> None:
    if (
        settings.workers == "stage"
        and settings.recompute != "never"
        and len(set(devices)) < len(devices)
        and any(d.type == "cpu" for d in devices)
    ):
        raise ValueError(
            "workers='stage' with recompute != 'never' would replay dropout masks from the CPU random "
            "generator while another stage's thread draws from it; use workers='device' (the default) or "
            "recompute='never'"
        )


def _sharding(
    plan: Plan | None,
    shard: Any,
    offload: Any,
    reshard_after_forward: Any,
    precision: str,
    per_shard_batchnorm: Any = False,
) -> dict[str, Any]:
    """``span``'s keywords for replicas (sharding, else the plan's ``Plan.shard``, ``Plan.offload``;
    BatchNorm's per-shard statistics accepted), checked before any work."""
    chosen = dict(
        shard=_given(shard, getattr(plan, "shard", None), False),
        offload=_given(offload, getattr(plan, "offload", None), None),
        reshard_after_forward=reshard_after_forward,
        per_shard_batchnorm=per_shard_batchnorm,
    )
    check_shard_options(chosen["shard"], chosen["offload"], precision, reshard_after_forward)
    if not isinstance(per_shard_batchnorm, bool):
        raise ValueError(f"per_shard_batchnorm={per_shard_batchnorm!r} must be True or False")
    return chosen


def _replica(
    model: nn.Module,
    plan: Plan | None,
    devices: Any,
    balance: Any,
    settings: Settings,
    recorder: Recorder,
    sharding: dict[str, Any],
    weights: Any,
) -> Spanned | None:
    """This rank's data-parallel replica (DDP, or sharded by FSDP2) when launched with one stage or sharded;
    else None (several stages, sharded or not: a pipeline, whose stages ``choose`` shards over their
    replicas)."""
    stages = launched_stages(plan, devices, balance)
    if sharding["shard"] and stages == 1:
        # a plain process: a world of one, the sharded replica of one rank (offload on one GPU)
        init_distributed()
    if stages != 1 or not (launched_replica(plan) or sharding["shard"]):
        return None
    device = parse_devices(devices)[0] if devices is not None else None
    meter = ActivationMeter(1)
    executor = replica(model, device, settings, recorder, meter, weights=weights, **sharding)
    why = "launched with one stage per replica" + (", sharded" if sharding["shard"] else "")
    return dressed(Spanned(model, executor, settings, recorder, meter, mode_reason=why), model)


def _check_meta(model: nn.Module, devices: Any, weights: Any) -> None:
    """``weights`` checked (``ranks.metaweights.check_weights``); a meta model spanned onto meta devices only
    (to trace shapes) needs none."""
    if weights is None and devices is not None and all(d.type == "meta" for d in parse_devices(devices)):
        return
    check_weights(model, weights)


def _layout(
    model: nn.Module,
    plan: Plan | None,
    devices: Any,
    balance: Any,
    split_points: Any,
    no_split: Any,
    weights: Any,
) -> Layout:
    """``layout`` (a model built on meta with ``weights`` and no devices: one stage on the CPU), then, in one
    process, that model's stages made real on their devices (``_materialize_stages``)."""
    one = weights is not None and devices is None and plan is None and (balance is None or len(balance) == 1)
    lay = layout(model, plan, "cpu" if one else devices, balance, split_points, no_split)
    if weights is not None and lay.ranked is None:
        _materialize_stages(model, lay, weights)
    return lay


def _materialize_stages(model: nn.Module, lay: Layout, weights: Any) -> None:
    """One process, a model built on meta: each layer's tensors made on its stage's device (the rest on the
    first), then filled from ``weights`` (``ranks.metaweights``). A stage whose layers the first call names
    (blocks with a balance) starts on an even split of the blocks' static order; the first call moves what it
    places elsewhere."""
    names = [g for g in lay.groups]
    if lay.layer_set is not None and any(n.startswith("<stage ") for g in names for n in g):
        static = lay.layer_set.names()
        counts = [len(g) for g in names]
        names, k = [], 0
        for c in counts:
            names.append(static[k : k + c])
            k += c
    device_of = {}
    for s, group in enumerate(names):
        for name in group:
            for sub in model.get_submodule(name).modules():
                device_of.setdefault(id(sub), lay.devices[s])
    slots = meta_slots(model)
    materialize(slots, lambda slot: device_of.get(id(slot.positions[0][0]), lay.devices[0]))
    bind(slots, model)
    try:
        fill(model, slots, weights)
    except BaseException:
        restore(slots)
        raise


def span(
    model: nn.Module,
    plan: Plan | None = None,
    *,
    devices: Any = None,
    balance: list[int] | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    recompute: str | None = None,
    precision: str | None = None,
    workers: str = "device",
    split_points: list[str] | None = None,
    no_split: list[Any] | None = None,
    checkpoint: str | None = None,
    nonfinite: str = "raise",
    shard: bool | None = None,
    offload: str | None = None,
    reshard_after_forward: bool = True,
    per_shard_batchnorm: bool = False,
    weights: Any = None,
    loss_reduction: str | None = None,
    tp: int | None = None,
    tp_plan: Any = None,
    mesh: Any = None,
) -> Spanned:
    """Place ``model``'s layers (``torchspan.layers``) on devices and return a pipelined ``Spanned``.

    Placement comes from ``plan`` (a ``torchspan.Plan``: exactly its layers on its devices), or from
    ``devices`` plus ``balance`` (layers per stage, in execution order; even split when omitted), or else one
    stage on the model's current device. ``microbatches``, ``schedule`` and ``recompute`` (activation
    recompute, "activation checkpointing": ``"never"``, ``"except_last"``, ``"always"``; ``checkpoint=`` is
    its old name) left as ``None`` take the plan's values, else 1, ``"gpipe"``, ``"never"``; ``precision``
    defaults to ``"32"``. ``workers="device"`` runs one thread per distinct device (stages sharing a device
    take turns, which is fastest when they share the same cores); ``"stage"`` gives every stage its own
    thread. ``nonfinite``: what ``train_step`` does when the loss is inf/NaN, ``"raise"``
    (``FloatingPointError`` naming the step and micro-batch) or ``"warn"``.

    Layers are ``torchspan.layers.model_layers(model)``: a model with repeated blocks inside
    ``nn.ModuleList``/``nn.Sequential`` containers is cut into those blocks (qualified names,
    ``transformer.h.0``; execution order confirmed by a recording forward at the first call, which also places
    the model), any other model into its top-level children. ``split_points`` (qualified module names that
    must start a layer) and ``no_split`` (module classes kept whole) choose the blocks as in ``find_layers``.
    A parameter shared by layers on two devices (tied embeddings) stays one ``nn.Parameter`` (see
    ``runtime.ties``): build the optimizer from ``spanned.parameters()`` as usual.

    In a launched job (``torchspan launch``/``torchrun``; a script that did not call ``init_distributed()``
    joins its job here): one stage is this rank's exact data-parallel replica, more stages a pipeline across
    ranks; ``shard=True`` (or a plan's) shards them by FSDP2 (``reshard_after_forward``, ``offload="cpu"``,
    ``per_shard_batchnorm``); ``tp=N``/``tp_plan=`` (or a plan's ``tp``) splits each layer over ``N``
    processes; ``mesh``: the job's ``DeviceMesh`` to use. This module's docstring says each. ``weights`` (a
    model built on ``meta``): ``"init"``, a checkpoint path or a callable, each rank filling only its shard or
    stage (``runtime.ranks.metaweights``; a meta model without it is refused). ``loss_reduction``
    (``"sum"``/``"mean"``): a plain loop's unreadable loss, declared (``runtime.ranks.plainloop``).

    Usage: ``span(model, devices=["cpu", "cpu"], balance=[2, 2], microbatches=4, schedule="1f1b")``.
    """
    _check_arguments(model, plan, devices, balance, weights)
    recompute = recompute_alias(recompute, checkpoint, None)
    settings = span_settings(plan, microbatches, schedule, recompute, precision, workers)  # type: ignore[arg-type]
    _loss_options(settings, nonfinite, loss_reduction)
    sharding = _sharding(plan, shard, offload, reshard_after_forward, settings.precision, per_shard_batchnorm)
    join_launched_job("torchspan.span")  # launched without init_distributed(): join, never train alone
    settings.mesh = mesh  # a user's DeviceMesh: checked by the strategy that uses it
    where = dict(
        devices=devices, balance=balance, split_points=split_points, no_split=no_split, weights=weights
    )
    return _spanned(model, plan, settings, sharding, tp, tp_plan, where)


def _spanned(
    model: nn.Module,
    plan: Plan | None,
    settings: Settings,
    sharding: dict[str, Any],
    tp: Any,
    tp_plan: Any,
    where: dict[str, Any],
) -> Spanned:
    """``span``'s strategy from its checked settings: tensor parallel first (``tp=`` or a plan's ``tp``; the
    plan is consumed there), then a launched replica (one stage, or sharded), else the stages of
    ``runtime.layout``."""
    if plan is not None and plan.tp > 1 and len(plan.stages) > 1:  # the planner's tp x pp: the 3-D path below
        tp, balance = planned_stages(model, plan, tp)
        where, plan = {**where, "balance": balance}, None
    devices, balance, weights = where["devices"], where["balance"], where["weights"]
    recorder = Recorder()
    split = tp is not None or getattr(plan, "tp", 1) > 1  # every layer over tp ranks (ranks.tensorparallel)
    if split and tp_pipeline(tp, tp_plan, plan, sharding, where):  # pipeline stages each split over tp (3-D)
        settings.tp, split = (tp, tp_plan), False
    if split:  # sharded over the other ranks; a plan's tp and replicas on the launched world
        devices = tensor_parallel(
            model, tp, tp_plan, settings, sharding, plan=plan, balance=balance, devices=devices
        )
        plan = None
    if not split or sharding["shard"]:
        got = _replica(model, plan, devices, balance, settings, recorder, sharding, weights)
        if got is not None:
            return got  # launched with one stage, or sharded: one replica per process
    lay = _layout(model, plan, devices, balance, where["split_points"], where["no_split"], weights)
    options = dict(split_points=where["split_points"], no_split=where["no_split"])
    return _staged(model, lay, plan, balance, settings, recorder, sharding, weights, options)


def _staged(
    model: nn.Module,
    lay: Layout,
    plan: Any,
    balance: Any,
    settings: Settings,
    recorder: Recorder,
    sharding: Any,
    weights: Any,
    options: dict[str, Any],
) -> Spanned:
    """The ``Spanned`` running ``lay``'s stages: its executor chosen (``runtime.choose``), fp16's scaler
    made."""
    _check_workers(settings, lay.devices)
    if (
        settings.mesh is not None
        and lay.ranked is None
        and "tp" not in (getattr(settings.mesh, "mesh_dim_names", None) or ())
    ):
        raise ValueError(
            "mesh= was given, but this span runs in one process (no launched job with replicas, stages or "
            "tp): launch the job (torchspan launch / torchrun) or leave mesh= out"
        )
    if settings.precision == "fp16":  # train_step leaves .grad unscaled (runtime.fp16)
        settings.scaler = SpanScaler(lay.devices[-1].type)
    meter = ActivationMeter(len(lay.devices))
    executor = choose(
        model,
        lay,
        settings,
        recorder,
        meter,
        planned=plan is not None,
        even=balance is None,
        sharding=sharding,
        weights=weights,
        stacklevel=4,
        **options,
    )
    why = lay.why + ("; each stage sharded over its replicas (FSDP2)" if sharding["shard"] else "")
    tp = (
        dict(zip(settings.mesh.mesh_dim_names or (), settings.mesh.shape)).get("tp")
        if settings.mesh is not None
        else None
    )
    why += f"; each layer split over tp({tp}) processes (DTensor)" if tp else ""
    return dressed(Spanned(model, executor, settings, recorder, meter, mode_reason=why), model)

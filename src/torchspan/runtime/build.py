"""``span(model, ...)``: validate its arguments and choose the executor that runs the model.

The one place that knows every executor: the local pipeline (``nn.Sequential``, fx splits), the
threaded one (a model's own forward, blocks as layers), hook placement, a pipeline across ranks
(stage functions, or the model's own forward) and a data-parallel replica per rank. It returns the ``Spanned`` façade over the one it chose.

Usage: ``spanned = span(model, devices=["cpu", "cpu"], balance=[2, 2], microbatches=4)``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ..layers import discovery
from ..layers import fxsplit as split
from ..planner.plans import Plan
from ..schedule import RECOMPUTE_MODES, PRECISIONS, SCHEDULES
from .executor import Executor, Settings
from .local.hooked import HookedExecutor
from .local.pipelined import PipelinedExecutor
from .local.threaded import ThreadedExecutor
from .memory import ActivationMeter
from .placement import parse_devices, stages_from_balance, stages_from_plan
from .ranks.mesh import launched_stages
from .ranks.hooked import RankHookExecutor
from .ranks.pipelined import RankPipelineExecutor, launched_mesh
from .ranks.replicated import ReplicaExecutor, launched_replica
from .record import Recorder
from .spanned import Spanned

__all__ = ["span"]


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")
    return str(value)


def _given(value: Any, planned: Any, default: Any) -> Any:
    """An argument of ``span``: what the caller passed, else the plan's value, else the default."""
    if value is not None:
        return value
    return planned if planned is not None else default


def span(
    model: nn.Module,
    plan: Plan | None = None,
    *,
    devices: Any = None,
    balance: list[int] | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    checkpoint: str | None = None,
    precision: str | None = None,
    workers: str = "device",
    split_points: list[str] | None = None,
    no_split: list[Any] | None = None,
) -> Spanned:
    """Place ``model``'s layers (``torchspan.layers``) on devices and return a pipelined ``Spanned``.

    Placement comes from ``plan`` (a ``torchspan.Plan``: exactly its layers on its devices), or
    from ``devices`` plus ``balance`` (layers per stage, in execution order; even split when
    omitted), or else one stage on the model's current device. ``microbatches``, ``schedule`` and
    ``checkpoint`` left as ``None`` take the plan's values, else 1, ``"gpipe"``, ``"never"``;
    ``precision`` defaults to ``"32"``. ``workers="device"`` runs one thread per distinct device
    (stages sharing a device take turns, which is fastest when they share the same cores);
    ``"stage"`` gives every stage its own thread.

    Layers are ``torchspan.layers.model_layers(model)``: a model with repeated blocks inside
    ``nn.ModuleList``/``nn.Sequential`` containers is cut into those blocks (qualified names,
    ``transformer.h.0``; execution order confirmed by a recording forward at the first call, which
    also places the model), any other model into its top-level children. ``split_points``
    (qualified module names that must start a layer) and ``no_split`` (module classes kept whole)
    choose the blocks as in ``find_layers``. A parameter shared by layers on two devices (tied
    embeddings) stays one ``nn.Parameter`` (see ``runtime.ties``): build the optimizer from
    ``spanned.parameters()`` as usual.

    In a launched job (a process group of size > 1: ``torchspan launch``/``torchrun`` and
    ``torchspan.init_distributed()``), ``span(model)`` with one stage (no ``balance``, one device
    or none, or a one-stage plan) returns this rank's exact data-parallel replica
    (``runtime.ranks.replicated``: ``train_step`` on the rank's shard leaves every rank the
    single-device gradient of all shards; ``join(optimizer)`` for uneven epoch ends); with more
    stages, a pipeline across ranks: stage functions for an ``nn.Sequential`` or fx-traceable model
    (``runtime.ranks.pipelined``), else the model's own forward on every rank with the other stages'
    layers on ``meta`` (``runtime.ranks.hooked``: transformers models, wrappers around ``ModuleList``s).

    Usage: ``span(model, devices=["cpu", "cpu"], balance=[2, 2], microbatches=4, schedule="1f1b")``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"span(model=...) needs an nn.Module, got {type(model).__name__}")
    if isinstance(model, Spanned):
        raise TypeError("model is already a Spanned; pass spanned.module to span it again")
    if plan is not None:
        if not isinstance(plan, Plan):
            raise TypeError(
                f"plan={type(plan).__name__} is not a torchspan Plan; pass torchspan.plan(...)'s result, "
                "Plan.load(path), or use devices=[...] and balance=[...] instead"
            )
        if devices is not None or balance is not None:
            raise ValueError("pass either plan or devices/balance, not both: the plan already says where each layer goes")
    microbatches = _given(microbatches, plan.microbatches if plan else None, 1)
    schedule = _given(schedule, plan.schedule if plan else None, "gpipe")
    checkpoint = _given(checkpoint, plan.checkpoint if plan else None, "never")
    precision = _given(precision, None, "32")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be an int >= 1")
    _choice("schedule", schedule, SCHEDULES)
    _choice("checkpoint", checkpoint, RECOMPUTE_MODES)
    precision = _choice("precision", str(precision), PRECISIONS)
    _choice("workers", workers, ("device", "stage"))
    if launched_stages(plan, devices, balance) == 1 and launched_replica(plan):  # launched: one replica per process
        device = parse_devices(devices)[0] if devices is not None else None
        settings = Settings(microbatches, schedule, checkpoint, precision, workers)
        recorder, meter = Recorder(), ActivationMeter(1)
        names = [n for n, _ in discovery.top_level_layers(model)]
        executor = ReplicaExecutor(model, names, settings, recorder, meter, device=device)
        return Spanned(model, executor, settings, recorder, meter, mode_reason="launched with one stage per replica")

    blocks = discovery.descends(model, split_points, no_split)
    layer_set = discovery.model_layers(model, split_points=split_points, no_split=no_split) if blocks else None
    if layer_set is not None:
        mode, graph = "own-forward", None
        why = f"its layers are blocks inside containers ({', '.join(layer_set.names()[:3])}, ...), which torch.fx splits do not cut"
        names = layer_set.names()
    else:
        mode, why, graph = split.choose_mode(model)
        names = [n for n, _ in discovery.top_level_layers(model)]
    if graph is not None:
        order: list[str] | None = split.graph_layer_order(graph, names)
    elif mode == "sequential":
        order = names
    else:
        order = None  # known after a recording forward

    ranked = launched_mesh(plan, devices, balance)  # launched with pp > 1: one stage per rank (runtime.ranks)
    if ranked is not None and plan is None:
        devices = [ranked[1].device] * ranked[0].stages
    if plan is not None and layer_set is not None:
        # blocks are confirmed by the first call's recording, which checks the plan's names and order
        modules = dict(model.named_modules())
        for i, st in enumerate(plan.stages):
            unknown = [n for n in st.layers if n not in modules]
            if unknown:
                raise ValueError(
                    f"plan stage {i} names layer(s) {unknown}, which the model does not have; its layers are "
                    f"{', '.join(names)}. Re-plan for this model (torchspan.plan(model, x, ...))"
                )
        groups, devs = stages_from_plan(plan, plan.layers, None, ranked[1].device if ranked else None)
    elif plan is not None:
        groups, devs = stages_from_plan(plan, names, order, ranked[1].device if ranked else None)
    else:
        if devices is None:
            first = next(iter(model.parameters()), None)
            devs = [first.device if first is not None else torch.device("cpu")]
            if balance is not None and len(balance) != 1:
                raise ValueError(f"balance={balance} needs devices=[...] with {len(balance)} entries")
        else:
            devs = parse_devices(devices)
        groups = stages_from_balance(order or names, devs, balance)
    if ranked is not None:
        devs = [ranked[1].device] * len(groups)
    if workers == "stage" and checkpoint != "never" and len(set(devs)) < len(devs) and any(d.type == "cpu" for d in devs):
        raise ValueError(
            "workers='stage' with checkpoint != 'never' would replay dropout masks from the CPU random generator "
            "while another stage's thread draws from it; use workers='device' (the default) or checkpoint='never'"
        )
    settings = Settings(microbatches, schedule, checkpoint, precision, workers)
    if precision == "fp16":
        settings.scaler = torch.amp.GradScaler(devs[-1].type)
    recorder, meter = Recorder(), ActivationMeter(len(devs))
    # Choosing the executor: the one place that knows them all.
    executor: Executor
    unthreaded = ThreadedExecutor.unsupported(devs, microbatches, checkpoint)
    if ranked is not None and mode == "own-forward":  # the model's own forward on every rank, its stage for real
        executor = RankHookExecutor(
            model, groups, settings, recorder, meter, *ranked, balance_given=plan is None, layers=layer_set,
            even=balance is None, split_points=split_points, no_split=no_split,
        )  # fmt: skip
    elif ranked is not None:
        executor = RankPipelineExecutor(model, mode, graph, groups, settings, recorder, meter, *ranked)
    elif mode == "own-forward" and not unthreaded:  # the model's own forward, one thread per micro-batch
        executor = ThreadedExecutor(
            model, devs, groups, settings, recorder, meter, balance_given=plan is None, layers=layer_set,
            even=balance is None, split_points=split_points, no_split=no_split,
        )  # fmt: skip
    elif mode == "own-forward":
        warnings.warn(
            f"torchspan: {why}; using hook placement. Each layer lives on its device and inputs are moved to "
            f"it, but micro-batches run one after another (no pipelining): {unthreaded}.",
            UserWarning,
            stacklevel=2,
        )
        executor = HookedExecutor(
            model, devs, groups, settings, recorder, meter, balance_given=plan is None, layers=layer_set,
            even=balance is None, split_points=split_points, no_split=no_split,
        )  # fmt: skip
    else:
        executor = PipelinedExecutor(model, mode, graph, devs, groups, settings, recorder, meter)
    return Spanned(model, executor, settings, recorder, meter, mode_reason=why)

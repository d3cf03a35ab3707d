"""``span(model, ...)`` → ``Spanned``: one model trained across local devices, exact gradients.

Usage::

    spanned = torchspan.span(model, devices=["cuda:0", "cpu"], balance=[3, 1], microbatches=4)
    opt = torch.optim.SGD(spanned.parameters(), lr=0.1)
    opt.zero_grad()
    loss = spanned.train_step(x, y, torch.nn.functional.mse_loss)   # grads as on one device
    opt.step()
    spanned.timeline(); spanned.memory(opt)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..layers import fxsplit as split
from ..layers import discovery
from ..hardware import to_device
from ..schedule import SCHEDULES
from ..layers.slots import Slot, buffer_slots, kept
from .hooks import HookPlacement
from .memory import ActivationMeter
from .microbatch import NoSplit, batch_size, gather, split_batch, split_sizes, split_value
from .pipeline import CHECKPOINTS, PRECISIONS, Pipeline, autocast_for, checkpointed
from .lossweights import microbatch_weights, resolve_reduction, weighted_loss
from .placement import check_shared, parse_devices, place, stages_from_balance, stages_from_plan
from .record import Recorder

__all__ = ["span", "Spanned"]

_PLACEMENT_MSG = (
    "torchspan owns the placement of a Spanned model: each stage's layers already live on their "
    "device. To run elsewhere, build a new one: torchspan.span(spanned.module, devices=[...]) or with a plan"
)


def _warn_batchnorm(spanned: Any) -> None:
    """Warn once: BatchNorm in training mode normalises per micro-batch, not over the full batch."""
    if spanned.microbatches == 1 or getattr(spanned, "_bn_warned", False) or not torch.is_grad_enabled():
        return
    names = [
        name
        for name, m in spanned.module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and (m.track_running_stats or m.running_mean is None)
    ]
    if names:
        spanned._bn_warned = True
        shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        warnings.warn(
            f"BatchNorm layer(s) {shown} in training mode normalise over each micro-batch, not the full batch, so "
            f"with microbatches={spanned.microbatches} gradients and running statistics differ from single-device "
            "training. For identical results use microbatches=1, GroupNorm/LayerNorm, or put those layers in eval mode.",
            UserWarning,
            stacklevel=4,
        )


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")
    return str(value)


def span(
    model: nn.Module,
    plan: Any = None,
    *,
    devices: Any = None,
    balance: list[int] | None = None,
    microbatches: int = 1,
    schedule: str = "gpipe",
    checkpoint: str = "never",
    precision: str = "32",
    workers: str = "device",
) -> Spanned:
    """Place ``model``'s layers (top-level children) on devices and return a pipelined ``Spanned``.

    Placement comes from ``plan`` (a ``torchspan.Plan``: exactly its layers on its devices; its
    microbatches/schedule/checkpoint unless you pass other values here), or from ``devices`` plus
    ``balance`` (layers per stage, in execution order; even split when omitted), or else one stage
    on the model's current device. ``workers="device"`` runs one thread per distinct device
    (stages sharing a device take turns, which is fastest when they share the same cores);
    ``"stage"`` gives every stage its own thread.

    Usage: ``span(model, devices=["cpu", "cpu"], balance=[2, 2], microbatches=4, schedule="1f1b")``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"span(model=...) needs an nn.Module, got {type(model).__name__}")
    if isinstance(model, Spanned):
        raise TypeError("model is already a Spanned; pass spanned.module to span it again")
    if plan is not None:
        from ..planner.plans import Plan

        if not isinstance(plan, Plan):
            raise TypeError(
                f"plan={type(plan).__name__} is not a torchspan Plan; pass torchspan.plan(...)'s result, "
                "Plan.load(path), or use devices=[...] and balance=[...] instead"
            )
        if devices is not None or balance is not None:
            raise ValueError("pass either plan or devices/balance, not both: the plan already says where each layer goes")
        microbatches = plan.microbatches if microbatches == 1 else microbatches
        schedule = plan.schedule if schedule == "gpipe" else schedule
        checkpoint = plan.checkpoint if checkpoint == "never" else checkpoint
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be an int >= 1")
    _choice("schedule", schedule, SCHEDULES)
    _choice("checkpoint", checkpoint, CHECKPOINTS)
    precision = _choice("precision", str(precision), PRECISIONS)
    _choice("workers", workers, ("device", "stage"))

    mode, why, graph = split.choose_mode(model)
    names = [n for n, _ in discovery.top_level_layers(model)]
    if graph is not None:
        order: list[str] | None = split.graph_layer_order(graph, names)
    elif mode == "sequential":
        order = names
    else:
        order = None  # known after a recording forward

    if plan is not None:
        groups, devs = stages_from_plan(plan, names, order)
    else:
        if devices is None:
            first = next(iter(model.parameters()), None)
            devs = [first.device if first is not None else torch.device("cpu")]
            if balance is not None and len(balance) != 1:
                raise ValueError(f"balance={balance} needs devices=[...] with {len(balance)} entries")
        else:
            devs = parse_devices(devices)
        groups = stages_from_balance(order or names, devs, balance)
    if workers == "stage" and checkpoint != "never" and len(set(devs)) < len(devs) and any(d.type == "cpu" for d in devs):
        raise ValueError(
            "workers='stage' with checkpoint != 'never' would replay dropout masks from the CPU random generator "
            "while another stage's thread draws from it; use workers='device' (the default) or checkpoint='never'"
        )
    return Spanned(
        model,
        mode=mode,
        why=why,
        groups=groups,
        devices=devs,
        microbatches=microbatches,
        schedule=schedule,
        checkpoint=checkpoint,
        precision=precision,
        workers=workers,
        balance_given=plan is None,
        graph=graph,
    )


def _concrete_id(concrete: dict[str, Any]) -> frozenset[tuple[str, str, str]]:
    """What identifies a trace's specialised arguments (as ``split.concrete_key`` keys them: type and repr)."""
    return frozenset((name, type(v).__name__, repr(v)) for name, v in concrete.items())


def _load_under_module(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *_rest: Any
) -> None:
    """Load-state-dict pre-hook: ``{prefix}key`` (as ``Spanned.state_dict`` writes it) → ``{prefix}module.key``."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


class Spanned(nn.Module):
    """A model whose layers live on several devices, trained with micro-batch pipelining.

    ``module`` is the original model; ``mode`` is ``"sequential"``, ``"fx"`` or ``"hooks"``;
    ``stages`` lists each stage's ``(device, layers)``. Outputs of ``spanned(...)`` are the
    micro-batch outputs concatenated on dim 0 on the last stage's device.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        mode: str,
        why: str,
        groups: list[list[str]],
        devices: list[torch.device],
        microbatches: int,
        schedule: str,
        checkpoint: str,
        precision: str,
        workers: str,
        balance_given: bool,
        graph: Any,
    ) -> None:
        super().__init__()
        self.module = model
        self.mode = mode
        self.mode_reason = why
        self.microbatches = microbatches
        self.schedule = schedule
        self.checkpoint = checkpoint
        self.precision = precision
        self.workers = workers
        self._devices = list(devices)
        self._groups = [list(g) for g in groups]
        self._recorder = Recorder()
        self._meter = ActivationMeter(len(devices))
        self._graphs: dict[Any, list[Any]] = {}
        self._hooks: HookPlacement | None = None
        self._root_attrs: dict[str, int] = {}
        self._default_trace: tuple[Any, list[Any]] | None = None  # (concrete id, stage modules) of span's trace
        self._placed = False
        self._order_checked = False
        self.scaler: Any = None
        if precision == "fp16":
            self.scaler = torch.amp.GradScaler(self._devices[-1].type)
        groups_idx = [[s] for s in range(len(devices))] if workers == "stage" else None
        self._pipeline = Pipeline(
            self._devices, checkpoint=checkpoint, precision=precision, recorder=self._recorder, meter=self._meter, groups=groups_idx
        )
        # A Spanned nested in another module loads that module's checkpoints (keys without ``module.``).
        self._register_load_state_dict_pre_hook(_load_under_module, with_module=True)  # public name needs torch>=2.5
        if mode == "hooks":
            warnings.warn(
                f"torchspan: {why}; using hook placement. Each layer lives on its device and inputs are moved to "
                "it, but micro-batches run one after another (no pipelining). Make the model an nn.Sequential "
                "or fx-traceable to pipeline it.",
                UserWarning,
                stacklevel=3,
            )
            self._lazy_balance = balance_given and len(devices) > 1
            # Tensors the model owns directly go where its forward first reads them: found by recording.
            owns = any(t is not None for t in list(model._parameters.values()) + list(model._buffers.values()))
            if not (self._lazy_balance or (owns and len(set(devices)) > 1)):
                self._place(graph=None)
        else:
            self._lazy_balance = False
            self._place(graph=graph)

    # ------------------------------------------------------------------ placement
    @property
    def stage_of(self) -> dict[str, int]:
        return {name: s for s, g in enumerate(self._groups) for name in g}

    @property
    def stages(self) -> list[tuple[str, list[str]]]:
        """``[(device, [layer names]), ...]`` in stage order."""
        return [(str(d), list(g)) for d, g in zip(self._devices, self._groups)]

    @property
    def devices(self) -> list[str]:
        return [str(d) for d in self._devices]

    @property
    def balance(self) -> list[int]:
        return [len(g) for g in self._groups]

    def _place(self, graph: Any, root_attrs: dict[str, int] | None = None) -> None:
        stage_of = self.stage_of
        check_shared(self.module, stage_of)
        if graph is None:
            self._root_attrs = dict(root_attrs or {})
            place(self.module, stage_of, self._devices, self._root_attrs)
        else:
            # Where the model's own parameters are first read decides their stage; they are moved there
            # before the stage modules capture them. Those modules serve every call whose non-tensor
            # arguments are the forward's defaults, so the first forward does not trace again.
            def put(attrs: dict[str, int]) -> None:
                self._root_attrs = dict(attrs)
                place(self.module, stage_of, self._devices, self._root_attrs)

            mods, _ = split.split_graph(self.module, graph, stage_of, len(self._devices), before_build=put)
            self._default_trace = (_concrete_id(split.default_concrete_args(self.module)), mods)
        if self.mode == "hooks":
            self._hooks = HookPlacement(self.module, stage_of, self._devices, self._recorder, self._meter, self.precision)
            self._hooks.install()
        self._placed = True

    def _stage_buffers(self) -> list[list[Slot]] | None:
        """Each stage's buffer slots, which a checkpoint recompute must leave unchanged (None: no recompute)."""
        if self.checkpoint == "never":
            return None
        children = dict(self.module.named_children())
        own: list[list[Slot]] = [[] for _ in self._devices]
        for name, b in self.module._buffers.items():
            if b is not None:
                own[self._root_attrs.get(name, 0)].append((self.module, name))
        return [buffer_slots([children[n] for n in g], own[s]) for s, g in enumerate(self._groups)]

    def _sequential_fns(self) -> list[Callable[..., Any]]:
        """One callable per stage running its layers in order (non-last stages return a 1-tuple)."""
        n = len(self._devices)
        layers = dict(self.module.named_children())

        def make(group: list[str], last: bool) -> Callable[..., Any]:
            mods = [layers[name] for name in group]

            def run(x: Any) -> Any:
                for mod in mods:
                    x = mod(x)
                return x if last else (x,)

            return run

        return [make(g, s == n - 1) for s, g in enumerate(self._groups)]

    def _fx_fns(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Callable[..., Any]], list[Any]]:
        values, concrete, key = split.concrete_key(self.module, args, kwargs, tensor_like=(NoSplit,))
        mods = self._graphs.get(key)
        if mods is None and self._default_trace is not None and self._default_trace[0] == _concrete_id(concrete):
            mods = self._graphs[key] = self._default_trace[1]
        if mods is None:
            graph = split.trace(self.module, concrete)
            mods, _ = split.split_graph(self.module, graph, self.stage_of, len(self._devices))
            self._graphs[key] = mods
        return list(mods), values

    # ------------------------------------------------------------------ running
    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Callable[..., Any]] | None, list[Any]]:
        """Stage functions (None in hook mode) and per-micro-batch inputs."""
        if self.mode == "sequential":
            if kwargs or len(args) != 1:
                raise TypeError(
                    f"an nn.Sequential takes one positional input; got {len(args)} positional and {sorted(kwargs)} keyword "
                    "argument(s)"
                )
            fns = self._sequential_fns()
            chunks = split_batch(args, {}, self.microbatches)
            return fns, [list(a) for a, _ in chunks]
        if self.mode == "fx":
            fns, values = self._fx_fns(args, kwargs)
            total = batch_size(tuple(values), {})
            split_sizes(total, self.microbatches)
            return fns, split_value(values, self.microbatches, total, name="inputs")
        chunks = split_batch(args, kwargs, self.microbatches)
        return None, chunks

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        """One recorded step: counters reset on entry, the timeline closed on exit (also on error)."""
        self._begin()
        try:
            yield
        finally:
            self._recorder.finish_step()

    def _begin(self) -> None:
        _warn_batchnorm(self)
        self._recorder.start_step(self._devices)
        self._meter.reset(list(self.module.parameters()) + list(self.module.buffers()))
        for d in dict.fromkeys(self._devices):
            if d.type == "cuda":  # pragma: no cover - needs a GPU
                torch.cuda.reset_peak_memory_stats(d)

    def _ensure_placed(self, first_args: tuple[Any, ...], first_kwargs: dict[str, Any]) -> None:
        """Hook mode: one recording forward finds the execution order (to apply a balance) and where the
        model's own parameters are first read (they are placed on that stage), then places."""
        if self._placed:
            return
        # The recording forward must leave no trace: BatchNorm statistics, counters and the random
        # state (dropout masks of the real step) stay as they were.
        cuda = sorted({d.index if d.index is not None else 0 for d in self._devices if d.type == "cuda"})
        with torch.random.fork_rng(devices=cuda), kept(buffer_slots([self.module])):
            order, uses = discovery.record_forward(self.module, first_args, first_kwargs)
        if self._lazy_balance:
            self._groups = stages_from_balance(order, self._devices, self.balance)
            self._order_checked = True
        stage_of = self.stage_of
        self._place(graph=None, root_attrs={attr: stage_of.get(child, 0) if child else 0 for attr, child in uses.items()})

    def _check_hook_order(self) -> None:
        if self._order_checked or self._hooks is None or not self._hooks.order:
            return
        planned = [n for g in self._groups for n in g if n in self._hooks.order]
        for i, (want, got) in enumerate(zip(self._hooks.order, planned)):
            if want != got:
                raise ValueError(
                    f"the placement puts layer {got!r} at position {i}, but the model runs {want!r} there "
                    f"(execution order: {', '.join(self._hooks.order)}); stages must follow execution order. "
                    "Re-plan with torchspan.plan(model, x, ...) or pass devices and balance"
                )
        self._order_checked = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Pipelined forward; outputs concatenated on dim 0 on the last stage's device."""
        fns, chunks = self._prepare(args, kwargs)
        last = self._devices[-1]
        if fns is None:
            self._ensure_placed(*chunks[0])
            assert self._hooks is not None
            outs = []
            with self._step():
                for i, (a, k) in enumerate(chunks):
                    a, k = self._to_first_stage(a, k)
                    with self._hooks.recording(i, checkpointed(self.checkpoint, i, self.microbatches)):
                        outs.append(self.module(*a, **k))
            self._check_hook_order()
            return gather(outs, last)
        with self._step():
            outs = self._pipeline.forward(fns, chunks, self._stage_buffers())
        return gather(outs, last)

    def train_step(
        self,
        inputs: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        loss_reduction: str | None = None,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch by the schedule; returns the full-batch loss (detached).

        ``inputs``: a tensor (one argument), a tuple (positional arguments) or a dict (keyword
        arguments). Gradients are *added* to ``.grad`` exactly as ``loss_fn(model(inputs),
        target).backward()`` would on one device. The reduction is read from ``loss_fn.reduction``
        (``loss_reduction="mean"``/``"sum"`` for plain functions): each micro-batch's mean loss is
        weighted by its share of the loss's normalizer, i.e. of the samples, or for
        ``CrossEntropyLoss``/``NLLLoss`` of the class weights of the non-ignored targets.
        Call ``optimizer.zero_grad()`` first as usual; with ``precision="fp16"`` step with
        ``spanned.step(optimizer)``.
        """
        if not callable(loss_fn):
            raise TypeError(f"loss_fn={loss_fn!r} is not callable; pass e.g. torch.nn.functional.mse_loss")
        if isinstance(inputs, tuple):
            args, kwargs = inputs, {}
        elif isinstance(inputs, Mapping):
            args, kwargs = (), dict(inputs)
        else:
            args, kwargs = (inputs,), {}
        if not torch.is_grad_enabled():
            raise RuntimeError("train_step runs backward, but gradients are disabled here (torch.no_grad()); call it outside no_grad")
        fns, chunks = self._prepare(args, kwargs)
        total = batch_size(args, kwargs)
        sizes = split_sizes(total, self.microbatches)
        reduction = resolve_reduction(loss_fn, loss_reduction)
        targets = split_value(target, self.microbatches, total, name="target")
        weights = microbatch_weights(loss_fn, targets, sizes, reduction)
        if isinstance(loss_fn, nn.Module):
            loss_fn.to(self._devices[-1])
        if fns is None:
            return self._train_hooks(chunks, targets, loss_fn, weights)
        with self._step():
            return self._pipeline.train(fns, chunks, targets, loss_fn, weights, self.schedule, self.scaler, self._stage_buffers())

    def _to_first_stage(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Hook mode: inputs go to stage 0's device before the model's own forward touches them
        (its code may use them before calling the first child, e.g. ``x + self.shift``)."""
        dev = self._devices[0]
        return to_device((args, kwargs), dev, non_blocking=dev.type == "cuda")

    def _train_hooks(self, chunks: list[Any], targets: list[Any], loss_fn: Callable[..., Any], weights: list[float]) -> torch.Tensor:
        self._ensure_placed(*chunks[0])
        hp = self._hooks
        assert hp is not None
        losses = []
        with self._step():
            for i, (a, k) in enumerate(chunks):
                a, k = self._to_first_stage(a, k)
                with hp.recording(i, checkpointed(self.checkpoint, i, self.microbatches)):
                    out = self.module(*a, **k)
                self._check_hook_order()
                leaf = next((t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)
                dev = leaf.device if leaf is not None else self._devices[-1]
                with autocast_for(dev, self.precision):
                    loss = weighted_loss(loss_fn, out, to_device(targets[i], dev), weights[i])
                hp.backward(i, self.scaler.scale(loss) if self.scaler is not None else loss)
                losses.append(loss.detach().to(self._devices[-1]).float())
        return torch.stack(losses).sum()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; with ``precision="fp16"`` through the gradient scaler (unscale, skip on inf, update)."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    # ------------------------------------------------------------------ observing
    def timeline(self) -> list[Any]:
        """The ``torchspan.runtime.record.Event``s of the most recent step (forward call or ``train_step``)."""
        return list(self._recorder.events)

    def memory(self, optimizer: torch.optim.Optimizer | None = None) -> list[dict[str, Any]]:
        """Bytes per stage: ``params``, ``grads``, ``buffers``, ``optimizer``, ``activations``, ``device_peak``.

        ``activations`` is the peak of live saved activations during the last step, counted
        exactly (saved-tensor hooks). ``optimizer`` is 0 unless you pass the optimizer, which
        torchspan does not otherwise see. ``device_peak`` is ``torch.cuda.max_memory_allocated``
        since the last step began (CUDA stages; ``None`` elsewhere).
        """
        stage_of = self.stage_of
        per_stage: list[dict[str, Any]] = []
        owned: list[list[torch.Tensor]] = [[] for _ in self._devices]
        bufs: list[list[torch.Tensor]] = [[] for _ in self._devices]
        seen: set[int] = set()
        for name, child in self.module.named_children():
            s = stage_of.get(name, 0)
            for p in child.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    owned[s].append(p)
            for b in child.buffers():
                bufs[s].append(b)
        for name, p in self.module._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                owned[self._root_attrs.get(name, 0)].append(p)
        for name, b in self.module._buffers.items():
            if b is not None:
                bufs[self._root_attrs.get(name, 0)].append(b)
        state = optimizer.state if optimizer is not None else {}
        for s, dev in enumerate(self._devices):
            opt_bytes = 0
            for p in owned[s]:
                for v in state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        opt_bytes += v.numel() * v.element_size()
            per_stage.append(
                {
                    "stage": s,
                    "device": str(dev),
                    "layers": list(self._groups[s]),
                    "params": sum(p.numel() * p.element_size() for p in owned[s]),
                    "grads": sum(p.grad.numel() * p.grad.element_size() for p in owned[s] if p.grad is not None),
                    "buffers": sum(b.numel() * b.element_size() for b in bufs[s]),
                    "optimizer": opt_bytes,
                    "activations": self._meter.peak[s],
                    "device_peak": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
                }
            )
        return per_stage

    # ------------------------------------------------------------------ state and placement
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:  # type: ignore[override]
        """The original model's state dict (same keys as ``spanned.module.state_dict()``)."""
        if args:
            raise TypeError("Spanned.state_dict takes keyword arguments only (destination=, prefix=, keep_vars=)")
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load the original model's keys; keys with a ``module.`` prefix (DataParallel/DDP) work too.

        Values are copied into the placed parameters, whatever device they were saved from.
        """
        if assign:
            raise ValueError(
                "load_state_dict(assign=True) would replace the placed parameters with the loaded tensors on their "
                "saved devices; torchspan owns placement, so use assign=False (values are copied in place)"
            )
        if state_dict and all(k.startswith("module.") for k in state_dict):
            state_dict = {k[len("module.") :]: v for k, v in state_dict.items()}
        return self.module.load_state_dict(state_dict, strict=strict)

    def _apply(self, fn: Any, recurse: bool = True) -> Spanned:  # type: ignore[override]
        """``half()``/``float()`` work; anything that would move a stage off its device (``parent.cuda()``) raises."""
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            moved = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            if isinstance(moved, torch.Tensor) and moved.device != t.device:
                raise TypeError(f"moving a Spanned's tensors from {t.device} to {moved.device} is not supported: {_PLACEMENT_MSG}")
        return super()._apply(fn, recurse)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a Spanned cannot be pickled, saved whole or deep-copied (it holds worker state and a device placement). "
            "Save spanned.state_dict() (or torch.save(spanned.module)); to copy, span a copy of the model: "
            "torchspan.span(copy.deepcopy(spanned.module), devices=spanned.devices, balance=spanned.balance)"
        )

    def to(self, *args: Any, **kwargs: Any) -> Spanned:  # type: ignore[override]
        raise TypeError(f"Spanned.to(...) is not supported: {_PLACEMENT_MSG}")

    def cuda(self, device: Any = None) -> Spanned:  # type: ignore[override]
        raise TypeError(f"Spanned.cuda() is not supported: {_PLACEMENT_MSG}")

    def cpu(self) -> Spanned:  # type: ignore[override]
        raise TypeError(f"Spanned.cpu() is not supported: {_PLACEMENT_MSG}")

    def extra_repr(self) -> str:
        stages = "; ".join(f"{d}: {', '.join(g)}" for d, g in self.stages)
        return (
            f"mode={self.mode}, microbatches={self.microbatches}, schedule={self.schedule}, "
            f"checkpoint={self.checkpoint}, precision={self.precision}, stages=[{stages}]"
        )

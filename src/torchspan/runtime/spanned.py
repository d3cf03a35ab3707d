"""``Spanned``: one model trained across devices or processes, exact gradients.

``Spanned`` is a façade over an executor (``runtime.executor``; ``span`` in ``runtime.build``
chooses it): it opens and closes each step (timeline, activation meter), applies the loss
contract, and keeps the original model's state-dict keys. Placement and execution are the executor's.

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
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .executor import Executor, Settings
from .footprint import stage_memory
from .fp16 import SpanScaler
from .gradients import clip_grad_norm, guard_plain_clip, holding
from .losscheck import LossChecks, dry_run
from .lossweights import loss_spec
from .memory import ActivationMeter, behaviour_key
from .microbatch import batch_size, call_args, gather, split_sizes, split_value
from .modelloss import combiner, model_loss
from .nonfinite import NONFINITE, check_loss, locate
from .placed import PlacedModule
from .record import Event, Recorder

__all__ = ["Spanned"]


def _warn_batchnorm(spanned: Any, modules: list[nn.Module]) -> None:
    """Warn once: BatchNorm in training mode normalises per micro-batch, not over the full batch (``modules``:
    the model's)."""
    if spanned.microbatches == 1 or getattr(spanned, "_bn_warned", False) or not torch.is_grad_enabled():
        return
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in modules):
        return
    names = [
        name
        for name, m in spanned.module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and m.training
        and (m.track_running_stats or m.running_mean is None)
    ]
    if names:
        spanned._bn_warned = True
        shown = ", ".join(repr(n) for n in names[:3]) + (
            f" and {len(names) - 3} more" if len(names) > 3 else ""
        )
        warnings.warn(
            f"BatchNorm layer(s) {shown} in training mode normalise over each micro-batch, not the full "
            f"batch, so with microbatches={spanned.microbatches} gradients and running statistics differ "
            "from single-device training. For identical results use microbatches=1, GroupNorm/LayerNorm, "
            "or put those layers in eval mode.",
            UserWarning,
            stacklevel=4,
        )


class Spanned(PlacedModule):
    """A model whose layers live on several devices, trained with micro-batch pipelining.

    ``module`` is the original model; ``mode`` says how it runs: ``"sequential"`` / ``"fx"`` (stage
    functions), ``"own-forward"`` (the model's own forward, micro-batches pipelined), ``"own-forward-serial"``
    (own forward, micro-batches one after another), ``"data-parallel"`` (a launched job's replica) or
    ``"sharded"`` (that replica sharded by FSDP2: ``span(model, shard=True)``; ``offload`` says where its
    states live); ``stages`` lists each stage's ``(device, layers)``. Outputs of ``spanned(...)`` are the
    micro-batch outputs concatenated on dim 0 on the last stage's device.
    """

    def __init__(
        self,
        model: nn.Module,
        executor: Executor,
        settings: Settings,
        recorder: Recorder,
        meter: ActivationMeter,
        *,
        mode_reason: str = "",
    ) -> None:
        """Wrap ``model`` run by ``executor`` (which records into ``recorder`` and ``meter``); ``span`` builds
        these."""
        super().__init__()
        self.module = model
        self.mode = executor.mode
        self.mode_reason = mode_reason
        self._settings = settings
        self._executor = executor
        self._recorder = recorder
        self._meter = meter
        self._loss_checks = LossChecks()  # opaque losses calibrated, per batch structure

    # ------------------------------------------------------------------ settings and placement
    @property
    def microbatches(self) -> int:
        return self._settings.microbatches

    @property
    def schedule(self) -> str:
        return self._settings.schedule

    @property
    def recompute(self) -> str:
        """Activation recompute: ``"never"``, ``"except_last"`` or ``"always"``."""
        return self._settings.recompute

    @property
    def checkpoint(self) -> str:
        """Deprecated name of ``recompute`` (``checkpoint`` now means checkpoint files only)."""
        warnings.warn("Spanned.checkpoint is now Spanned.recompute", FutureWarning, stacklevel=2)
        return self._settings.recompute

    @property
    def precision(self) -> str:
        return self._settings.precision

    @property
    def offload(self) -> str | None:
        """Where a sharded replica keeps its parameters, gradients and optimizer state: ``"cpu"`` or ``None``
        (its device)."""
        return getattr(self._executor, "offload", None)

    @property
    def workers(self) -> str:
        return self._settings.workers

    @property
    def scaler(self) -> Any:
        """The fp16 ``torch.amp.GradScaler`` (``None`` for other precisions)."""
        return self._settings.scaler

    @property
    def stage_of(self) -> dict[str, int]:
        return self._executor.stage_of

    @property
    def stages(self) -> list[tuple[str, list[str]]]:
        """``[(device, [layer names]), ...]`` in stage order."""
        return [(str(d), list(g)) for d, g in zip(self._executor.devices, self._executor.groups)]

    @property
    def devices(self) -> list[str]:
        return [str(d) for d in self._executor.devices]

    @property
    def mesh(self) -> Any:
        """The job's ``DeviceMesh`` (``runtime.ranks.devicemesh``), its dimensions by name in torchtitan's
        order (``pp``, ``dp_replicate``, ``dp_shard``, ``tp``) for every launched strategy; ``None`` in one
        process."""
        return self._settings.mesh

    @property
    def data_parallel(self) -> tuple[int, int]:
        """``(this process's replica, replicas)``: rows are sharded over replicas; a pipeline's stages share
        them."""
        return self._executor.replica_of()

    @property
    def balance(self) -> list[int]:
        return [len(g) for g in self._executor.groups]

    # ------------------------------------------------------------------ running
    @contextlib.contextmanager
    def _step(self, loss: Any = None) -> Iterator[None]:
        """One recorded step: counters reset on entry, the timeline closed on exit (also on error).

        ``loss``: what of the loss decides the tensors a training step saves (``_meter_state``)."""
        modules = list(self.module.modules())  # one walk for the checks below
        _warn_batchnorm(self, modules)
        devices = self._executor.devices
        self._recorder.start_step(devices)
        if self._executor.meters():  # a data-parallel replica meters its first training step only
            tensors = [
                t for m in modules for t in (*m._parameters.values(), *m._buffers.values()) if t is not None
            ]
            self._meter.reset(tensors, state=self._meter_state(tensors, modules, loss))
        for d in dict.fromkeys(devices):
            if d.type == "cuda":  # pragma: no cover - needs a GPU
                torch.cuda.reset_peak_memory_stats(d)
        try:
            yield
        finally:
            self._recorder.finish_step()

    def _meter_state(self, tensors: list[torch.Tensor], modules: list[nn.Module], loss: Any) -> Any:
        """Besides the micro-batches' shapes, what decides the tensors a step saves: the loss, which
        parameters train, train/eval modes, autocast; a step like the last metered one from the same state is
        not metered again (``memory.MeteredSteps``)."""
        types = dict.fromkeys(d.type for d in self._executor.devices)
        autocast = tuple((t, torch.is_autocast_enabled(t)) for t in types if t in ("cpu", "cuda"))
        return loss, tuple(t.requires_grad for t in tensors), tuple(m.training for m in modules), autocast

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Pipelined forward; outputs concatenated on dim 0 on the last stage's device.

        With ``labels=`` the model's own ``loss`` of each micro-batch is combined into the whole batch's
        (weighed as ``train_step(batch)`` weighs it), so ``spanned(**batch).loss`` is one device's."""
        self._executor.plain_forward(self.module.training)
        work = self._executor.prepare(args, kwargs)
        self._executor.place(work)
        with self._step():
            outs = self._executor.forward(work)
        dev = self._executor.devices[-1]
        out = gather(outs, dev, loss=self._own_loss(args, kwargs, outs, dev))
        return self._executor.plain_output(out, kwargs, self._check_plain_loss)

    def _check_plain_loss(self, loss: torch.Tensor) -> None:
        """An inf/NaN loss of the plain loop (on a replica) raises or warns as ``train_step``'s does."""
        check_loss(loss, self.nonfinite, getattr(self, "_train_steps", 0) + 1, lambda: "")

    def _own_loss(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[Any], dev: torch.device
    ) -> Any:
        """``combine(chunk losses)`` for a forward given ``labels``: the whole batch's loss
        (``modelloss``)."""
        return combiner(kwargs, outs, batch_size(args, kwargs), dev)

    def train_step(
        self,
        inputs: Any,
        target: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        loss_reduction: str | None = None,
        loss_normalizer: Callable[[Any], Any] | None = None,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch by the schedule; returns the full-batch loss (detached).

        ``inputs``: a tensor (one argument), a tuple (positional arguments) or a dict (keyword
        arguments). Gradients are *added* to ``.grad`` exactly as ``loss_fn(model(inputs),
        target).backward()`` would on one device, or torchspan refuses before any backward.

        **The model's own loss**: ``train_step(batch)`` with ``labels`` in the batch (what a transformers
        data collator gives) and no ``target``/``loss_fn`` trains on ``model(**batch).loss``, as on one
        device: each chunk's loss is weighed by its share of what the whole batch's mean divides by,
        found by recomputing the loss from the chunk's logits once per batch structure
        (``runtime.modelloss``); a loss that does not split exactly (an MoE auxiliary loss) is refused.

        **Your own loss**: ``loss_fn(outputs, target)``.
        Each micro-batch's loss is weighted by its share of what the loss divides by, read from
        loss modules, ``torch.nn.functional`` losses and ``functools.partial`` of either: the
        samples, or for ``CrossEntropyLoss``/``NLLLoss`` the class weights of non-ignored targets
        (1 for ``reduction="sum"``). Any other callable is calibrated on its first batch (and when
        the split, target shapes or count of negative labels change): one extra no-grad forward,
        random state and buffers left as they were, finds whether it is a per-sample mean or a
        sum (measured: about 0.3x of one step on a small MLP, once, not per step:
        benchmarks/loss_calibration.py); if neither reproduces the full-batch value, ``ValueError`` names both
        values and the ways out.
        Declare it: ``loss_reduction="sum"`` / ``"mean"``; or give
        ``loss_normalizer=`` what its mean divides by for a chunk's target, e.g.
        ``lambda y: (y != -100).sum()`` for a token mean with padding (a declaration is verified on the
        first batch and whenever its structure changes, like a calibration, and refused with both values when
        wrong). Call ``optimizer.zero_grad()`` first and ``optimizer.step()`` after, as usual (clip with
        ``spanned.clip_grad_norm_``); with ``precision="fp16"`` ``.grad`` comes back unscaled and an
        overflowed step is skipped by the optimizer, as ``GradScaler`` skips it (``runtime.fp16``). An
        inf/NaN loss raises ``FloatingPointError`` (``span(..., nonfinite="warn")`` warns instead).
        """
        inputs, target, spec = self._loss_of(inputs, target, loss_fn, loss_reduction, loss_normalizer)
        loss_fn = spec.loss_fn
        args, kwargs = call_args(inputs)
        work = self._executor.prepare(args, kwargs)
        total = batch_size(args, kwargs)
        empty = total == 0 and self._executor.empty_batches  # a data-parallel rank's empty shard adds zero
        sizes = (
            [0] if empty else split_sizes(total, len(work.chunks))
        )  # a data-parallel shard may hold fewer rows
        targets = split_value(target, len(sizes), total, name="target")
        if isinstance(loss_fn, nn.Module):
            loss_fn.to(self._executor.devices[-1])
        self._executor.place(work)
        spec = self._executor.resolve_loss(
            self._loss_checks, spec, targets, sizes, lambda: self._dry_forward(work), target
        )
        weights = self._executor.weights(spec, targets, sizes)
        with self._step((behaviour_key(loss_fn), tuple(w == 0.0 for w in weights))), self._finishing():
            loss = self._executor.train(work, targets, loss_fn, weights, spec)
        shard = (
            getattr(getattr(self._executor, "info", None), "rank", None)
            if self.mode in ("data-parallel", "sharded")
            else None
        )
        self._after_train(
            loss,
            lambda: locate(
                lambda: self._dry_forward(work), loss_fn, targets, weights, sizes, self.precision, shard
            ),
        )
        return loss

    def _loss_of(
        self,
        inputs: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        loss_reduction: str | None,
        loss_normalizer: Callable[[Any], Any] | None,
    ) -> tuple[Any, Any, Any]:
        """``train_step``'s refusals before any work (nothing to train, no target, a meta stage, no_grad) and
        its loss: ``(inputs, target, LossSpec)``, the model's own loss when ``loss_fn`` is None
        (``modelloss``)."""
        # a rank of a pipeline holds other stages' parameters as frozen meta copies: they still count
        if not any(p.requires_grad or p.device.type == "meta" for p in self.module.parameters()):
            raise ValueError(
                f"train_step: the model ({type(self.module).__name__}) has no parameter that requires "
                "grad, so there is nothing to train and no backward to run; span the model with its "
                "weights, or unfreeze them (p.requires_grad_())"
            )
        if loss_fn is None:
            inputs, target, spec = model_loss(inputs, target, loss_reduction, loss_normalizer)
        else:
            spec = loss_spec(loss_fn, loss_reduction, loss_normalizer)
            if (
                target is None
                and spec.kind != "opaque"
                and not (spec.declared and spec.kind in ("sum", "samples"))
            ):
                raise ValueError(
                    f"train_step(inputs, target=None, loss_fn={spec.name}): this loss compares the outputs "
                    "with a target; pass the target, or train_step(batch) with batch['labels'] to train on "
                    "the model's own loss"
                )
        meta = [str(d) for d in self._executor.devices if d.type == "meta"]
        if meta:
            raise ValueError(
                f"train_step on a span with stage(s) on {meta[0]}: meta tensors hold shapes, not values, "
                "so nothing can be trained there (a meta stage is for tracing shapes with spanned(...) under "
                "torch.no_grad()); span the model on real devices, e.g. devices=['cpu', 'cpu']"
            )
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "train_step runs backward, but gradients are disabled here (torch.no_grad()); call it "
                "outside no_grad"
            )
        return inputs, target, spec

    def _dry_forward(self, work: Any) -> list[Any]:
        """Per-micro-batch outputs of a forward that leaves no trace (for a loss calibration)."""
        with dry_run(self.module, self._executor.devices):
            return self._executor.forward(work)

    def join(self, optimizer: torch.optim.Optimizer | None = None) -> int:
        """After the training loop, on every rank of a data-parallel job: take part in the other ranks'
        remaining steps with empty shards until all have joined (uneven epoch ends never hang).

        Pass the ``optimizer`` your loop steps (``zero_grad(); train_step(...); step()``) so a shadowed
        step steps it too and every rank's parameters and optimizer state stay identical. Returns the
        number of steps shadowed; 0 in one process. A pipeline across ranks refuses it (give every rank
        the same number of steps with ``rank_batches``).
        """
        return self._executor.join(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``, the same as calling it yourself: with ``precision="fp16"`` ``train_step``
        already left ``.grad`` unscaled, an overflowed step's gradients are dropped (the optimizer skips them)
        and the scale is updated when it steps (``runtime.fp16``)."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        if not isinstance(self.scaler, SpanScaler):  # a plain GradScaler given in Settings
            self.scaler.update()

    @property
    def nonfinite(self) -> str:
        """What ``train_step`` does when the loss is inf/NaN: ``"raise"`` (``FloatingPointError``, the
        default) or ``"warn"``; settable (``spanned.nonfinite = "warn"``) or ``span(..., nonfinite=)``
        (``runtime.nonfinite``)."""
        return getattr(self._settings, "nonfinite", "raise")

    @nonfinite.setter
    def nonfinite(self, value: str) -> None:
        if value not in NONFINITE:
            raise ValueError(f"nonfinite={value!r} is not one of {', '.join(map(repr, NONFINITE))}")
        self._settings.nonfinite = value

    @property
    def loss_reduction(self) -> str | None:
        """The plain loop's loss on data-parallel replicas, declared: ``None`` (torchspan reads torch's losses
        applied to the outputs and refuses others), ``"sum"`` (any loss summing over rows) or ``"mean"`` (a
        mean over the rows of each rank's shard); settable, or ``span(..., loss_reduction=)``
        (``ranks.plainloop``)."""
        return self._settings.loss_reduction

    @loss_reduction.setter
    def loss_reduction(self, value: str | None) -> None:
        if value not in (None, "mean", "sum"):
            raise ValueError(f"loss_reduction={value!r} is not one of None, 'mean', 'sum'")
        self._settings.loss_reduction = value

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` as on one device with the whole model.

        Same arguments, same clipping, same returned total norm, for every strategy: stages on several
        devices, a data-parallel replica, a pipeline across ranks (the norm is taken over every stage's
        gradients: call it on every rank), replicas of a pipeline; a tied parameter counts once. Call it
        after ``train_step`` and before ``optimizer.step()``. On a pipeline rank the plain torch call would
        clip each stage by its own norm, so it raises, naming this method (``runtime.gradients``).
        ``max_norm=float("inf")`` gives the total norm without clipping.
        """
        overflowed = isinstance(self.scaler, SpanScaler) and self.scaler.overflowed
        return clip_grad_norm(
            holding(self.module, self._executor), max_norm, norm_type, error_if_nonfinite, foreach, overflowed
        )

    def _finishing(self) -> contextlib.AbstractContextManager[None]:
        """Around the executor's training step: with fp16, its gradients unscaled and checked
        (``runtime.fp16``)."""
        if not isinstance(self.scaler, SpanScaler):
            return contextlib.nullcontext()
        return self.scaler.finishing(
            [p for p in self.module.parameters() if p.requires_grad and p.device.type != "meta"]
        )

    def _after_train(self, loss: torch.Tensor, where: Callable[[], str]) -> None:
        """After a training step: count it, guard a pipeline rank's gradients from a plain torch clip, check
        the loss."""
        self._train_steps = getattr(self, "_train_steps", 0) + 1
        ranks = getattr(self._executor, "ranks", None)
        if ranks is not None and ranks.mesh.stages > 1:
            guard_plain_clip(ranks)
            where = lambda: ""  # naming the micro-batch would re-run a forward across ranks: the step only
        skipped = isinstance(self.scaler, SpanScaler) and self.scaler.overflowed
        check_loss(loss, self.nonfinite, self._train_steps, where, skipped)

    # ------------------------------------------------------------------ observing
    def timeline(self) -> list[Event]:
        """The ``torchspan.runtime.record.Event``s of the most recent step (forward call or
        ``train_step``)."""
        return list(self._recorder.events)

    def memory(self, optimizer: torch.optim.Optimizer | None = None) -> list[dict[str, Any]]:
        """Bytes per stage: ``params``, ``grads``, ``buffers``, ``optimizer``, ``activations``,
        ``device_peak``.

        ``activations`` is the peak of live saved activations during the last step, counted
        exactly (saved-tensor hooks); a stage-function pipeline's training step that repeats the last metered
        one (micro-batch shapes, loss, trainable parameters, train/eval modes, from the same live activations)
        reports that step's peak without the hooks: the same bytes, unless the sizes the model saves depend
        on the values (boolean-mask indexing); for a launched data-parallel replica
        (``mode="data-parallel"``), during its first training step that saved any (later steps run unmetered,
        at the bare replica's cost; its shards repeat that shape). ``optimizer`` is 0 unless you pass the
        optimizer, which torchspan does not otherwise see. ``device_peak`` is
        ``torch.cuda.max_memory_allocated`` since the last step began (CUDA stages; ``None`` elsewhere).
        """
        ex = self._executor
        return stage_memory(
            self.module, ex.devices, ex.groups, ex.root_attrs, self._meter.peak, optimizer, ex.placed_layers()
        )

    def extra_repr(self) -> str:
        stages = "; ".join(f"{d}: {', '.join(g)}" for d, g in self.stages)
        return (
            f"mode={self.mode}, microbatches={self.microbatches}, schedule={self.schedule}, "
            f"recompute={self.recompute}, precision={self.precision}, stages=[{stages}]"
        )

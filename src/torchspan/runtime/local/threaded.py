"""The own-forward executor: micro-batches overlap across stages with the model's own, unmodified forward.

For models that are neither an ``nn.Sequential`` nor fx-traceable (every transformers model). One
thread per micro-batch calls ``model(...)``; a forward pre-hook on each layer moves the layer's
inputs to its stage's device and makes the thread wait for its turn on that stage
(``turns.Turns``: the order of ``torchspan.schedule``, stages sharing a worker taking turns as in
the pipelined mode). So micro-batch 1 runs stage 0 while micro-batch 0 runs stage 1.

Each thread then calls ``backward`` on its weighted loss (autograd runs concurrent backward calls
and accumulates ``.grad`` safely). When every stage is on the CPU, autograd runs each backward in
the thread that called it, so backward takes turns too: a gradient hook on the tensors that
crossed into a stage moves the micro-batch's backward to the stage that produced them, waiting
for its turn there (GPipe: all forwards, then backwards; 1F1B: a backward as soon as the
schedule allows, which bounds the micro-batches in flight per stage). Autograd runs GPU backward
on its own per-device threads, which must never block: there, only the start of each backward
takes turns on the last stage, and the hooks just mark the timeline.

``schedule="interleaved-1f1b"`` with the stages looped over the devices (stage ``s`` on the worker of
device ``s % P``) takes Megatron's turns per worker, a micro-batch's forward and backward waiting at each
stage for that stage's turn as under any schedule. ``schedule="zero-bubble"`` and ``"merged-weights"``
run here in 1F1B's order with whole backwards (each micro-batch's backward is one autograd call crossing
the stages, which cannot be split in two); across ranks (``ranks.ownforward``) and with stage functions
they are split.

Recompute and precision are per micro-batch and per stage (``layercall``), entered inside each
thread (autocast and grad mode are thread-local). Limitation: with ``recompute`` on a CPU stage
whose layers draw random numbers (dropout) while a GPU stage runs backward unordered, a recompute
can replay a different mask; use ``recompute="never"`` or dropout 0 there.

Usage (``span`` does this)::

    ex = OwnForwardExecutor(model, devices, groups, settings, recorder, meter, balance_given=False)
    work = ex.prepare((x,), {}); ex.place(work); loss = ex.train(work, targets, loss_fn, weights, spec)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ... import schedule as sched
from ...hardware import to_device
from ..executor import Executor, Settings, Work
from ..layercall import LayerCalls, autocast_for, recomputes
from ..lossweights import LossSpec, weighted_loss
from ..memory import ActivationMeter
from ..record import Recorder
from ..ties import Hook
from .looped import INTERLEAVED, looped_workers
from .placed import PlacedModel
from .turns import Flow, Turns, orders
from .worker import Aborted, Mailbox, intra_op_threads, note_failure, run_workers, worker_groups

__all__ = ["OwnForwardExecutor"]


class OwnForwardExecutor(Executor):
    """A ``PlacedModel`` run by one thread per micro-batch (options: as ``OwnForwardLayers``).

    ``PlacedModel``'s pre-hooks still move each layer's inputs; this executor adds, in front of
    them, the pre-hooks that take turns, and runs the steps itself.
    """

    mode = "own-forward"

    def __init__(
        self,
        model: nn.Module,
        devices: Sequence[torch.device],
        groups: Sequence[Sequence[str]],
        settings: Settings,
        recorder: Recorder,
        meter: ActivationMeter,
        **options: Any,
    ) -> None:
        self.model, self.settings, self.recorder, self.meter = model, settings, recorder, meter
        self._local = threading.local()
        self._turn_handles: list[Any] = []
        # Autograd runs CPU backward in the calling thread (it may wait for a turn); GPU backward on
        # shared device threads (it must not).
        self.ordered_backward = all(torch.device(d).type == "cpu" for d in devices)
        self.placed = PlacedModel(model, devices, groups, settings, recorder, meter, **options)
        self.placed.on_placed.append(self._add_turn_hooks)
        self.placed.place_now()

    @property
    def devices(self) -> list[torch.device]:  # type: ignore[override]
        return self.placed.devices

    @property
    def groups(self) -> list[list[str]]:  # type: ignore[override]
        return self.placed.groups

    @property
    def root_attrs(self) -> dict[str, int]:  # type: ignore[override]
        return self.placed.root_attrs

    def placed_layers(self) -> Mapping[str, nn.Module] | None:
        return self.placed.layers

    @staticmethod
    def unsupported(devices: Sequence[torch.device], microbatches: int, recompute: str) -> str:
        """Why these settings cannot be pipelined by threads ("" when they can); ``span`` then runs them
        serially."""
        if len(devices) == 1 or microbatches == 1:
            return "pipelining needs more than one stage and microbatches > 1"
        if recompute != "never" and any(torch.device(d).type != "cpu" for d in devices):
            return (
                f"recompute={recompute!r} with a non-CPU stage is not threaded, since recomputes on "
                "autograd's device threads could replay another micro-batch's random state; use "
                "recompute='never' to pipeline"
            )
        return ""

    # ------------------------------------------------------------------ placement
    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
        return self.placed.prepare(args, kwargs)

    def place(self, work: Work) -> None:
        self.placed.place(work)

    def _add_turn_hooks(self) -> None:
        stage_of = self.placed.stage_of
        for name, module in self.placed.layers.items():
            if name in stage_of:  # in front of the input-moving hooks: wait for the turn, then move
                hook = Hook(self._pre(name, stage_of[name]))
                self._turn_handles.append(
                    module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
                )

    # ------------------------------------------------------------------ hooks
    def _pre(self, name: str, stage: int) -> Callable[..., Any]:
        def hook(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            flow: Flow | None = getattr(self._local, "flow", None)
            came_from = flow.current if flow is not None else None
            entered = flow is not None and flow.go(stage, name)
            back: Flow | None = getattr(self._local, "back", None)
            if entered and back is not None and came_from is not None and torch.is_grad_enabled():
                # Gradients reaching what crossed into this stage: backward moves on to the stage it came
                # from.
                for t in tree_leaves((args, kwargs)):
                    if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                        t.register_hook(_arrival(back, came_from))

        return hook

    # ------------------------------------------------------------------ running
    def _worker_groups(self) -> list[list[int]]:
        """The stages each worker thread runs (``worker_groups`` of the devices and ``workers=``)."""
        return worker_groups(self.devices, per_stage=self.settings.workers == "stage")

    def _run(
        self, schedule: list[list[sched.Action]], backward: str, job: Callable[[Turns, int], None]
    ) -> None:
        """``job(turns, mb)`` for every micro-batch, one thread each; the first error is re-raised here."""
        m = self.settings.microbatches
        groups = self._worker_groups()
        group_orders = orders(schedule, groups, backward=backward)
        threads = intra_op_threads(self.devices, groups, limit=m)
        local = self._local
        state: dict[str, Turns] = {}
        lock = threading.Lock()

        def make(mb: int) -> Callable[[Mailbox], None]:
            def run(box: Mailbox) -> None:
                if threads is not None:
                    torch.set_num_threads(threads)
                with lock:  # the first thread deals the turns into the step's mailbox
                    if "turns" not in state:
                        state["turns"] = Turns(box, group_orders)
                try:
                    job(state["turns"], mb)
                except Aborted:
                    raise
                except BaseException as exc:
                    _note(exc, local, self.devices, mb)
                    raise
                finally:
                    local.flow = local.back = None

            return run

        s, p = self.settings, self.placed
        calls = LayerCalls(p.layers, p.stage_of, self.devices, s.precision, p.hooks.copies)
        with calls.installed(
            lambda: getattr(local, "recompute", False), may_recompute=s.recompute != "never"
        ):
            run_workers([make(i) for i in range(m)], names=[f"torchspan-microbatch-{i}" for i in range(m)])

    def _start(self, turns: Turns, mb: int, *, backward: bool) -> tuple[Flow, Flow | None]:
        """This thread's flows for micro-batch ``mb`` (and whether it recomputes)."""
        n, s = len(self.devices), self.settings
        fwd = Flow(turns, sched.FORWARD, mb, n, self.recorder, self.devices)
        back = None
        if backward:
            back = Flow(
                turns if self.ordered_backward else None, sched.BACKWARD, mb, n, self.recorder, self.devices
            )
        self._local.flow, self._local.back = fwd, back
        self._local.recompute = recomputes(s.recompute, mb, s.microbatches)
        return fwd, back

    def _model_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        args, kwargs = self.placed.to_first_stage(args, kwargs)
        with self.meter.saving(self.placed.hooks.current_stage):  # the stage whose layer runs in this thread
            return self.model(*args, **kwargs)

    def forward(self, work: Work) -> list[Any]:
        _ = self.placed.hooks  # raises if not placed yet
        m, n = self.settings.microbatches, len(self.devices)
        outs: list[Any] = [None] * m

        def job(turns: Turns, mb: int) -> None:
            fwd, _ = self._start(turns, mb, backward=False)
            a, k = work.chunks[mb]
            outs[mb] = self._model_forward(a, k)
            fwd.finish()

        self._run(sched.forward_only(m, n), "none", job)
        return outs

    def train(
        self,
        work: Work,
        targets: Sequence[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        weights: Sequence[float],
        spec: LossSpec | None = None,
    ) -> torch.Tensor:
        _ = self.placed.hooks  # raises if not placed yet
        s, n, last = self.settings, len(self.devices), self.devices[-1]
        losses: list[torch.Tensor | None] = [None] * s.microbatches

        def job(turns: Turns, mb: int) -> None:
            fwd, back = self._start(turns, mb, backward=True)
            assert back is not None
            a, k = work.chunks[mb]
            out = self._model_forward(a, k)
            leaf = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
            dev = leaf.device if leaf is not None else last
            with autocast_for(dev, s.precision):
                loss = weighted_loss(loss_fn, out, to_device(targets[mb], dev), weights[mb])
            fwd.finish()
            if not self.ordered_backward:  # only the start of backward takes turns
                turns.take(sched.BACKWARD, n - 1, mb)
                turns.give(sched.BACKWARD, n - 1, mb)
            back.go(n - 1)
            if loss.requires_grad:
                (s.scaler.scale(loss) if s.scaler is not None else loss).backward()
            back.finish()
            losses[mb] = loss.detach().to(last).float()

        # split schedules run as 1F1B here: each micro-batch's backward is one autograd call across the
        # stages, not split
        schedule = "1f1b" if s.schedule in ("zero-bubble", "merged-weights") else s.schedule
        # interleaved: stages looped over the workers (choose checked it), Megatron's order per worker
        workers = looped_workers(self._worker_groups(), n) if schedule == INTERLEAVED else None
        plan = sched.build(schedule, s.microbatches, n, workers)
        self._run(plan, "all" if self.ordered_backward else "start", job)
        return torch.stack([t for t in losses if t is not None]).sum()


def _arrival(back: Flow, producer: int) -> Callable[[torch.Tensor], None]:
    """A gradient hook: this micro-batch's backward has reached what ``producer`` handed on."""

    def on_grad(_grad: torch.Tensor) -> None:
        back.go(producer)

    return on_grad


def _note(exc: BaseException, local: threading.local, devices: Sequence[torch.device], mb: int) -> None:
    """Say where a micro-batch thread failed (stage, device, forward or backward), once."""
    where = ""
    for flow in (getattr(local, "back", None), getattr(local, "flow", None)):
        if flow is not None and flow.current is not None:
            where = f" in stage {flow.current} on {devices[flow.current]}, {flow.kind}"
            break
    note_failure(exc, f"{where} of micro-batch {mb}, in its thread")

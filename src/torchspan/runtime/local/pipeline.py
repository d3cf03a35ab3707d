"""Run a schedule over stages: forward and backward of every micro-batch, stage by stage.

Stages are connected by explicit gradients: a stage's outputs cross to the next device detached,
the next stage treats them as leaves, and after its backward it sends their ``.grad`` back, where
``torch.autograd.backward(outputs, grads)`` continues. Each stage's backward therefore runs in
the worker that owns its device, and a schedule (GPipe, 1F1B, zero-bubble) decides the order.
Zero-bubble splits a backward (``splitgrad``): ``backward_input`` computes and sends the inputs'
gradients at once, ``backward_weight`` adds the parameters' gradients later; a stage whose inputs
need no gradient (the first) runs its whole backward as ``backward_input``.

The same walk runs across processes: a ``Transport`` (``worker.Transport``) says which stages
are local; values for a stage in another process are sent by it (``runtime.ranks.p2p``) instead
of the mailbox, and only the local stages' actions run here.

Usage (``Spanned`` does this)::

    pipe = Pipeline(devices, recompute="never", precision="32", recorder=Recorder(), meter=ActivationMeter(2))
    loss = pipe.train(stage_fns, mb_inputs, mb_targets, loss_fn, weights, "gpipe")
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ... import schedule as sched
from ...hardware import to_device
from ...layers.slots import Slot
from ..layercall import recomputes, run_layer
from ..memory import ActivationMeter, MeteredSteps
from ..record import Recorder
from .stream import copy_stream, transfer, use_device, wait_ready
from .trainstep import TrainStep
from .worker import Mailbox, Transport, intra_op_threads, note_failure, run_workers, worker_groups

__all__ = ["Pipeline"]


class Pipeline:
    """Executes stage functions on their devices by a schedule. One instance per ``Spanned``."""

    def __init__(
        self,
        devices: Sequence[torch.device],
        *,
        recompute: str,
        precision: str,
        recorder: Recorder,
        meter: ActivationMeter,
        groups: Sequence[Sequence[int]] | None = None,
        transport: Transport | None = None,
    ) -> None:
        self.devices = list(devices)
        self.transport = transport if transport is not None else Transport()
        self.recompute = recompute
        self.precision = precision
        self.recorder = recorder
        self.meter = meter
        if groups is None:  # one worker per distinct device
            groups = worker_groups(self.devices)
        self.groups = [list(g) for g in groups]
        self._plans: dict[tuple[str, int, int], list[list[sched.Action]]] = {}
        self._orders: dict[tuple[int, tuple[int, ...]], list[sched.Action]] = {}
        self._steps = MeteredSteps(meter)  # which training steps count saved activations (``_signature``)
        self.split = (
            True  # zero-bubble splits backwards; False: whole backwards in B, W does nothing (FSDP stages)
        )

    @property
    def metered(self) -> bool:
        """Whether a training step has counted its saved activations (``ActivationMeter``)."""
        return self._steps.metered

    # ------------------------------------------------------------------ helpers
    def _send(
        self, box: Mailbox, kind: str, values: list[Any], spec: Any, src: int, dst: int, mb: int
    ) -> None:
        if not self.transport.is_local(dst):
            with self.recorder.block(src, self.devices[src], mb, "transfer"):
                self.transport.send(values, spec, src, dst, kind, mb)
            return
        key = (kind, dst, mb)
        sdev, ddev = self.devices[src], self.devices[dst]
        if sdev == ddev:  # nothing is copied, so no transfer block in the timeline
            moved, ready = transfer(values, sdev, ddev)
        else:
            # On a GPU the copy runs on the source's copy stream: time it there (after the compute it waits
            # for).
            stream = copy_stream(sdev)
            if stream is not None:  # pragma: no cover - needs a GPU
                stream.wait_stream(torch.cuda.current_stream(sdev))
            with self.recorder.block(src, sdev, mb, "transfer", stream=stream):
                moved, ready = transfer(values, sdev, ddev)
        box.put(key, (moved, spec, ready))

    def _receive(self, box: Mailbox, kind: str, stage: int, src: int, mb: int) -> tuple[list[Any], Any]:
        if not self.transport.is_local(src):
            return self.transport.receive(src, stage, kind, mb)
        values, spec, ready = box.get((kind, stage, mb))
        wait_ready(ready, self.devices[stage], values)
        return values, spec

    def _plan(self, schedule: str, m: int, n: int) -> list[list[sched.Action]]:
        key = (schedule, m, n)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = (
                sched.forward_only(m, n) if schedule == "forward" else sched.build(schedule, m, n)
            )
        return plan

    def _run(self, schedule: list[list[sched.Action]], do: Callable[[Mailbox, sched.Action], None]) -> None:
        def job(stages: list[int]) -> Callable[[Mailbox], None]:
            key = (id(schedule), tuple(stages))
            order = self._orders.get(key)
            if order is None:
                order = self._orders[key] = sched.merged_order(schedule, stages)

            def run(box: Mailbox) -> None:
                if threads is not None and self.devices[stages[0]].type == "cpu":
                    torch.set_num_threads(threads)
                cuda = any(
                    self.devices[s].type == "cuda" for s in stages
                )  # else use_device is a no-op: skipped
                for action in order:
                    try:
                        if cuda:
                            with use_device(self.devices[action.stage]):
                                do(box, action)
                        else:
                            do(box, action)
                    except BaseException as exc:
                        where = self.transport.where(action.stage)
                        note_failure(
                            exc,
                            f" in stage {action.stage} on "
                            f"{where or ''}{self.devices[action.stage]}{')' if where else ''}, "
                            f"{action.kind} of micro-batch {action.microbatch}",
                        )
                        raise

            return run

        # Only this process's stages run here (all of them unless the transport crosses processes).
        groups = [
            local for local in ([s for s in g if self.transport.is_local(s)] for g in self.groups) if local
        ]
        threads = intra_op_threads(self.devices, groups)  # several CPU workers share the cores
        names = [f"torchspan-{self.devices[g[0]]}-stages-{'-'.join(map(str, g))}" for g in groups]
        ok = False
        try:
            run_workers([job(g) for g in groups], names=names)
            ok = True
        finally:
            self.transport.finish(ok)

    # ------------------------------------------------------------------ training
    def train(
        self,
        fns: Sequence[Callable[..., Any]],
        inputs: Sequence[Sequence[Any]],
        targets: Sequence[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        weights: Sequence[float],
        schedule: str,
        scaler: Any = None,
        buffers: Sequence[Sequence[Slot]] | None = None,
        finished: Callable[[int, torch.Tensor], None] | None = None,
        before_last: Callable[[int, list[Any]], None] | None = None,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the summed weighted loss (detached).

        ``finished(stage, loss)``: across processes, called once a local stage has run (and sent) its
        last backward (its last weight backward, zero-bubble), with the pipeline's loss, while later stages'
        work may still run (a data-parallel gradient reduction starts there). ``before_last(stage, outputs)``:
        across processes, called right before a stage's last backward (not a split one) from ``outputs``.

        ``buffers[s]`` are stage ``s``'s buffer slots: a recompute leaves them as the real forward
        left them (BatchNorm statistics are updated once per micro-batch).
        """
        plan = self._plan(schedule, len(inputs), len(fns))
        signature = _signature(fns, inputs, targets)
        metering = self._steps.wants(signature)
        step = TrainStep(self, fns, inputs, targets, loss_fn, weights, scaler, buffers, finished, metering)
        if sched.merges_weights(schedule):
            step.merge_at = {
                (s, mb) for s, actions in enumerate(plan) for mb in sched.weight_run_ends(actions)
            }
        for s in range(
            1, len(fns)
        ):  # a stage in another process sends all its forwards first: take them as they come
            if self.transport.is_local(s) and not self.transport.is_local(s - 1):
                for _, mbs in sched.early_receives(plan, s, [s - 1]):
                    step.expect[s] = mbs
        # Across processes the summed loss rides on each stage's last backward message down to stage 0
        # (no collective after the step): every process returns it.
        if any(not self.transport.is_local(t) for t in range(len(fns))):
            step.carry = _carried_microbatch(plan)
            step.before_last = before_last
        try:
            self._run(plan, step.do)
        finally:
            step.saved.clear()
            step.pending.clear()
            step.merging.clear()
        if metering:
            self._steps.done(signature)
        return step.result()

    # ------------------------------------------------------------------ forward only
    def forward(
        self,
        fns: Sequence[Callable[..., Any]],
        inputs: Sequence[Sequence[Any]],
        buffers: Sequence[Sequence[Slot]] | None = None,
    ) -> list[Any]:
        """Pipelined forward of every micro-batch, autograd kept across stages; outputs per micro-batch.

        Copies here stay in autograd (``loss.backward()`` on the result reaches every stage; a
        transport to other processes carries values only, so there outputs exist on the last
        stage's process, ``None`` elsewhere, and autograd stops at the process), and
        recomputed micro-batches use ``torch.utils.checkpoint`` so that backward recomputes them
        (leaving ``buffers[s]`` as the real forward left them).
        """
        n, m = len(fns), len(inputs)
        slots: Sequence[Sequence[Slot]] = buffers if buffers is not None else [[] for _ in fns]
        plan = self._plan("forward", m, n)
        outputs: list[Any] = [None] * m
        grad = torch.is_grad_enabled()

        def do(box: Mailbox, a: sched.Action) -> None:
            s, mb, dev = a.stage, a.microbatch, self.devices[a.stage]
            if s == 0:
                args = to_device(list(inputs[mb]), dev)
            elif not self.transport.is_local(s - 1):
                leaves, spec = self.transport.receive(s - 1, s, "fwd", mb)
                args = tree_unflatten(leaves, spec)
            else:
                args = box.get(("fwd", s, mb))
            recompute = grad and recomputes(
                self.recompute, mb, m
            )  # torch.utils.checkpoint: backward recomputes
            metered = self.meter.saving(s) if grad and not recompute else contextlib.nullcontext()
            with self.recorder.block(s, dev, mb, "forward"), metered:
                out = run_layer(
                    fns[s],
                    args,
                    {},
                    device=dev,
                    precision=self.precision,
                    recompute=recompute,
                    slots=slots[s],
                )
            if s == n - 1:
                outputs[mb] = out
                return
            if not self.transport.is_local(s + 1):
                leaves, spec = tree_flatten(list(out))
                with self.recorder.block(s, dev, mb, "transfer"):
                    self.transport.send(leaves, spec, s, s + 1, "fwd", mb)
                return
            nxt = self.devices[s + 1]
            if nxt != dev:
                with self.recorder.block(s, dev, mb, "transfer"):
                    out = to_device(out, nxt, non_blocking=nxt.type == "cuda")  # stays in autograd
            box.put(("fwd", s + 1, mb), list(out))

        self._run(plan, do)
        return outputs


def _shape_of(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.dtype, v.device, v.requires_grad)
    return v if v is None or isinstance(v, (bool, int, float, str)) else type(v)


def _signature(
    fns: Sequence[Callable[..., Any]], inputs: Sequence[Sequence[Any]], targets: Sequence[Any]
) -> Any:
    """What decides the tensors a training step saves, as far as the pipeline sees it: the stage
    functions (an fx split per set of non-tensor arguments) and every micro-batch's inputs and
    targets (pytree structure; per leaf shape, dtype, device, or a plain value)."""
    funcs = tuple(f if isinstance(f, torch.nn.Module) else getattr(f, "__code__", f) for f in fns)
    if all(isinstance(t, torch.Tensor) for t in targets) and all(
        type(c) is list and all(isinstance(v, torch.Tensor) for v in c) for c in inputs
    ):  # the common case, without a pytree walk: lists of tensors, tensor targets
        return (
            funcs,
            "tensors",
            tuple(tuple(_shape_of(v) for v in c) for c in inputs),
            tuple(_shape_of(t) for t in targets),
        )
    leaves, spec = tree_flatten((list(inputs), list(targets)))
    return funcs, spec, tuple(_shape_of(v) for v in leaves)


def _carried_microbatch(plan: list[list[sched.Action]]) -> int:
    """The micro-batch whose backward is every stage's last action (the last stage has run every forward by
    then)."""
    lasts = {actions[-1].microbatch for actions in plan if actions}
    ends = (sched.BACKWARD, sched.BACKWARD_WEIGHT)
    if len(lasts) != 1 or any(a.kind not in ends for a in (actions[-1] for actions in plan)):
        raise ValueError(
            "this schedule does not end every stage with the same micro-batch's backward; the loss cannot "
            "ride on it"
        )
    return lasts.pop()

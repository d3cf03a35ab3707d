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
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ... import schedule as sched
from ...hardware import to_device
from ...layers.slots import Slot, kept
from ..layercall import autocast_for, recomputes, run_layer
from ..lossweights import weighted_loss
from ..memory import ActivationMeter, MeteredSteps
from ..record import Recorder
from ..splitgrad import Pending, input_backward, weights_together
from .stream import copy_stream, transfer, use_device, wait_ready
from .worker import Mailbox, Transport, intra_op_threads, note_failure, run_workers, worker_groups

__all__ = ["Pipeline"]


def _needs_grad(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


@dataclass
class _Saved:
    """What a stage keeps between a micro-batch's forward and its backward."""

    inputs: list[Any]  # flattened input leaves (tensors made leaves that require grad)
    spec: Any
    outputs: list[Any] = field(default_factory=list)  # flattened output leaves (not last stage)
    loss: torch.Tensor | None = None  # last stage
    stash: list[Any] = field(default_factory=list)  # recomputed: holders that count the kept inputs
    rng: tuple[torch.Tensor, torch.Tensor | None] | None = None



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
        self.split = True  # zero-bubble splits backwards; False: whole backwards in B, W does nothing (FSDP stages)

    @property
    def metered(self) -> bool:
        """Whether a training step has counted its saved activations (``ActivationMeter``)."""
        return self._steps.metered

    # ------------------------------------------------------------------ helpers
    def _send(self, box: Mailbox, kind: str, values: list[Any], spec: Any, src: int, dst: int, mb: int) -> None:
        if not self.transport.is_local(dst):
            with self.recorder.block(src, self.devices[src], mb, "transfer"):
                self.transport.send(values, spec, src, dst, kind, mb)
            return
        key = (kind, dst, mb)
        sdev, ddev = self.devices[src], self.devices[dst]
        if sdev == ddev:  # nothing is copied, so no transfer block in the timeline
            moved, ready = transfer(values, sdev, ddev)
        else:
            # On a GPU the copy runs on the source's copy stream: time it there (after the compute it waits for).
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
            plan = self._plans[key] = sched.forward_only(m, n) if schedule == "forward" else sched.build(schedule, m, n)
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
                cuda = any(self.devices[s].type == "cuda" for s in stages)  # else use_device is a no-op: skipped
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
                            f" in stage {action.stage} on {where or ''}{self.devices[action.stage]}{')' if where else ''}, "
                            f"{action.kind} of micro-batch {action.microbatch}",
                        )
                        raise

            return run

        # Only this process's stages run here (all of them unless the transport crosses processes).
        groups = [local for local in ([s for s in g if self.transport.is_local(s)] for g in self.groups) if local]
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
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the summed weighted loss (detached).

        ``finished(stage, loss)``: across processes, called once a local stage has run (and sent) its
        last backward (its last weight backward, zero-bubble), with the pipeline's loss, while later stages' work may still run (a
        data-parallel gradient reduction starts there).

        ``buffers[s]`` are stage ``s``'s buffer slots: a recompute leaves them as the real forward
        left them (BatchNorm statistics are updated once per micro-batch).
        """
        plan = self._plan(schedule, len(inputs), len(fns))
        signature = _signature(fns, inputs, targets)
        metering = self._steps.wants(signature)
        step = _TrainStep(self, fns, inputs, targets, loss_fn, weights, scaler, buffers, finished, metering)
        if sched.merges_weights(schedule):
            step.merge_at = {(s, mb) for s, actions in enumerate(plan) for mb in sched.weight_run_ends(actions)}
        for s in range(1, len(fns)):  # a stage in another process sends all its forwards first: take them as they come
            if self.transport.is_local(s) and not self.transport.is_local(s - 1):
                for _, mbs in sched.early_receives(plan, s, [s - 1]):
                    step.expect[s] = mbs
        # Across processes the summed loss rides on each stage's last backward message down to stage 0
        # (no collective after the step): every process returns it.
        if any(not self.transport.is_local(t) for t in range(len(fns))):
            step.carry = _carried_microbatch(plan)
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
        self, fns: Sequence[Callable[..., Any]], inputs: Sequence[Sequence[Any]], buffers: Sequence[Sequence[Slot]] | None = None
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
            recompute = grad and recomputes(self.recompute, mb, m)  # torch.utils.checkpoint: backward recomputes
            metered = self.meter.saving(s) if grad and not recompute else contextlib.nullcontext()
            with self.recorder.block(s, dev, mb, "forward"), metered:
                out = run_layer(fns[s], args, {}, device=dev, precision=self.precision, recompute=recompute, slots=slots[s])
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


class _TrainStep:
    """One training step of a ``Pipeline``: what each action does, and what the stages keep meanwhile."""

    def __init__(
        self,
        pipe: Pipeline,
        fns: Sequence[Callable[..., Any]],
        inputs: Sequence[Sequence[Any]],
        targets: Sequence[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        weights: Sequence[float],
        scaler: Any,
        buffers: Sequence[Sequence[Slot]] | None,
        finished: Callable[[int, torch.Tensor], None] | None,
        metering: bool,
    ) -> None:
        self.pipe, self.fns, self.inputs, self.targets = pipe, fns, inputs, targets
        self.loss_fn, self.weights, self.scaler, self.finished = loss_fn, weights, scaler, finished
        self.slots: Sequence[Sequence[Slot]] = buffers if buffers is not None else [[] for _ in fns]
        self.metering = metering
        self.saving = pipe.meter.saving if metering else _unmetered
        self.saved: dict[tuple[int, int], _Saved] = {}
        self.losses: list[torch.Tensor | None] = [None] * len(inputs)
        self.last = len(fns) - 1
        self.carry: int | None = None  # across processes: the micro-batch whose backward carries the loss
        self.carried: list[torch.Tensor] = []
        self.pending: dict[tuple[int, int], tuple[Pending, torch.Tensor | None]] = {}  # zero-bubble: weight passes to run
        self.merge_at: set[tuple[int, int]] | None = None  # merged weights: (stage, mb) of the weight backward ending a run
        self.merging: dict[int, tuple[list[Pending], list[torch.Tensor]]] = {}  # per stage: the run so far, its loss
        self.expect: dict[int, list[int]] = {}  # stage -> its forwards' micro-batches, to receive early (once per step)

    def summed(self) -> torch.Tensor:
        done = [t.float() for t in self.losses if t is not None]
        return torch.stack(done).sum() if done else torch.zeros((), device=self.pipe.devices[self.last])

    def result(self) -> torch.Tensor:
        if self.carry is not None and not self.pipe.transport.is_local(self.last):
            return self.carried[-1]
        return self.summed()

    def run_stage(self, s: int, mb: int, leaves: list[Any], spec: Any) -> tuple[Any, torch.Tensor | None]:
        """Stage ``s``'s function on micro-batch ``mb`` (and the weighted loss on the last stage)."""
        dev = self.pipe.devices[s]
        with autocast_for(dev, self.pipe.precision):
            out = self.fns[s](*_unflat(leaves, spec))
            loss = None
            if s == self.last:
                loss = weighted_loss(self.loss_fn, out, to_device(self.targets[mb], dev), self.weights[mb])
        return out, loss

    def do(self, box: Mailbox, a: sched.Action) -> None:
        recompute = recomputes(self.pipe.recompute, a.microbatch, len(self.inputs))
        if a.kind == sched.FORWARD:
            self.forward(box, a.stage, a.microbatch, recompute)
        elif a.kind == sched.BACKWARD_WEIGHT:
            self.backward_weight(a.stage, a.microbatch)
        else:
            self.backward(box, a.stage, a.microbatch, recompute, split=a.kind == sched.BACKWARD_INPUT)

    def forward(self, box: Mailbox, s: int, mb: int, recompute: bool) -> None:
        pipe, dev = self.pipe, self.pipe.devices[s]
        if s == 0:
            leaves, spec = _flat(to_device(list(self.inputs[mb]), dev))
        else:
            expected = self.expect.pop(s, None)
            if expected is not None:
                pipe.transport.expect(s - 1, s, "fwd", expected)
            leaves, spec = pipe._receive(box, "fwd", s, s - 1, mb)
            leaves = [v.requires_grad_(True) if _needs_grad(v) and not recompute else v for v in leaves]
        st = _Saved(leaves, spec)
        with pipe.recorder.block(s, dev, mb, "forward"):
            if recompute:  # no graph now: backward runs this forward again from the kept inputs
                st.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None)
                if self.metering:
                    st.stash = [pipe.meter.hold(s, v) for v in leaves if isinstance(v, torch.Tensor)]
                with torch.no_grad():
                    out, loss = self.run_stage(s, mb, leaves, spec)
            else:
                with self.saving(s):
                    out, loss = self.run_stage(s, mb, leaves, spec)
        if s == self.last:
            assert loss is not None
            st.loss = loss
            self.losses[mb] = loss.detach()
        else:
            outs, out_spec = _flat(out)
            st.outputs = outs
            pipe._send(box, "fwd", outs, out_spec, s, s + 1, mb)
        self.saved[(s, mb)] = st

    def recompute(self, s: int, mb: int, st: _Saved) -> None:
        """The forward of micro-batch ``mb`` on stage ``s`` again, with its random state, keeping its graph."""
        dev = self.pipe.devices[s]
        with self.pipe.recorder.block(s, dev, mb, "recompute"):
            leaves = [v.detach().requires_grad_(True) if _needs_grad(v) else v for v in st.inputs]
            st.inputs = leaves
            with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
                assert st.rng is not None
                torch.set_rng_state(st.rng[0])
                if st.rng[1] is not None:  # pragma: no cover - needs a GPU
                    torch.cuda.set_rng_state(st.rng[1], dev)
                with torch.enable_grad(), self.saving(s), kept(self.slots[s]):
                    out, loss = self.run_stage(s, mb, leaves, st.spec)
            st.stash = []
            if s == self.last:
                st.loss = loss
            else:
                st.outputs = _flat(out)[0]

    def backward(self, box: Mailbox, s: int, mb: int, recompute: bool, split: bool = False) -> None:
        """The backward of ``mb`` on stage ``s`` (``split``: the inputs' gradients only, the weights' kept
        for ``backward_weight``); sends the inputs' gradients to the previous stage."""
        pipe, dev = self.pipe, self.pipe.devices[s]
        st = self.saved.pop((s, mb))
        if recompute:
            self.recompute(s, mb, st)
        grads_in: list[Any] = []
        if s != self.last:
            grads_in, _ = pipe._receive(box, "bwd", s, s + 1, mb)
            if mb == self.carry:
                self.carried.append(grads_in.pop())
        with pipe.recorder.block(s, dev, mb, "backward"):
            if s == self.last:
                assert st.loss is not None
                target = self.scaler.scale(st.loss) if self.scaler is not None else st.loss
                pairs = [(target, None)] if target.requires_grad else []
            else:
                pairs = [(o, g) for o, g in zip(st.outputs, grads_in) if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            grads = self._input_pass(s, mb, st, pairs, split)
        loss = (self.summed() if s == self.last else self.carried[-1]) if mb == self.carry else None
        if s > 0:
            if loss is not None:
                grads.append(loss)
            pipe._send(box, "bwd", grads, None, s, s - 1, mb)
        if split:
            self.pending[(s, mb)] = (self.pending[(s, mb)][0], loss)
        elif loss is not None and self.finished is not None:
            self.finished(s, loss)

    def _input_pass(self, s: int, mb: int, st: _Saved, pairs: list[tuple[Any, Any]], split: bool) -> list[Any]:
        """Autograd from ``pairs`` (output, gradient): whole, or (``split``) to the inputs only, keeping the
        weight pass in ``self.pending``; the inputs' gradients (``None`` for inputs that need none)."""
        leaves = [v if isinstance(v, torch.Tensor) and v.requires_grad else None for v in st.inputs]
        if not split or not self.pipe.split:
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            if split:
                self.pending[(s, mb)] = (Pending(), None)
            return [v.grad if v is not None else None for v in leaves]
        wanted = [v for v in leaves if v is not None] if s > 0 else []  # stage 0: one whole backward now
        found, pending = input_backward([o for o, _ in pairs], [g for _, g in pairs], wanted, merge=self.merge_at is not None)
        self.pending[(s, mb)] = (pending, None)
        if s == 0:  # nothing is sent
            return [None] * len(leaves)
        it = iter(found)
        return [next(it) if v is not None else None for v in leaves]

    def backward_weight(self, s: int, mb: int) -> None:
        """The parameters' gradients of ``mb`` on stage ``s`` (zero-bubble's W); after the stage's last one,
        ``finished`` (a data-parallel reduction starts)."""
        pending, loss = self.pending.pop((s, mb))
        if self.merge_at is not None:  # merged weights: gather the run, take it as one pass at its end
            run, losses = self.merging.setdefault(s, ([], []))
            run.append(pending)
            losses.extend([loss] if loss is not None else [])
            if (s, mb) not in self.merge_at:
                return
            del self.merging[s]
            if any(run):
                with self.pipe.recorder.block(s, self.pipe.devices[s], mb, "backward_weight"):
                    weights_together(run)
            loss = losses[-1] if losses else None
        elif pending:
            with self.pipe.recorder.block(s, self.pipe.devices[s], mb, "backward_weight"):
                pending.weights()
        if loss is not None and self.finished is not None:
            self.finished(s, loss)


def _unmetered(stage: int) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _shape_of(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.dtype, v.device, v.requires_grad)
    return v if v is None or isinstance(v, (bool, int, float, str)) else type(v)


def _signature(fns: Sequence[Callable[..., Any]], inputs: Sequence[Sequence[Any]], targets: Sequence[Any]) -> Any:
    """What decides the tensors a training step saves, as far as the pipeline sees it: the stage
    functions (an fx split per set of non-tensor arguments) and every micro-batch's inputs and
    targets (pytree structure; per leaf shape, dtype, device, or a plain value)."""
    funcs = tuple(f if isinstance(f, torch.nn.Module) else getattr(f, "__code__", f) for f in fns)
    if all(isinstance(t, torch.Tensor) for t in targets) and all(
        type(c) is list and all(isinstance(v, torch.Tensor) for v in c) for c in inputs
    ):  # the common case, without a pytree walk: lists of tensors, tensor targets
        return funcs, "tensors", tuple(tuple(_shape_of(v) for v in c) for c in inputs), tuple(_shape_of(t) for t in targets)
    leaves, spec = tree_flatten((list(inputs), list(targets)))
    return funcs, spec, tuple(_shape_of(v) for v in leaves)


_SEQUENCE_SPECS: dict[tuple[type, int], Any] = {}  # pytree spec of a list/tuple of n leaves (immutable, shared)


def _flat(obj: Any) -> tuple[list[Any], Any]:
    """``tree_flatten(obj)``; a list or tuple of tensors (a stage's usual inputs and outputs) without the walk."""
    if type(obj) in (list, tuple) and all(isinstance(v, torch.Tensor) for v in obj):
        key = (type(obj), len(obj))
        spec = _SEQUENCE_SPECS.get(key)
        if spec is None:
            spec = _SEQUENCE_SPECS[key] = tree_flatten(obj)[1]
        return list(obj), spec
    return tree_flatten(obj)


def _unflat(leaves: list[Any], spec: Any) -> Any:
    """``tree_unflatten(leaves, spec)``; a spec ``_flat`` shares is rebuilt without the walk."""
    if spec is _SEQUENCE_SPECS.get((list, len(leaves))):
        return list(leaves)
    if spec is _SEQUENCE_SPECS.get((tuple, len(leaves))):
        return tuple(leaves)
    return tree_unflatten(leaves, spec)


def _carried_microbatch(plan: list[list[sched.Action]]) -> int:
    """The micro-batch whose backward is every stage's last action (the last stage has run every forward by then)."""
    lasts = {actions[-1].microbatch for actions in plan if actions}
    ends = (sched.BACKWARD, sched.BACKWARD_WEIGHT)
    if len(lasts) != 1 or any(a.kind not in ends for a in (actions[-1] for actions in plan)):
        raise ValueError("this schedule does not end every stage with the same micro-batch's backward; the loss cannot ride on it")
    return lasts.pop()

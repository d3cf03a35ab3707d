"""One training step of a local ``Pipeline``: what each schedule action does, and what the stages keep
meanwhile.

``TrainStep.do(box, action)`` runs one action of one stage (forward, backward, a zero-bubble split backward's
input or weight pass, a recompute) in the worker that owns the stage's device; ``Pipeline.train`` builds one
per step and walks the schedule with it. Values cross stages flattened (``flat``/``unflat``: pytree leaves, a
list or tuple of tensors without the walk).

Usage (``Pipeline.train`` does this)::

    step = TrainStep(pipe, fns, inputs, targets, loss_fn, weights, scaler, buffers, finished, metering)
    pipe._run(plan, step.do)
    loss = step.result()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ... import schedule as sched
from ...hardware import to_device
from ...layers.slots import Slot, kept
from ..layercall import autocast_for, recomputes
from ..lossweights import weighted_loss
from ..splitgrad import Pending, input_backward, weights_together
from .worker import Mailbox

if TYPE_CHECKING:
    from .pipeline import Pipeline

__all__ = ["TrainStep", "flat", "unflat"]


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


class TrainStep:
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
        self.before_last: Callable[[int, list[Any]], None] | None = None  # (stage, outputs) before its last
        self.pending: dict[
            tuple[int, int], tuple[Pending, torch.Tensor | None]
        ] = {}  # zero-bubble: weight passes to run
        self.merge_at: set[tuple[int, int]] | None = (
            None  # merged weights: (stage, mb) of the weight backward ending a run
        )
        self.merging: dict[
            int, tuple[list[Pending], list[torch.Tensor]]
        ] = {}  # per stage: the run so far, its loss
        self.arm_weights: dict[int, list[Any]] = {}  # stage -> its outputs: before_last at its last W
        self.expect: dict[
            int, list[int]
        ] = {}  # stage -> its forwards' micro-batches, to receive early (once per step)

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
            out = self.fns[s](*unflat(leaves, spec))
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
            leaves, spec = flat(to_device(list(self.inputs[mb]), dev))
        else:
            expected = self.expect.pop(s, None)
            if expected is not None:
                pipe.transport.expect(s - 1, s, "fwd", expected)
            leaves, spec = pipe._receive(box, "fwd", s, s - 1, mb)
            leaves = [v.requires_grad_(True) if _needs_grad(v) and not recompute else v for v in leaves]
        st = _Saved(leaves, spec)
        with pipe.recorder.block(s, dev, mb, "forward"):
            if recompute:  # no graph now: backward runs this forward again from the kept inputs
                st.rng = (
                    torch.get_rng_state(),
                    torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None,
                )
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
            outs, out_spec = flat(out)
            st.outputs = outs
            pipe._send(box, "fwd", outs, out_spec, s, s + 1, mb)
        self.saved[(s, mb)] = st

    def recompute(self, s: int, mb: int, st: _Saved) -> None:
        """The forward of micro-batch ``mb`` on stage ``s`` again, with its random state, keeping its
        graph."""
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
                st.outputs = flat(out)[0]

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
                pairs = [
                    (o, g)
                    for o, g in zip(st.outputs, grads_in)
                    if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
                ]
            if mb == self.carry and self.before_last is not None:
                self._arm(s, [o for o, _ in pairs], split)
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

    def _arm(self, s: int, outputs: list[Any], split: bool) -> None:
        """Before stage ``s``'s last backward of the step (from ``outputs``): ``before_last`` (a bucketed
        reduction armed) now when this backward adds the parameters' gradients (whole, or a first stage's
        split one, which runs whole), else before its weight pass; never for merged weight passes (they add
        a parameter's gradient once per micro-batch of the run: DDP's reducer takes one)."""
        assert self.before_last is not None
        if not split or not self.pipe.split or (s == 0 and self.merge_at is None):
            self.before_last(s, outputs)
        elif self.merge_at is None:
            self.arm_weights[s] = outputs

    def _input_pass(
        self, s: int, mb: int, st: _Saved, pairs: list[tuple[Any, Any]], split: bool
    ) -> list[Any]:
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
        found, pending = input_backward(
            [o for o, _ in pairs], [g for _, g in pairs], wanted, merge=self.merge_at is not None
        )
        self.pending[(s, mb)] = (pending, None)
        if s == 0:  # nothing is sent
            return [None] * len(leaves)
        it = iter(found)
        return [next(it) if v is not None else None for v in leaves]

    def backward_weight(self, s: int, mb: int) -> None:
        """The parameters' gradients of ``mb`` on stage ``s`` (zero-bubble's W); after the stage's last one,
        ``finished`` (a data-parallel reduction starts)."""
        pending, loss = self.pending.pop((s, mb))
        if mb == self.carry and s in self.arm_weights and self.before_last is not None:
            self.before_last(s, self.arm_weights.pop(s))  # DDP's hooks fire in this weight pass
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


_SEQUENCE_SPECS: dict[
    tuple[type, int], Any
] = {}  # pytree spec of a list/tuple of n leaves (immutable, shared)


def flat(obj: Any) -> tuple[list[Any], Any]:
    """``tree_flatten(obj)``; a list or tuple of tensors (a stage's usual inputs and outputs) without the
    walk."""
    if type(obj) in (list, tuple) and all(isinstance(v, torch.Tensor) for v in obj):
        key = (type(obj), len(obj))
        spec = _SEQUENCE_SPECS.get(key)
        if spec is None:
            spec = _SEQUENCE_SPECS[key] = tree_flatten(obj)[1]
        return list(obj), spec
    return tree_flatten(obj)


def unflat(leaves: list[Any], spec: Any) -> Any:
    """``tree_unflatten(leaves, spec)``; a spec ``flat`` shares is rebuilt without the walk."""
    if spec is _SEQUENCE_SPECS.get((list, len(leaves))):
        return list(leaves)
    if spec is _SEQUENCE_SPECS.get((tuple, len(leaves))):
        return tuple(leaves)
    return tree_unflatten(leaves, spec)

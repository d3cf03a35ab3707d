"""A pipeline across ranks for models that run their own forward (transformers, wrappers, blocks).

Nothing is traced. Every rank of a pipeline calls the model's own ``forward`` on the same
micro-batch; its own stage's layers run for real on its device, other stages' layers run on
``meta`` (shapes only; once per call shape, then replayed: ``metacalls``), and the glue between
layers follows the ``taint`` rules, so a tensor is real on a rank exactly when that rank could
compute it. A layer that cannot run on ``meta`` (an MoE block's value-dependent routing) runs only
on its own stage, which describes its outputs' shapes to the other ranks once per call shape
(``metacalls.Described``). When a layer of this rank needs an argument another stage computed,
that stage sends it at the same call
(``routes``: found the first time a forward takes a path, by comparing what each rank sees,
then replayed and checked; ``ownmessages``: one predicted message per value, received early when
the sending stage runs its forwards first); gradients of what crossed travel back in backward. A value the
glue combined from several stages (``inputs_embeds + position_embeds`` across a cut right after the token
embedding, a skip connection across a cut) is rebuilt on the stage that needs it: it receives the
operands it lacks and replays the glue ops (``glue``). Tied parameters,
data-parallel replicas, the loss normalizer and gradient reductions are the ``RankStage`` it
holds, as for stage functions; the layers and their recording forward are ``OwnForwardLayers``';
how one layer call runs here (for real, on ``meta``, replayed) is ``ranks.owncalls``.
With ``shard=True`` and replicas, this stage's blocks are sharded by FSDP2 over the stage's
replicas once placed (``ranks.stageshard``): every forward is then a collective of those replicas.

Several stages per rank (more stages than pipeline ranks) are placed looped, stage ``s`` on rank ``s % P``: a
rank's stages are one group of layers here, the ranks run one common order and backward runs in segments
(``ownlooped``); under ``schedule="interleaved-1f1b"`` each rank runs Megatron's order for its stages, each
micro-batch's forward a thread paused between the rank's chunks, each chunk's backward on its own
(``owninterleaved``). Schedules are ``torchspan.schedule``'s (GPipe, 1F1B, zero-bubble:
``splitgrad.run_actions``): this rank runs its stage's actions in order; a forward blocks where an argument
from an earlier stage has not arrived yet. Exact: the loss is weighed against the whole batch on the last
stage and every rank's gradients are those of one device. ``recompute`` recomputes this rank's layers in
backward; ``precision="bf16"`` autocasts them (a value crosses in the dtype its holder has: meta knows no
autocast). A forward must take the same path on every rank (no branches on values other stages compute, which
``meta`` cannot answer: such a model raises, naming the call). The ranks exchange at every new call and at
the end of a forward the first time they reach them (``together``); a rank that fails where the others head
for such an exchange (the first step) joins it with its error, so every rank of the pipeline raises it
instead of waiting for a peer that stopped.

Usage (``span`` does this in a launched job)::

    ex = RankOwnForwardExecutor(model, groups, settings, recorder, meter, Mesh(1, 2), rank_info(),
                                balance_given=True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ... import schedule as sched
from ...hardware import to_device
from ..executor import Settings, Work
from ..layercall import recomputes
from ..local.placed import OwnForwardLayers
from ..lossweights import LossSpec
from ..memory import ActivationMeter, MeteredSteps
from ..metainit import bind
from ..microbatch import split_batch
from ..placement import place
from ..record import Recorder
from ..splitgrad import Pending, run_actions
from .env import RankInfo
from .forwardstate import Forward, Path, call_leaves
from .mesh import Mesh
from .metacalls import Described, MetaCalls, TiedSwaps
from .metaweights import fill, materialize_stage
from .owncalls import OwnLayerCalls
from .owninterleaved import NEW_PATH, Turn, Turns, chunk_backward, interleaved_plan, run_interleaved
from .ownlooped import common_plan, rank_groups, stage_backward
from .ownloss import stage_loss
from .ownmessages import ForwardMessages
from .p2p import PeerError, RankTransport
from .routes import DivergedError, check_last_stage
from .stage import RankStage, StageExecutor
from .taint import MetaTaint
from .together import Together, every_rank, explained, raised_everywhere

__all__ = ["RankOwnForwardExecutor"]


_END = ("end of forward",)  # on the path tree: the forward ended here (an exchange the first time)
_ABSENT: Any = object()  # a layer without a forward of its own (the class's runs)


class RankOwnForwardExecutor(OwnLayerCalls, StageExecutor):
    """This rank's stage, run inside the model's own forward (see the module docstring; options: as
    ``OwnForwardLayers``)."""

    mode = "own-forward"
    stage_type: type[RankStage] = RankStage  # ranks.tpstages: a tensor-parallel stage

    def __init__(
        self,
        model: nn.Module,
        groups: Sequence[Sequence[str]],
        settings: Settings,
        recorder: Recorder,
        meter: ActivationMeter,
        mesh: Mesh,
        info: RankInfo,
        *,
        shard: bool = False,
        reshard_after_forward: bool = True,
        weights: Any = None,
        **options: Any,
    ) -> None:
        self._looped = len(groups) > mesh.stages  # several stages per rank (``ownlooped``)
        stages = mesh.stages if self._looped else len(groups)
        self.ranks = self.stage_type(
            model, mesh, info, stages, settings.precision, settings=settings, shard=shard
        )
        self._weights = weights  # a model built on meta: this stage filled at the first call (place)
        self._shard: bool | None = reshard_after_forward if shard else None  # sharded: reshard_after_forward
        super().__init__([info.device] * len(groups), groups)
        self.model, self.settings, self.recorder, self.meter = model, settings, recorder, meter
        self.mesh, self.stage, self.device = mesh, self.ranks.stage, info.device
        self.shards_batch = mesh.replicas > 1  # each pipeline trains one shard of the global batch
        self.own = OwnForwardLayers(model, self.devices, self.groups, **options)
        self._placed = False
        self._kept: set[int] = set()
        self._paths = {True: Path(), False: Path()}  # training forwards, no-grad forwards
        self._fwd: Forward | None = None
        self._transport = RankTransport(
            self.ranks.mesh, info.rank, info.device, self.ranks.comm
        )  # values "own-fwd"/"own-eval", gradients "own-bwd"
        self._swaps = TiedSwaps({})
        self._settled: set[Any] = set()  # signatures of the training steps run (their paths recorded)
        self._steps = MeteredSteps(meter)  # which training steps count saved activations (micro-batch shapes)
        self._meta_calls = MetaCalls()
        self._actions: tuple[Any, list[list[sched.Action]]] = (
            None,
            [],
        )  # every stage's actions, built for (schedule, m, n)
        self._messages = ForwardMessages(
            self._transport, self.stage, mesh.stages
        )  # values, their gradients, the loss
        self._together = Together(
            mesh.stages, self._transport.peer, None, before=self._transport.run_gate
        )  # the group: place()
        self._described = Described(mesh.stages, self._together.gather, self._transport.peer)

    @property
    def layers(self) -> dict[str, nn.Module]:
        return self.own.layers

    def placed_layers(self) -> dict[str, nn.Module]:
        return self.own.layers

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
        return Work(split_batch(args, kwargs, self.settings.microbatches))

    # ------------------------------------------------------------------ placement
    def place(self, work: Work) -> None:
        """The recording forward (full model, real weights, no trace left) finds the layers' order and
        where the model's own tensors are read; then this rank keeps only its stage."""
        if self._placed:
            return
        self.groups, root_attrs = self.own.record(work, self.devices, self.groups)
        check_last_stage([layer.name for layer in self.own.layer_set if layer.ran], self.groups)
        self._order = [n for g in self.groups for n in g]  # execution order
        self._held = rank_groups(
            self.groups, self.mesh.stages
        )  # each rank's layers (looped: of several stages)
        self.root_attrs = dict(root_attrs)
        root_attrs = {q: s % self.mesh.stages for q, s in root_attrs.items()}  # the rank reading it first
        mine_roots = [q for q, s in root_attrs.items() if s == self.stage]
        stage = [self.layers[name] for name in self._held[self.stage]]
        slots = (
            materialize_stage(self.model, stage, self.device, mine_roots)
            if self._weights is not None
            else None
        )
        keep = self.ranks.find_ties(self.layers, self._held)
        for q in mine_roots:
            path, _, attr = q.rpartition(".")
            owner = self.model.get_submodule(path) if path else self.model
            t = owner._parameters.get(attr, owner._buffers.get(attr))
            if t is not None:
                keep.add(id(t))
        for s, group in enumerate(self._held):
            if s != self.stage:
                for name in group:
                    self.ranks.to_meta(self.layers[name], keep)
        self.ranks.roots_to_meta(root_attrs, keep)
        mine = {name: self.stage for name in self._held[self.stage]}
        place(self.model, mine, self.devices, self.root_attrs, self.layers, mine_roots)
        if slots is not None:  # values for this stage only, before the replicas are made alike
            bind(slots, self.model)
            fill(self.model, slots, self._weights, comm=self.ranks.comm)
        self._swaps = TiedSwaps(
            {
                name: self.layers[name]
                for s, group in enumerate(self._held)
                if s != self.stage
                for name in group
            }
        )
        self.ranks.start()
        if self._shard is not None:  # this stage's blocks sharded over its replicas (after start's broadcast)
            self.ranks.shard([(name, self.layers[name]) for name in self._held[self.stage]], self._shard)
        self._together.group = self.ranks.pipe_group  # made by start() when there are replicas
        self._kept = {
            id(t) for t in [*self.model.parameters(), *self.model.buffers()]
        }  # the glue never turns them meta
        self._placed = True

    @contextmanager
    def _layers_wrapped(self) -> Iterator[None]:
        stage_of = {name: r for r, g in enumerate(self._held) for name in g}  # the rank running each layer
        done: list[tuple[nn.Module, Any]] = []
        for name, module in self.layers.items():
            if (
                name in stage_of
            ):  # an instance attribute shadows the class's forward (a user's own patch is kept)
                done.append((module, module.__dict__.get("forward", _ABSENT)))
                module.__dict__["forward"] = self._wrapper(name, stage_of[name], module.forward)
        try:
            yield
        finally:
            for module, before in done:
                if before is _ABSENT:
                    del module.__dict__["forward"]
                else:
                    module.__dict__["forward"] = before

    def _wrapper(self, name: str, stage: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            st = self._fwd
            if st is None:
                return original(*args, **kwargs)
            if st.turn is not None and st.turn.reach(st, name):  # interleaved: this chunk's turn came
                self._fwd = st
            with torch._C.DisableTorchFunction():  # inside a layer: plain torch (meta or real throughout)
                return self._call(st, name, stage, original, args, kwargs)

        return call

    # ------------------------------------------------------------------ steps
    def meters(self) -> bool:
        """Until one training step has counted its saved activations; later steps skip the saved-tensor
        hooks unless their micro-batches' shapes differ from the metered step's (then it is metered again)."""
        return not self._steps.metered

    def _metering(self, work: Work) -> tuple[bool, Any]:
        signature = tuple(
            (
                structure,
                tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v) for v in leaves),
            )
            for leaves, structure in (call_leaves(*chunk) for chunk in work.chunks)
        )
        return self._steps.wants(signature), signature

    def _forward(
        self, work: Work, mb: int, grad: bool, metering: bool = False, turn: Turn | None = None
    ) -> tuple[Any, Forward]:
        args, kwargs = work.chunks[mb]
        leaves = call_leaves(args, kwargs)[0]
        if not all(v.device == self.device for v in leaves if isinstance(v, torch.Tensor)):
            args, kwargs = to_device((args, kwargs), self.device)
            leaves = call_leaves(args, kwargs)[0]
        s = self.settings
        st = Forward(
            mb, grad, self._paths[grad], metering, grad and recomputes(s.recompute, mb, s.microbatches)
        )
        st.turn = turn
        self._fwd = st
        try:
            kept = self._kept | {id(t) for t in leaves if isinstance(t, torch.Tensor)}
            with torch.set_grad_enabled(grad), MetaTaint(self.device, st.recipes, kept):
                out = self.model(*args, **kwargs)
            self._messages.done(st)
        except Exception as exc:
            failure = explained(exc, self.stage, mb)
            if not st.node.next and not raised_everywhere(exc) and not isinstance(exc, PeerError):
                self._together.join(
                    failure, self.stage, mb
                )  # the others' next step on this path is an exchange
            if failure is exc:
                raise
            raise failure from exc
        finally:
            self._fwd = None
            st.recipes.clear()
        return out, st

    def _end(self, st: Forward, failure: BaseException | None = None) -> None:
        """After a forward (and its loss): the first time a path ends here, every rank exchanges how it went,
        so a rank that failed (``failure``, e.g. the loss refused on the last stage) stops every rank; raises
        ``failure``."""
        if _END not in st.node.next:
            if st.turn is not None:
                raise every_rank(DivergedError(NEW_PATH.format(mb=st.mb, where="its end")))
            st.node.next[_END] = (None, st.node)  # type: ignore[assignment]
            if failure is None:
                self._together.gather(None)
            elif not raised_everywhere(failure) and not isinstance(failure, PeerError):
                self._together.join(failure, self.stage, st.mb)
        if failure is not None:
            raise failure

    def _backward(self, st: Forward, split: bool = False) -> Pending | None:
        """Gradients of what crossed come back, those of what this rank received go out; ``split``: weights'
        later."""
        merge = sched.merges_weights(self.settings.schedule)
        split = split and (bool(st.inbound) or merge) and not st.recompute and self._shard is None  # not FSDP
        return stage_backward(st, self._messages, self.device, looped=self._looped, split=split, merge=merge)

    def train(
        self,
        work: Work,
        targets: Sequence[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        weights: Sequence[float],
        spec: LossSpec | None = None,
    ) -> torch.Tensor:
        self.ranks.check_same_batch(
            work.chunks, targets, self._transport
        )  # its verdict: the transport's gate
        metering, signature = self._metering(work)
        # interleaved: once a step with these shapes has recorded its paths in the common order
        interleave = (
            self._looped and self.settings.schedule == "interleaved-1f1b" and signature in self._settled
        )
        with self._layers_wrapped(), self.ranks.reducing() as reduction:
            arm = None if self._looped else (lambda: reduction.before_last([]))  # looped: no replicas
            loss = self._run_schedule(work, targets, loss_fn, weights, metering, interleave, arm)
            if metering:
                self._steps.done(signature)
            self._settled.add(signature)
            reduction.finished(loss)
        # the last stage's loss (summed over replicas when there are any), carried to every rank of this
        # pipeline
        total = reduction.total if reduction.total is not None else loss
        return total.reshape(-1)[0].to(self.device, torch.float32)

    def _run_schedule(
        self,
        work: Work,
        targets: Sequence[Any],
        loss_fn: Callable[..., Any],
        weights: Sequence[float],
        metering: bool,
        interleave: bool = False,
        arm: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """This stage's actions of the schedule; returns the pipeline's summed loss (float64): the last
        stage's own, carried to the other stages after its last backward (one message to each, no
        collective). ``arm()``: right before the last action adding to the weights' gradients (a stage's
        replicas then reduce in DDP's buckets, ``ranks.bucketed``)."""
        s, n = self.settings, self.mesh.stages
        losses: list[torch.Tensor] = []
        live: dict[int, Forward] = {}
        plan = self._plan(interleave)
        actions = plan[self.stage]
        self._messages.start_step(plan)
        carry = (
            [a.microbatch for a in actions if a.kind in (sched.BACKWARD, sched.BACKWARD_INPUT)][-1]
            if self.ranks.last
            else None
        )
        summed: list[torch.Tensor] = []

        def forward(mb: int, turn: Turn | None = None) -> None:  # and the loss on the last stage
            out, st = self._forward(work, mb, grad=True, metering=metering, turn=turn)
            try:
                st.loss = (
                    stage_loss(out, targets[mb], loss_fn, weights[mb], self.device, s.precision)
                    if self.ranks.last
                    else None
                )
            except Exception as exc:  # noqa: BLE001 - raised on every rank by _end
                self._end(st, exc)
            self._end(st)
            losses.extend([st.loss.detach().to(torch.float64)] if st.loss is not None else [])
            live[mb] = st

        def backward(mb: int, split: bool) -> Pending | None:
            if (
                not self.ranks.last
            ):  # the loss's receive waits posted from the first backward (after the gate)
                self._messages.expect_loss(n - 1)
            pending = self._backward(live.pop(mb), split)
            if mb == carry:
                self._carry(losses, summed)
            return pending

        ok = False
        try:
            if interleave:
                self._run_interleaved(actions, forward, live, losses, summed)
            else:
                run_actions(
                    actions,
                    self.recorder,
                    self.device,
                    forward,
                    backward,
                    merge=sched.merges_weights(s.schedule),
                    before_last=arm,
                    whole_input=self.stage == 0,  # its split backward runs whole (``_backward``)
                )
            if not self.ranks.last:
                summed.append(self._messages.take_loss(n - 1))
            ok = True
        except Exception:
            # a refused batch explains a failure before the first transfer: every rank raises it
            self._transport.run_gate()
            raise
        finally:
            self._messages.end_step()
            self._transport.finish(ok)
        return summed[0]

    def _plan(self, interleave: bool) -> list[list[sched.Action]]:
        """Every rank's actions of a training step (built once per schedule, micro-batches and order)."""
        s, n = self.settings, self.mesh.stages
        key = (s.schedule, s.microbatches, n, interleave)
        if self._actions[0] != key:
            if interleave:  # each rank its stages' actions in Megatron's order
                plan = interleaved_plan(s.microbatches, len(self.groups), n)
            elif self._looped:  # one order on every rank
                plan = common_plan(s.schedule, s.microbatches, n)
            else:
                plan = sched.build(s.schedule, s.microbatches, n)
            self._actions = (key, plan)
        return self._actions[1]

    def _carry(self, losses: list[torch.Tensor], summed: list[torch.Tensor]) -> None:
        """After the last stage's last backward (every gradient message of the step is out): the summed loss
        follows them to every other stage."""
        summed.append(torch.stack(losses).sum())
        for stage in range(self.mesh.stages - 1):
            self._messages.send_loss(summed[0], stage)

    def _run_interleaved(
        self,
        actions: Sequence[sched.Action],
        forward: Callable[[int, Turn], None],
        live: dict[int, Forward],
        losses: list[torch.Tensor],
        summed: list[torch.Tensor],
    ) -> None:
        """This rank's actions of interleaved 1F1B (``owninterleaved``): ``forward(mb, turn)`` in each
        micro-batch's thread up to its next chunk of this rank, each chunk's backward here."""
        n = self.mesh.stages
        turns = Turns({name: c // n for c, g in enumerate(self.groups) for name in g if c % n == self.stage})

        def backward(mb: int, c: int, last: bool) -> None:
            if not self.ranks.last:
                self._messages.expect_loss(n - 1)
            if chunk_backward(live[mb], turns.of[mb], c, self._messages, self.device):
                del live[mb]
            if last and self.ranks.last:
                self._carry(losses, summed)

        run_interleaved(actions, n, turns, self.recorder, self.device, lambda t: forward(t.mb, t), backward)

    def forward(self, work: Work) -> list[Any]:
        """Outputs of every micro-batch on every rank of this pipeline (no autograd across processes)."""
        outs: list[Any] = []
        with self._layers_wrapped(), torch.no_grad():
            ok = False
            try:
                for mb in range(len(work.chunks)):
                    out, st = self._forward(work, mb, grad=False)
                    self._end(st)
                    outs.append(out)
                ok = True
            finally:
                self._transport.finish(ok)
        return self._together.outputs(outs, self.ranks.last, self.ranks.shared_outputs, self.device)

"""``span(model)`` in a launched job: this rank's exact data-parallel replica, behind the ``Executor``
interface.

The replica itself is ``DataParallelReplica`` (DDP underneath, the ranks' weighted gradients summed, the
global loss normalizer all-reduced): after ``spanned.train_step(x_shard, y_shard, loss_fn)`` every rank's
``.grad`` equals one device's for all ranks' shards concatenated. This adapter gives it the
``Spanned`` façade's contract, the same as a local ``span``:

- **Loss contract**: losses torchspan reads (loss modules, functional losses, ``partial``) and
  declared ones (``loss_reduction=`` / ``loss_normalizer=``) weigh as locally. An opaque callable
  (a lambda) is calibrated as locally, on this rank's shard split in two (``LossChecks``): the
  first time a loss is seen the ranks that could decide (2 rows or more) vote in one small
  all-reduce, so every rank uses the same reduction or every rank refuses with the calibration's
  message; afterwards each rank re-checks its own shards when their structure changes (a refusal
  then raises on that rank, which ends a launched job naming it). A ``loss_normalizer`` is
  verified the same way.
- **Empty shards** (``rank_batches`` at the end of an epoch) are valid steps that add zero.
- **Timeline**: one ``forward`` and one ``backward`` block per step (backward includes the loss
  and the gradient all-reduce it overlaps). **Memory**: one stage holding every layer; activations
  are those of the first training step that saved any (``meters``), later steps run unmetered.
- ``spanned(x)`` with gradients enabled runs through DDP (a ``backward`` you run yourself sums
  the ranks' gradients; every rank must run it); under ``torch.no_grad()`` the plain module runs
  (no collective).
- **Settings as in one process**: ``microbatches`` cut the rank's shard into that many chunks
  (fewer when it has fewer rows): gradient accumulation, every chunk but the last under DDP's
  ``no_sync``, each chunk's loss weighed against the global normalizer, so ``.grad`` is one
  device's for the whole batch. ``precision="bf16"`` autocasts each chunk's forward and loss on
  the rank's device, as one process does. ``precision="fp16"``: the span's ``SpanScaler`` scales
  each chunk's loss and ``Spanned`` unscales the step's gradients after they are all-reduced, so
  every rank reads the same gradients and skips the same steps (``runtime.fp16``; plain
  ``optimizer.step()`` is right). ``recompute``: every layer (``model_layers``) recomputed in
  backward by ``runtime.layercall``, chunk by chunk as ``recomputes`` says.

Usage (``span`` does this when launched with one pipeline stage)::

    ex = ReplicaExecutor(model, names, settings, recorder, meter)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..executor import Executor, Settings, Work
from ..fp16 import SpanScaler
from ..losscheck import LossChecks, loss_identity, same_identity
from ..lossweights import LossSpec
from ..memory import ActivationMeter
from ..microbatch import batch_size, split_sizes, split_value
from ..modelloss import own_loss, tokens
from ..record import Recorder
from .dataparallel import DataParallelReplica
from .devicemesh import check_degrees, job_mesh, sub_mesh
from .env import rank_info
from .plainloop import Record, declared, exact_model_loss, watch
from .sharded import check_shard_options

__all__ = ["ReplicaExecutor", "launched_replica"]

_VOTES = ("refused", "samples", "sum", "user")


class _NeedsForward(Exception):
    # what a rank's calibration decided (or nothing: abstained)
    """Raised by a probe in place of a dry forward: this rank's calibration needs one."""


def launched_replica(plan: Any) -> bool:
    """True when ``span`` runs in a process group of size > 1 with one pipeline stage: a data-parallel
    replica.

    A plan (one stage) must say ``data_parallel`` 1 (a one-process plan, replicated) or the world
    size; anything else is a ``ValueError`` printing ``pp(1) * dp_replicate(3) * dp_shard(1) !=
    WORLD_SIZE(2)``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    world = dist.get_world_size()
    dp = getattr(plan, "data_parallel", 1) if plan is not None else 1
    if dp != 1:
        check_degrees(
            {"pp": 1, "dp_replicate": dp},
            world,
            f"this plan has one stage and data_parallel={dp}; launch {dp} processes, or re-plan with "
            f"data_parallel={world} (or use a one-process plan: one replica per process)",
        )
    return True


def replica_mesh(settings: Settings, device: torch.device, shard: bool) -> Any:
    """The job's ``DeviceMesh`` for one replica per rank, ``("dp_replicate",)`` (DDP) or ``("dp_shard",)``
    (FSDP2) over every rank (a user's ``span(mesh=)``, checked), set as ``settings.mesh``; returns the
    dimension the replica uses."""
    name = "dp_shard" if shard else "dp_replicate"
    world = dist.get_world_size()
    info = rank_info()
    kind = device.type if info.backend is not None and "nccl" in info.backend else "cpu"
    settings.mesh = job_mesh(kind, {name: world}, keep=(name,), given=settings.mesh)
    return sub_mesh(settings.mesh, name)


class ReplicaExecutor(Executor):
    """This rank's data-parallel replica of ``model`` (see the module docstring); ``device`` defaults to the
    rank's."""

    mode = "data-parallel"
    empty_batches = True
    shards_batch = True

    def __init__(
        self,
        model: nn.Module,
        names: Sequence[str],
        settings: Settings,
        recorder: Recorder,
        meter: ActivationMeter,
        device: torch.device | None = None,
        *,
        shard: bool = False,
        reshard_after_forward: bool = True,
        offload: str | None = None,
        process_group: Any = None,
        weights: Any = None,
        per_shard_batchnorm: bool = False,
    ) -> None:
        place = torch.device(device) if device is not None else rank_info().device
        check_shard_options(shard, offload, settings.precision, reshard_after_forward)
        if process_group is None:  # the job's mesh (tensor parallel passes its dp_shard dimension)
            process_group = replica_mesh(settings, place, shard)
        if settings.precision == "fp16" and settings.scaler is None:
            settings.scaler = SpanScaler(
                place.type
            )  # one decision on every rank: it reads the all-reduced gradients
        self.replica = DataParallelReplica(
            model,
            device=place,
            process_group=process_group,
            precision=settings.precision,
            recompute=settings.recompute,
            scaler=settings.scaler,
            shard=shard,
            reshard_after_forward=reshard_after_forward,
            offload=offload,
            weights=weights,
            per_shard_batchnorm=per_shard_batchnorm,
        )
        self.mode = "sharded" if shard else "data-parallel"
        self.offload = offload
        super().__init__([self.replica.device], [list(names)])
        self.model, self.settings = model, settings
        self.info = rank_info()
        self._recorder, self._meter = recorder, meter
        self._decided: list[tuple[tuple[Any, ...], LossSpec]] = []  # opaque losses the ranks agreed on
        self._timing: dict[str, Any] = {}
        self._metered = False  # one training step's activation peak is counted; later steps skip the meter
        model.register_forward_pre_hook(self._forward_starts)
        model.register_forward_hook(self._forward_ends)

    # ------------------------------------------------------------------ inputs
    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
        """This rank's shard in ``microbatches`` chunks, fewer when it has fewer rows (one for an empty
        shard; ``NoSplit`` values unwrapped): a rank's shard may be smaller than another's."""
        total = batch_size(args, kwargs)
        n = max(1, min(self.settings.microbatches, total))
        return Work(
            chunks=[
                (tuple(a), dict(k)) for a, k in split_value((list(args), kwargs), n, total, name="inputs")
            ]
        )

    # ------------------------------------------------------------------ loss contract
    def resolve_loss(
        self,
        checks: LossChecks,
        spec: LossSpec,
        targets: Sequence[Any],
        sizes: Sequence[int],
        dry_outputs: Callable[[], Sequence[Any]],
        target: Any = None,
    ) -> LossSpec:
        """``spec`` made exact for the global batch: calibrated on this shard's halves, agreed by every
        rank."""
        if not spec.needs_check:
            return spec
        size = sizes[0]
        ident = loss_identity(spec.loss_fn) + loss_identity(spec.user_normalizer)
        agreed = next((s for known, s in self._decided if same_identity(known, ident)), None)
        if (
            self.replica.collective_forward
        ):  # sharded: a dry forward gathers parameters, so every rank runs it or none
            local, message = self._calibrate_together(checks, spec, targets, sizes, dry_outputs, target)
        else:
            local, message = self._calibrate(checks, spec, targets, sizes, dry_outputs, target)
        if agreed is not None:  # later steps: this rank's own check only, no collective
            if message:
                raise ValueError(message)
            if local is not None and spec.kind == "opaque" and local.kind != agreed.kind:
                raise ValueError(
                    f"rank {self.info.rank}: loss_fn={spec.name} behaved as {agreed.kind!r} on earlier "
                    f"shards but as {local.kind!r} on this one ({size} samples); declare "
                    "loss_reduction='mean' / 'sum' or loss_normalizer="
                )
            if spec.kind == "model":
                return local if local is not None else agreed
            return agreed if agreed.loss_fn is spec.loss_fn else spec.resolved(agreed.kind)
        decided = self._vote(spec, local, message)
        self._decided.append((ident, decided))
        del self._decided[:-32]
        return decided

    def _calibrate(
        self,
        checks: LossChecks,
        spec: LossSpec,
        targets: Sequence[Any],
        sizes: Sequence[int],
        dry_outputs: Callable[[], Sequence[Any]],
        target: Any,
    ) -> tuple[LossSpec | None, str]:
        """This rank's own calibration (``dry_outputs`` runs when its batch structure is new): the spec, or a
        refusal."""
        size = sizes[0]
        try:
            if (
                spec.kind == "model" and size >= 1
            ):  # the model's own loss: verified on the whole shard's logits
                return checks.resolve(spec, targets, sizes, dry_outputs, target=target, shards=True), ""
            if len(sizes) > 1:  # micro-batches: calibrated on the chunks, as one process does
                return checks.resolve(spec, targets, sizes, dry_outputs, target=target), ""
            if size >= 2:
                halves = split_sizes(size, 2)
                halved = lambda: split_value(dry_outputs()[0], 2, size, name="output")  # noqa: E731
                return checks.resolve(
                    spec, split_value(targets[0], 2, size, name="target"), halves, halved, target=target
                ), ""
        except ValueError as e:
            where = (
                f"its shard of {size} samples"
                if spec.kind == "model"
                else f"its shard in {len(sizes)} micro-batches"
                if len(sizes) > 1
                else f"its shard of {size} samples split in two to calibrate the loss"
            )
            return None, f"rank {self.info.rank} ({where}): {e}"
        return None, ""

    def _calibrate_together(
        self,
        checks: LossChecks,
        spec: LossSpec,
        targets: Sequence[Any],
        sizes: Sequence[int],
        dry_outputs: Callable[[], Sequence[Any]],
        target: Any,
    ) -> tuple[LossSpec | None, str]:
        """``_calibrate`` where a forward is a collective: each rank first finds whether it needs a dry
        forward (without running one), one all-reduce tells whether any rank does, and then every rank runs it
        (a rank that needs none discards the outputs; an empty shard runs a stand-in row)."""

        def probe() -> Sequence[Any]:
            raise _NeedsForward

        try:
            found: tuple[LossSpec | None, str] | None = self._calibrate(
                checks, spec, targets, sizes, probe, target
            )
        except _NeedsForward:
            found = None
            checks.calibrations -= 1  # counted by the probe that ran no forward; counted again below
        flag = torch.tensor(
            [0.0 if found is not None else 1.0], dtype=torch.float64, device=self.replica.comm_device
        )
        dist.all_reduce(flag, group=self.replica.group)
        if flag.item() == 0:
            return found  # type: ignore[return-value]
        outputs = list(
            dry_outputs()
        )  # an empty shard runs a stand-in row (DataParallelReplica.forward_chunks)
        if found is not None:
            return found
        return self._calibrate(checks, spec, targets, sizes, lambda: outputs, target)

    def _vote(self, spec: LossSpec, local: LossSpec | None, message: str) -> LossSpec:
        """Every rank's calibration combined (one all-reduce; the refusal messages gathered only on a
        refusal)."""
        votes = torch.zeros(len(_VOTES), dtype=torch.float64, device=self.replica.comm_device)
        if message:
            votes[0] = 1
        elif local is not None:
            votes[_VOTES.index(local.kind if local.kind in _VOTES else "user")] = 1
        dist.all_reduce(votes, group=self.replica.group)
        refused, samples, summed, _ = (int(v) for v in votes.tolist())
        if refused:
            messages: list[Any] = [None] * self.info.world_size
            dist.all_gather_object(messages, message or None, group=self.replica.group)
            raise ValueError(next(m for m in messages if m))
        if samples and summed:
            raise ValueError(
                f"loss_fn={spec.name} looks like a per-sample mean on {samples} rank(s) and a sum on "
                f"{summed}, so torchspan cannot weight it to the single-device gradient; declare "
                "loss_reduction='mean' / 'sum' or loss_normalizer="
            )
        if spec.kind == "user":
            return spec  # verified where a shard could be split; a normalizer needs no vote
        if (
            spec.kind == "model"
        ):  # verified where this rank has rows; an empty shard's normalizer is 0 whatever it counts
            return local if local is not None else dataclasses.replace(spec, user_normalizer=tokens)
        if samples or summed:
            return spec.resolved("samples" if samples else "sum")
        if spec.declared:
            return (
                spec  # no shard could check it yet (1 row each): used as declared, checked once a shard can
            )
        raise ValueError(
            f"loss_fn={spec.name} is opaque and no rank's shard has 2 samples or more to calibrate it on, "
            "so torchspan cannot tell whether it averages or sums (data-parallel weights depend on it). "
            "Declare it: loss_reduction='sum', loss_reduction='mean', or loss_normalizer=callable "
            "returning what its mean divides by for a shard's target, e.g. lambda y: (y != -100).sum()"
        )

    def weights(self, spec: LossSpec, targets: Sequence[Any], sizes: Sequence[int]) -> list[float]:
        """``1.0`` per chunk: ``train`` weighs each chunk by ``spec`` against the all-reduced global
        normalizer."""
        return [1.0] * len(sizes)

    def replica_of(self) -> tuple[int, int]:
        group = self.replica.group
        return dist.get_rank(group), dist.get_world_size(group)

    # ------------------------------------------------------------------ the plain loop
    def plain_output(
        self, out: Any, kwargs: dict[str, Any], nonfinite: Callable[[torch.Tensor], None]
    ) -> Any:
        """A training forward's outputs for the user's own ``loss.backward()``: a torch loss applied to them,
        or the model's own loss from ``labels``, is this rank's share of the global batch's
        (``ranks.plainloop``)."""
        if not torch.is_grad_enabled():
            return out
        if self.settings.precision == "fp16" and self.model.training:
            raise ValueError(
                "precision='fp16' needs its gradient scaler around every backward, which a plain "
                "loss.backward() on the outputs skips; train with spanned.train_step(...) (it scales, "
                "unscales and skips overflowed steps), or span with precision='bf16', whose plain loop "
                "needs no scaler"
            )
        record = Record(self.replica.group, self.replica.comm_device, nonfinite)
        if (
            self.settings.loss_reduction is not None
        ):  # declared: any loss, summing or a mean over each shard's rows
            return declared(out, self.settings.loss_reduction, record)
        labels = kwargs.get("labels")
        if isinstance(labels, torch.Tensor) and own_loss(out) is not None:
            out = exact_model_loss(out, self.replica.to_device(labels), record)
        return watch(out, record)

    # ------------------------------------------------------------------ steps
    def forward(self, work: Work) -> list[Any]:
        """Each chunk's output: through DDP with gradients enabled (one reduction for a backward through all
        of them), the plain module under ``no_grad``; autocast at the span's precision."""
        with self._recorder.block(0, self.replica.device, 0, "forward"):
            return self.replica.forward_chunks(work.chunks, pad_to=self.settings.microbatches)

    def train(
        self,
        work: Work,
        targets: Sequence[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        weights: Sequence[float],
        spec: LossSpec | None = None,
    ) -> torch.Tensor:
        """``DataParallelReplica.train_step`` on the shard, weighed by ``spec``; returns the global full-batch
        loss on every rank."""
        if spec is None:
            raise ValueError(
                "ReplicaExecutor.train needs the loss spec (Spanned.train_step passes it): train(work, "
                "targets, loss_fn, weights, spec)"
            )
        reduction = "sum" if spec.kind == "sum" else "mean" if spec.kind == "samples" else None
        normalizer = spec.user_normalizer if spec.kind in ("user", "model") else None
        self._timing = {"on": True, "mb": 0}
        metering = self.meters()
        try:
            with self._meter.saving(0) if metering else contextlib.nullcontext():
                loss = self.replica.train_chunks(
                    work.chunks,
                    targets,
                    loss_fn,
                    loss_reduction=reduction,
                    loss_normalizer=normalizer,
                    pad_to=self.settings.microbatches,
                )
            self._metered = self._metered or (metering and self._meter.peak[0] > 0)
        finally:
            self._close_block()
            self._timing = {}
        return loss

    def meters(self) -> bool:
        """Until a training step has saved activations (an empty shard saves none): ``Spanned.memory`` reports
        that step's peak, and later steps skip the saved-tensor hooks (the bare replica's cost)."""
        return not self._metered

    def state_dict(self, module: nn.Module, **options: Any) -> Any:
        """The replica's state dict: the model's own keys; sharded, full tensors gathered from every rank."""
        return self.replica.state_dict(**options)

    def load_state_dict(self, module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Full tensors by the model's own keys (sharded: each rank keeps its shard)."""
        return self.replica.load_state_dict(state_dict, strict=strict)

    def join(self, optimizer: torch.optim.Optimizer | None = None) -> int:
        """``DataParallelReplica.join``: shadow the other ranks' remaining steps with empty shards."""
        return self.replica.join(optimizer)

    # ------------------------------------------------------------------ timeline
    def _close_block(self) -> None:
        block = self._timing.pop("open", None)
        if block is not None:
            block.__exit__(None, None, None)

    def _open_block(self, kind: str) -> None:
        block = self._recorder.block(0, self.replica.device, self._timing["mb"], kind)
        block.__enter__()
        self._timing["open"] = block

    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        """A training chunk's forward begins: the previous chunk's backward block ends, its forward block
        opens."""
        if self._timing.get("on"):
            self._close_block()
            self._open_block("forward")

    def _forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        """Its forward ends: the backward block (loss, backward and, on the last chunk, the all-reduce)
        opens."""
        if self._timing.get("on") and "open" in self._timing:
            self._close_block()
            self._open_block("backward")
            self._timing["mb"] += 1

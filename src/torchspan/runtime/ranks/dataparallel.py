"""Exact data parallelism over processes: one replica per rank, the single-device gradient of the global
batch.

Each rank holds a replica of the model (made identical at construction by broadcasting parameters
and buffers from rank 0, kept identical because every rank applies the same summed gradient) and
computes the loss of its own shard; nothing is gathered on one rank. PyTorch's
``DistributedDataParallel`` reduces the gradients bucket by bucket while backward still runs, with its
own C++ reduction (each bucket divided by the world size ``W`` as it is copied in, then all-reduced);
each rank's backward is of its weighted loss times ``W``, so the buckets sum the ranks' weighted
gradients. For ``reduction="sum"`` each rank's weight is 1. For ``"mean"`` each rank backpropagates
its shard's *summed* loss (its mean times its normalizer: the sample count or, for
``CrossEntropyLoss``/``NLLLoss`` with class weights or ``ignore_index``, the targets' weight sum),
weighted by its normalizer over the global one: the normalizers are all-reduced while the forward
runs, so the weight is known when the loss is taken and no gradient bucket needs dividing again; the
weighted losses are summed in DDP's first bucket, as the gradient of a scalar ``carrier`` parameter
(their sum is the global loss; all-reduced on their own with ``find_unused_parameters``). So after
``train_step`` every rank's ``.grad`` is what ``loss_fn(model(X), Y).backward()`` leaves on one
device, ``X, Y`` being all ranks' shards concatenated, for any (uneven, even empty) split.
Gradient accumulation over calls (no ``zero_grad()`` between them) needs nothing more: the gradients
already in ``.grad`` are the same on every rank, so DDP's mean keeps them and adds this call's sum
(``DDPEngine``). ``.grad`` tensors are views into DDP's buckets (nothing is copied back).

End of an epoch: every rank must take part in every step; ``rank_batches`` gives every rank as many steps, and
``replica.join(optimizer)`` after the loop lets ranks run out at different times (see ``join``).

Engines: the loss contract above is written once, here; what reduces the gradients is the replica's
engine: ``DDPEngine`` (``ranks.ddp``: DDP, its own reduction of the loss times ``W``; fp16: a SUM comm hook)
or, with ``shard=True``, ``ShardedEngine`` (``ranks.sharded``: FSDP2 ``fully_shard`` per layer, reduce-scatter
by SUM, parameters, gradients and optimizer state sharded, bf16 by FSDP2's mixed precision policy,
``offload="cpu"``). Sharded, every forward is a collective (it gathers parameters), so every rank runs as many
chunks per step (a shard with fewer rows than ``microbatches``, or none, runs stand-in rows at weight 0).

Usage::

    torchspan.init_distributed()
    replica = DataParallelReplica(model)
    loss = replica.train_step(x_shard, y_shard, torch.nn.CrossEntropyLoss(ignore_index=0))
    optimizer.step(); optimizer.zero_grad()
    replica.join(optimizer)                          # after the loop, on every rank
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from ...layers import buffer_slots, kept, model_layers
from ..fp16 import SpanScaler
from ..layercall import LayerCalls, recomputes
from ..lossweights import weighted_loss
from ..microbatch import batch_size, call_args, split_value
from .checkpoint import model_keys
from .engines import replica_engine
from .env import RankInfo, rank_info
from .metaweights import check_weights
from .replicachecks import check_policy, refuse_batchnorm, shard_loss
from .sharded import check_shard_options, first_row, no_rows, stand_ins

_check_policy = check_policy  # its old name here

__all__ = ["DataParallelReplica", "shard_loss"]


class DataParallelReplica:
    """This rank's replica of ``module`` in an exact data-parallel job (see the module docstring).

    ``device``: where the replica lives (default: the rank's device, ``cuda:LOCAL_RANK`` under
    nccl, else the CPU). BatchNorm layers are refused: each rank would normalise its shard with
    the shard's own statistics, so gradients would differ from one device's (convert them with
    ``nn.SyncBatchNorm.convert_sync_batchnorm``, or accept that with ``per_shard_batchnorm=True``).
    ``bucket_cap_mb`` / ``find_unused_parameters`` are passed to
    ``DistributedDataParallel``; ``sync_buffers`` (default True) copies rank 0's buffers (e.g.
    BatchNorm statistics) to every rank before each forward. ``precision`` (``"32"``, ``"bf16"``,
    ``"fp16"``) autocasts each chunk's forward and loss on ``device``; fp16 needs ``scaler`` (a
    ``GradScaler``; every rank reads the same all-reduced gradients, so every rank skips alike).
    ``recompute`` (``"never"``, ``"except_last"``, ``"always"``) reruns each layer's forward in backward
    (``runtime.layercall``). ``shard=True``: sharded by FSDP2 (``ranks.sharded``; ``reshard_after_forward``
    True is ZeRO-3, False ZeRO-2; ``offload="cpu"`` needs a GPU; ``.grad`` is a ``DTensor`` shard, the
    DDP options do not apply). ``weights``: a model built on ``meta`` gets its values here, each rank only its
    part (``"init"``, a checkpoint path or a callable: ``ranks.metaweights``). Requires ``init_distributed()``
    first.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        device: torch.device | str | None = None,
        process_group: Any = None,
        bucket_cap_mb: float = 25.0,
        find_unused_parameters: bool = False,
        sync_buffers: bool = True,
        per_shard_batchnorm: bool = False,
        precision: str = "32",
        recompute: str = "never",
        scaler: Any = None,
        shard: bool = False,
        reshard_after_forward: bool = True,
        offload: str | None = None,
        weights: Any = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module={type(module).__name__} is not a torch.nn.Module")
        check_policy(precision, recompute, scaler)
        check_weights(module, weights, "DataParallelReplica")
        check_shard_options(shard, offload, precision, reshard_after_forward)
        if not per_shard_batchnorm:
            refuse_batchnorm(module)
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "no process group: call torchspan.init_distributed() before building a DataParallelReplica"
            )
        self.info: RankInfo = rank_info()
        self.device = torch.device(device) if device is not None else self.info.device
        self.module, self.sharded = module, shard
        self.group, self._engine = replica_engine(
            module,
            self.device,
            process_group,
            self.comm_device,
            shard=shard,
            precision=precision,
            weights=weights,
            reshard_after_forward=reshard_after_forward,
            offload=offload,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            sync_buffers=sync_buffers,
        )
        self.precision, self.recompute, self.scaler = precision, recompute, scaler
        self._calls: LayerCalls | None = (
            None  # recompute's wrappers around the model's layers, made at the first step
        )
        self._template: tuple[Any, Any, Callable[..., Any]] | None = (
            None  # one row of the last inputs, target, loss
        )
        self._pad = (
            1  # sharded: the chunks every rank runs per step (the last step's micro-batches), for join
        )

    # ------------------------------------------------------------------ nn.Module-like surface
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The replica's forward on this rank's inputs (through DDP or FSDP2: a ``backward`` you run yourself
        sums the gradients of every rank's loss, as one device would for the sum of those losses),
        at the replica's ``precision``."""
        with self._engine.autocast(self.device, self.precision):
            return self._summing(self._engine(*self.to_device(args), **self.to_device(kwargs)))

    __call__ = forward

    def _summing(self, out: Any) -> Any:
        """A training forward's outputs for a backward the user runs: the engine's ``summing`` (DDP: gradients
        times the world size on the way in, so the mean DDP takes is the ranks' sum); unchanged under
        ``no_grad``."""
        return self._engine.summing(out) if torch.is_grad_enabled() else out

    def forward_chunks(
        self, chunks: Sequence[tuple[tuple[Any, ...], dict[str, Any]]], pad_to: int = 1
    ) -> list[Any]:
        """Each chunk's output (``(args, kwargs)`` per micro-batch). With gradients enabled every chunk but
        the last runs under DDP's ``no_sync``, so one ``backward`` through all outputs reduces once; under
        ``no_grad`` the plain module runs (no collective). Sharded, parameters are gathered even so (every
        rank runs it): an empty chunk runs a stand-in row (its outputs cut to zero rows) and the list is
        padded to ``pad_to`` chunks with stand-ins whose outputs are dropped, so every rank runs as many
        forwards."""
        plan = self._plan(chunks, [None] * len(chunks), pad_to)
        outs = []
        for i, (chunk, _, stand_in) in enumerate(plan):
            a, k = self.to_device(chunk)
            with (
                self._engine.autocast(self.device, self.precision),
                kept(buffer_slots([self.module])) if stand_in else contextlib.nullcontext(),
            ):
                if not torch.is_grad_enabled():
                    out = self._engine.inference(*a, **k)
                else:
                    with self._engine.no_sync() if i < len(plan) - 1 else contextlib.nullcontext():
                        out = self._summing(self._engine(*a, **k))
            if i < len(chunks):
                outs.append(no_rows(out) if stand_in else out)
        return outs

    def _plan(
        self, chunks: Sequence[Any], targets: Sequence[Any], pad_to: int
    ) -> list[tuple[Any, Any, bool]]:
        """``(chunk, target, stand_in)`` per chunk to run: sharded, ``ranks.sharded.stand_ins`` (every rank
        runs ``pad_to`` chunks or more, none of zero rows where a stand-in row exists); else the chunks as
        they are."""
        if not self.collective_forward:
            return [(c, t, False) for c, t in zip(chunks, targets)]
        template = self._template[:2] if self._template is not None else None
        return stand_ins(chunks, targets, pad_to, template)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix=prefix, recurse=recurse)

    def train(self, mode: bool = True) -> DataParallelReplica:
        self._engine.train(mode)
        return self

    def eval(self) -> DataParallelReplica:
        return self.train(False)

    def state_dict(self, *, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The model's own state dict (its own keys, no ``module.`` prefix; the same on every rank). Sharded:
        full tensors gathered from every rank (a collective; ``module.state_dict()`` is the sharded form,
        ``ranks.sharded``)."""
        return self._engine.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load the model's keys (a ``module.`` prefix from DataParallel/DDP checkpoints is dropped); sharded,
        full tensors are cut to this rank's shards."""
        return self._engine.load_state_dict(model_keys(state_dict), strict=strict)

    # ------------------------------------------------------------------ training
    def train_step(
        self,
        inputs: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        loss_reduction: str | None = None,
        loss_normalizer: Callable[[Any], Any] | None = None,
        *,
        microbatches: int = 1,
    ) -> torch.Tensor:
        """Forward and backward of this rank's shard; returns the global full-batch loss (detached, every
        rank).

        ``inputs``: a tensor, a tuple (positional arguments) or a dict (keyword arguments), samples
        on dim 0; may have zero rows. Gradients are *added* to ``.grad`` (call
        ``optimizer.zero_grad()`` first): after the call they equal, on every rank, those of
        ``loss_fn(model(X), Y).backward()`` on one device for all ranks' shards concatenated.
        ``loss_reduction`` / ``loss_normalizer``: see ``shard_loss`` (needed for losses torchspan
        cannot read, such as lambdas). ``microbatches``: the shard runs in that many chunks (fewer
        when it has fewer rows), gradients accumulated (``train_chunks``).
        """
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches={microbatches!r} must be an int >= 1")
        args, kwargs = call_args(inputs)
        size = batch_size(args, kwargs)
        n = max(1, min(microbatches, size))
        chunks = [(tuple(a), k) for a, k in split_value((list(args), kwargs), n, size, name="inputs")]
        targets = split_value(target, n, size, name="target")
        return self.train_chunks(
            chunks, targets, loss_fn, loss_reduction, loss_normalizer, pad_to=microbatches
        )

    def train_chunks(
        self,
        chunks: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
        targets: Sequence[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        loss_reduction: str | None = None,
        loss_normalizer: Callable[[Any], Any] | None = None,
        pad_to: int = 1,
    ) -> torch.Tensor:
        """``train_step`` on a shard already cut into micro-batches (``(args, kwargs)`` and a target each).

        Gradient accumulation inside the shard: every chunk but the last runs forward and backward
        under DDP's ``no_sync`` (gradients add up locally), the last one's backward all-reduces the
        sum once. Each chunk's loss is weighed by its normalizer over the global one (all-reduced
        while the first chunk's forward runs), so the result is one device's for the whole global
        batch. Each chunk runs autocast at ``precision`` (its loss too) and, by ``recompute``, with
        every layer recomputed in backward (``runtime.layercall``: the same per-layer policy as one process).
        ``pad_to``: sharded, every rank runs at least that many chunks (the step's ``microbatches``: a forward
        gathers parameters, so a shard with fewer rows runs stand-in rows at weight 0).
        """
        if not callable(loss_fn):
            raise TypeError(f"loss_fn={loss_fn!r} is not callable; pass e.g. torch.nn.functional.mse_loss")
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "train_step runs backward, but gradients are disabled here (torch.no_grad()); call it "
                "outside no_grad"
            )
        if not chunks or len(chunks) != len(targets):
            raise ValueError(
                f"train_chunks needs one target per chunk and at least one chunk; got {len(chunks)} "
                f"chunk(s), {len(targets)} target(s)"
            )
        spec = shard_loss(loss_fn, loss_reduction, loss_normalizer)
        sizes = [batch_size(a, k) for a, k in chunks]
        norms = [
            float(n) if spec.reduction == "sum" else spec.normalizer(t, n) for t, n in zip(targets, sizes)
        ]
        if sizes[0] > 0:  # one real row of this step: an empty shard later runs it at weight 0
            self._template = (first_row(chunks[0]), first_row(targets[0]), loss_fn)
        if (
            self.collective_forward
        ):  # sharded: as many chunks on every rank, stand-in rows at weight 0 (ranks.sharded)
            self._pad = max(pad_to, 1)
            plan = self._plan(chunks, targets, pad_to)
            sizes = sizes + [0] * (len(plan) - len(sizes))
        else:  # many models cannot run zero rows (transformers' attention reshapes): one row at weight 0
            stand_in = sizes[0] == 0 and self._template is not None
            one = [(self._template[0], self._template[1], True)] if stand_in else []  # type: ignore[index]
            plan = one or [(c, t, False) for c, t in zip(chunks, targets)]
        stats = self._stats(sum(norms), sum(sizes), active=True)
        work = dist.all_reduce(
            stats, group=self.group, async_op=True
        )  # overlaps the forward, waited for by the weight

        def weight(i: int) -> float:
            # chunk i's share of the global loss: a mean times its normalizer over the global one
            work.wait()
            if sizes[i] == 0:
                return 0.0
            if spec.reduction == "sum":
                return 1.0
            total = float(stats[0])
            return (
                norms[i] / total if total != 0.0 else float("nan")
            )  # all targets ignored everywhere: nan, as on one device

        return self._run(
            [c for c, _, _ in plan], [t for _, t, _ in plan], loss_fn, weight, [f for _, _, f in plan]
        )

    def join(self, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Call after the training loop on every rank; returns the number of steps this rank shadowed.

        Until every rank has called ``join``, a rank that has would block the others' steps; instead
        it takes part in each of them with an empty shard (one row of its last inputs at weight 0), which adds
        nothing to the loss or the gradients. Pass the ``optimizer`` your loop steps (the loop being
        ``zero_grad(); train_step(...); step()``) and a shadowed step does the same, so parameters
        and optimizer state stay identical on every rank.
        """
        shadowed = 0
        while True:
            stats = self._stats(0.0, 0, active=False)
            dist.all_reduce(stats, group=self.group)
            if stats[2].item() == 0:
                return shadowed
            if self._template is None:
                raise RuntimeError(
                    f"rank {self.info.rank} joined before its first train_step, so it has no inputs to "
                    "shadow the other ranks' steps with; give every rank at least one (possibly empty) "
                    "shard, e.g. with rank_batches"
                )
            chunk, target, loss_fn = self._template
            if optimizer is not None:
                optimizer.zero_grad()
            n = (
                self._pad if self.collective_forward else 1
            )  # sharded: as many chunks as the others' steps run
            with self._unscaled():  # fp16: the same unscaled gradients, and skip, as the ranks still training
                self._run([chunk] * n, [target] * n, loss_fn, lambda i: 0.0, [True] * n)
            if optimizer is not None and self.scaler is not None and not isinstance(self.scaler, SpanScaler):
                self.scaler.step(
                    optimizer
                )  # a bare replica's own GradScaler steps as the other ranks' loop does
                self.scaler.update()
            elif optimizer is not None:
                optimizer.step()
            shadowed += 1

    def _unscaled(self) -> contextlib.AbstractContextManager[None]:
        """Around a step ``Spanned.train_step`` does not wrap (``join``'s): a ``SpanScaler`` unscales its
        gradients."""
        if isinstance(self.scaler, SpanScaler):
            return self.scaler.finishing([p for p in self.module.parameters() if p.requires_grad])
        return contextlib.nullcontext()

    def _stats(self, norm: float, size: int, active: bool) -> torch.Tensor:
        """(normalizer, rows, active ranks) of this rank, all-reduced as the first collective of every
        step."""
        return torch.tensor(
            [norm, float(size), 1.0 if active else 0.0], dtype=torch.float64, device=self.comm_device
        )

    def _run(
        self,
        chunks: Sequence[Any],
        targets: Sequence[Any],
        loss_fn: Callable[..., Any],
        weight: Callable[[int], float],
        stand_in: Sequence[bool],
    ) -> torch.Tensor:
        """Every chunk's forward and weighted backward; ``stand_in[i]``: chunk ``i`` is a stand-in row for an
        empty shard or chunk (weight 0, buffers left as they were)."""
        if isinstance(loss_fn, nn.Module):
            loss_fn.to(self.device)
        engine = self._engine
        scale = engine.grad_scale  # DDP divides each bucket by W: its backward is of loss * W
        carried = engine.carrier is not None  # the loss rides in DDP's buckets (ranks.ddp)
        if carried:
            engine.fresh()
        last, losses, state = len(chunks) - 1, [], {"recompute": False}
        with self._layer_calls(state), self._aside():
            for i, ((args, kwargs), target) in enumerate(zip(chunks, targets)):
                state["recompute"] = recomputes(self.recompute, i, len(chunks))
                with (
                    engine.no_sync() if i < last else contextlib.nullcontext()
                ):  # the last chunk's backward reduces
                    with (
                        engine.autocast(self.device, self.precision),
                        kept(buffer_slots([self.module])) if stand_in[i] else contextlib.nullcontext(),
                    ):
                        out = engine(*self.to_device(args), **self.to_device(kwargs))
                        loss = weighted_loss(
                            loss_fn, out, self.to_device(target), weight(i)
                        )  # waits for the normalizers
                    losses.append(loss.detach().reshape(1).to(torch.promote_types(loss.dtype, torch.float32)))
                    if (
                        i == last and not carried
                    ):  # the ranks' weighted losses sum to the global loss: all-reduced
                        total = torch.cat(losses).sum().reshape(1) if last else losses[0].clone()
                        work = dist.all_reduce(total, group=self.group, async_op=True)  # while backward runs
                    scaled = self.scaler.scale(loss) if self.scaler is not None else loss
                    if carried:
                        scaled = engine.carrying(scaled, loss)
                    scaled.backward(torch.full_like(scaled, scale) if scale != 1.0 else None)
        if carried:
            return engine.loss_of()
        work.wait()
        return total[0]

    @contextlib.contextmanager
    def _aside(self) -> Iterator[None]:
        """With an engine that ``sets_aside`` (a SUM hook reduces whatever ``.grad`` holds): earlier gradients
        are set aside during the step's backwards, so only this step's are reduced, and added back after (one
        device's accumulation). Other engines add each call's reduced gradients to ``.grad`` themselves:
        nothing to do."""
        if not self._engine.sets_aside:
            yield
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
        except BaseException:
            for p, g in zip(params, earlier):  # a failed step leaves what came before it
                p.grad = g
            raise
        for p, g in zip(params, earlier):
            if g is not None:
                p.grad = g if p.grad is None else g.add_(p.grad)

    def _layer_calls(self, state: dict[str, bool]) -> contextlib.AbstractContextManager[None]:
        """Every layer of the model recomputed in backward while ``state["recompute"]`` (nothing without
        recompute)."""
        if self.recompute == "never":
            return contextlib.nullcontext()
        if self._calls is None:
            layers = {layer.name: layer.module for layer in model_layers(self.module).layers} or {
                "": self.module
            }
            self._calls = LayerCalls(
                layers, dict.fromkeys(layers, 0), [self.device], "32"
            )  # autocast: the whole forward's
        return self._calls.installed(lambda: state["recompute"])

    def to_device(self, value: Any) -> Any:
        """``value`` (any nested structure) with its tensors on this replica's device."""
        dev = self.device
        return tree_map(
            lambda t: t.to(dev, non_blocking=dev.type == "cuda") if isinstance(t, torch.Tensor) else t, value
        )

    @property
    def collective_forward(self) -> bool:
        """Whether every forward is a collective (sharded: parameters are gathered), so every rank must run
        it."""
        return self._engine.collective_forward

    @property
    def comm_device(self) -> torch.device:
        """Where this replica's collectives run: its GPU under nccl, else the CPU."""
        return (
            self.device
            if self.info.backend is not None and "nccl" in self.info.backend
            else torch.device("cpu")
        )

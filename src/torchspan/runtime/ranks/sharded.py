"""The sharded engine of a data-parallel replica: FSDP2 (``fully_shard``), gradients summed, exact.

``DataParallelReplica(module, shard=True)`` (and ``span(model, shard=True)`` in a launched job) keeps
one loss contract for every engine (``ranks.dataparallel``: each chunk's loss weighed by its
normalizer over the all-reduced global one, empty shards as stand-in rows at weight 0, ``join``,
micro-batches, recompute); this module is what changes when the replica is *sharded*:

- **Units**: ``fully_shard`` on each of torchspan's layers (``layers.model_layers``: the blocks of a
  transformer, else the top-level children) that owns parameters, then on the model (the root unit,
  last). A layer holding a parameter that another module also holds (tied embeddings: ``lm_head``
  and ``embed_tokens``) stays in the root unit, so the tie stays one parameter (one ``DTensor``).
- **Identical start**: FSDP2 shards each rank's own tensors and broadcasts nothing, so parameters
  and buffers are broadcast from the group's first rank before sharding.
- **A model built on meta** (``weights=``): ``fully_shard`` runs on the ``meta`` model, ``to_empty``
  allocates this rank's shards, and ``ranks.metaweights.fill`` writes them (the model's own
  initialisation replayed, or this rank's rows read from a checkpoint): no rank holds the whole model.
- **Reduction**: every unit reduce-scatters by SUM (``set_gradient_divide_factor(1.0)`` and
  ``set_force_sum_reduction_for_comms(True)``: no division anywhere); a mean's normalizer is already
  in each rank's loss weight, so the summed gradient is one device's on the whole global batch.
  ``.grad`` is a ``DTensor`` holding this rank's shard; ``.grad.full_tensor()`` is that gradient.
- **Micro-batches**: every chunk but the last runs with ``set_requires_gradient_sync(False)``
  (gradients accumulate unreduced), the last one's backward reduce-scatters once.
- **Precision**: ``"bf16"`` is FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)``: parameters all-gathered and computed in bf16, each rank's gradient cast to
  float32 before the sum, float32 shards (and optimizer state) kept; the root's outputs come back as
  float32 so a loss is taken in float32, as under autocast. ``"fp16"`` is refused (use bf16).
- **ZeRO-3 / ZeRO-2**: ``reshard_after_forward=True`` (default) frees each unit's gathered parameters
  after its forward and gathers them again in backward; ``False`` keeps them from forward to backward
  (less communication, more memory). The root unit keeps FSDP2's default (not resharded).
- **Offload** (``offload="cpu"``): FSDP2's ``CPUOffloadPolicy``: parameter shards, gradients and
  optimizer state live in (pinned) CPU memory, each unit is copied to the accelerator for its
  forward/backward, and ``optimizer.step()`` runs on the CPU. It needs an accelerator (CUDA); without
  one it is refused with a ``ValueError`` before anything is sharded.
- **State dict**: ``state_dict()`` gathers full tensors with the model's own keys on every rank
  (``get_model_state_dict(full_state_dict=True)``: a collective, call it on every rank);
  ``load_state_dict`` takes full tensors (each rank keeps its shard) or sharded ``DTensor``s. For a
  model too large to gather, ``replica.module.state_dict()`` is the sharded form: the same keys,
  each value a ``DTensor`` holding this rank's shard (what ``torch.distributed.checkpoint`` saves).
- A forward is a collective here (it all-gathers parameters), also under ``torch.no_grad()``: every
  rank runs it (the DDP engine's no-grad forward is local).

Usage (``DataParallelReplica`` does this)::

    engine = ShardedEngine(module, device, group, precision="bf16", reshard_after_forward=True, offload=None)
    with engine.no_sync():
        engine(x).sum().backward()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ...layers import model_layers
from ..metainit import bind, meta_slots
from ..microbatch import batch_size
from .metaweights import fill

__all__ = [
    "OFFLOADS",
    "ShardedEngine",
    "check_shard_options",
    "device_mesh",
    "exclusive_layers",
    "first_row",
    "local_bytes",
    "no_rows",
    "shard_units",
    "stand_ins",
]

OFFLOADS = (None, "cpu")


def check_shard_options(shard: bool, offload: str | None, precision: str, reshard_after_forward: Any) -> None:
    """``ValueError`` for an offload torchspan does not know, offload or ``reshard_after_forward=False``
    without sharding, fp16 sharded, or offload where no accelerator exists (FSDP2's ``CPUOffloadPolicy``
    computes on one)."""
    if not isinstance(shard, bool):
        raise ValueError(f"shard={shard!r} must be True or False")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"reshard_after_forward={reshard_after_forward!r} must be True (ZeRO-3) or False (ZeRO-2)"
        )
    if offload not in OFFLOADS:
        raise ValueError(f"offload={offload!r} is not one of None, 'cpu'")
    if offload is not None and not shard:
        raise ValueError(
            f"offload={offload!r} needs shard=True: parameters, gradients and optimizer state are "
            "offloaded shard by shard (FSDP2's CPUOffloadPolicy); use span(model, shard=True, offload='cpu')"
        )
    if not reshard_after_forward and not shard:
        raise ValueError(
            "reshard_after_forward=False needs shard=True: it keeps FSDP2's gathered parameters from the "
            "forward to the backward (ZeRO-2), and without sharding nothing is gathered; use span(model, "
            "shard=True, reshard_after_forward=False), or leave reshard_after_forward out"
        )
    if shard and precision == "fp16":
        raise ValueError(
            "precision='fp16' is not supported with shard=True (an overflow check over sharded gradients "
            "would need its own collective); use precision='bf16', which shards with FSDP2's "
            "MixedPrecisionPolicy and reduces in float32"
        )
    if offload == "cpu" and not _accelerator():
        raise ValueError(
            "offload='cpu' needs an accelerator (a CUDA GPU), and this machine has none: FSDP2's "
            "CPUOffloadPolicy keeps parameters, gradients and optimizer state in CPU memory and copies "
            "each unit to the GPU to compute it. On a CPU-only machine everything already lives in CPU "
            "memory: use span(model, shard=True) without offload"
        )


def _accelerator() -> bool:
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        return bool(acc.is_available())
    return torch.cuda.is_available()  # pragma: no cover - torch < 2.6


def shard_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers ``fully_shard`` wraps before the root: each ``model_layers`` layer that owns a parameter,
    except one holding a parameter another module outside it also holds (a tie stays in the root unit)."""
    return exclusive_layers(
        module, [(layer.name, layer.module) for layer in model_layers(module).layers if layer.name]
    )


def exclusive_layers(
    module: nn.Module, layers: Sequence[tuple[str, nn.Module]]
) -> list[tuple[str, nn.Module]]:
    """The ``(qualified name, layer)`` pairs of ``layers`` (modules of ``module``) that own a parameter and
    hold none that ``module`` also reaches by a name outside the layer (a tied parameter), in the order
    given."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    units = []
    for name, layer in layers:
        params = list(layer.parameters())
        inside = name + "."
        if params and all(n.startswith(inside) for p in params for n in names.get(id(p), ())):
            units.append((name, layer))
    return units


def broadcast_module(module: nn.Module, group: Any, comm: torch.device) -> None:
    """Every parameter and buffer of ``module`` set to the group's first rank's values (each tensor once)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    seen: set[int] = set()
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if (
                id(t) in seen or t.device.type == "meta" or hasattr(t, "device_mesh")
            ):  # a DTensor: made alike already
                continue
            seen.add(id(t))
            if t.device == comm:
                dist.broadcast(t, src, group=group)
            else:
                tmp = t.detach().to(comm)
                dist.broadcast(tmp, src, group=group)
                t.copy_(tmp)


def _to_empty(module: nn.Module, device: torch.device) -> None:
    """FSDP2's ``to_empty``: this rank's shards (and every buffer) allocated on ``device``, uninitialised; the
    buffers that were not on meta keep their values."""
    kept = [
        (m, k, b) for m in module.modules() for k, b in m._buffers.items() if b is not None and not b.is_meta
    ]
    module.to_empty(device=device)
    for m, k, b in kept:
        m._buffers[k] = b.to(device)


def device_mesh(group: Any, device_type: str) -> Any:
    """A one-dimensional ``DeviceMesh`` over ``group`` (``None``: the default group), for ``fully_shard``."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device_type)


def local_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds of ``module``'s parameters, gradients and ``optimizer``'s state (a ``DTensor``
    counts its local shard): ``{"params", "grads", "optimizer"}``, each parameter once."""

    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()

    params = list(dict.fromkeys(module.parameters()))
    state = optimizer.state if optimizer is not None else {}
    return {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            nbytes(v)
            for p in params
            for v in state.get(p, {}).values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ),
    }


def no_rows(value: Any) -> Any:
    """The same structure with every batched tensor cut to zero rows (a stand-in row's outputs, for an empty
    chunk)."""
    return tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, value)


def first_row(value: Any) -> Any:
    """The same structure with every batched tensor cut to its first row (a stand-in for an empty shard)."""
    leaves, spec = tree_flatten(value)
    return tree_unflatten(
        [t[:1].clone() if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in leaves], spec
    )


def stand_ins(
    chunks: Sequence[Any], targets: Sequence[Any], pad_to: int, template: tuple[Any, Any] | None
) -> list[tuple[Any, Any, bool]]:
    """``(chunk, target, stand_in)`` for a sharded step: every forward gathers parameters, so every rank runs
    as many chunks (``pad_to``, the step's micro-batches: a shard with fewer rows is padded) and none of zero
    rows (a chunk with no rows runs a stand-in row: the first row of a chunk that has some, else ``template``,
    the last step's; without either, the empty chunk itself). A stand-in weighs 0 and leaves buffers as they
    were."""
    row = next(
        ((first_row(c), first_row(t)) for c, t in zip(chunks, targets) if batch_size(*c) > 0), template
    )
    plan = [
        (c, t, False) if batch_size(*c) > 0 or row is None else (row[0], row[1], True)
        for c, t in zip(chunks, targets)
    ]
    spare = row if row is not None else (chunks[-1], targets[-1])
    return plan + [(spare[0], spare[1], True)] * max(0, pad_to - len(plan))


class ShardedEngine:
    """``module`` sharded by FSDP2 over ``group`` (see the module docstring); ``module`` is changed in
    place."""

    collective_forward = True  # a forward all-gathers parameters: every rank runs every forward
    # FSDP2 reduce-scatters by SUM and adds each call's shard to .grad itself: a backward of the loss as it
    # is, nothing set aside, no loss carried in the reduction (DDPEngine's counterparts, in ranks.ddp)
    grad_scale = 1.0
    sets_aside = False
    carrier = None

    @staticmethod
    def summing(out: Any) -> Any:
        """A forward's outputs for a backward the user runs: as they are (the reduction already sums)."""
        return out

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        group: Any,
        comm: torch.device,
        *,
        precision: str = "32",
        reshard_after_forward: bool = True,
        offload: str | None = None,
        weights: Any = None,
    ) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        given = (
            group if hasattr(group, "get_group") else None
        )  # a DeviceMesh dimension: FSDP2 composes with its DTensors
        group = given.get_group() if given is not None else group
        self.module, self.group = module, group
        self.offload, self.reshard_after_forward = offload, reshard_after_forward
        self.units = shard_units(module)
        slots = (
            meta_slots(module) if weights is not None else None
        )  # a model built on meta: sharded first, then filled
        if dist.get_world_size(group) > 1:
            broadcast_module(module, group, comm)
        mesh = given if given is not None else device_mesh(group, device.type)
        policy = OffloadPolicy() if offload is None else CPUOffloadPolicy()
        half = precision == "bf16"
        mixed = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if half else None, reduce_dtype=torch.float32 if half else None
        )
        for _, unit in self.units:
            fully_shard(
                unit,
                mesh=mesh,
                reshard_after_forward=reshard_after_forward,
                mp_policy=mixed,
                offload_policy=policy,
            )
        root = MixedPrecisionPolicy(
            mixed.param_dtype, mixed.reduce_dtype, output_dtype=torch.float32 if half else None
        )
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=None if reshard_after_forward else False,
            mp_policy=root,
            offload_policy=policy,
        )
        for sharded in self.sharded_modules():
            sharded.set_gradient_divide_factor(1.0)  # a SUM: the loss weights hold each rank's share
            sharded.set_force_sum_reduction_for_comms(True)
        if slots is not None:
            _to_empty(module, torch.device("cpu") if offload else device)
            bind(slots, module)
            fill(module, slots, weights, group=group, comm=comm)

    def sharded_modules(self) -> list[Any]:
        """Every ``fully_shard`` unit, the root last."""
        return [unit for _, unit in self.units] + [self.module]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def inference(self, *args: Any, **kwargs: Any) -> Any:
        """The forward under ``no_grad``: still a collective (parameters are gathered unit by unit)."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate unreduced gradients; the next backward outside reduce-scatters their
        sum."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def autocast(self, device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
        """Nothing: the mixed precision policy casts parameters, inputs and outputs."""
        return contextlib.nullcontext()

    def train(self, mode: bool) -> None:
        self.module.train(mode)

    def state_dict(self, *, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """Full tensors with the model's own keys (gathered: every rank calls it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if keep_vars:
            raise ValueError(
                "keep_vars=True would return the sharded parameters; use "
                "replica.module.state_dict(keep_vars=True)"
            )
        full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        out = destination if destination is not None else {}
        for key, value in full.items():
            out[prefix + key] = value
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Full tensors (each rank keeps its shard) or ``DTensor`` shards, by the model's own keys."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if any(hasattr(v, "to_local") for v in state_dict.values()):
            return self.module.load_state_dict(state_dict, strict=strict)
        return set_model_state_dict(
            self.module, dict(state_dict), options=StateDictOptions(full_state_dict=True, strict=strict)
        )

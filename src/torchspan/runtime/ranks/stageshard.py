"""Pipeline x sharded: each pipeline stage's layers sharded by FSDP2 over that stage's data-parallel group.

A launched job of ``replicas x stages`` ranks (``Mesh``) with ``shard=True`` (or a plan's ``shard`` with
several stages and ``data_parallel > 1``): every rank holds one stage of one replica (``RankStage``),
and the replicas of a stage shard that stage's parameters, gradients and optimizer state among
themselves: FSDP2 within a stage, a pipeline across stages (torchtitan's composition of
``fully_shard`` with ``torch.distributed.pipelining``). ``RankStage.shard`` makes a ``StageShards``:

- **Units**: ``fully_shard`` on each of this stage's layers that owns parameters no other module holds
  (``sharded.exclusive_layers``), over the stage's ``dp_shard`` sub-mesh of the job's ``DeviceMesh``
  (``RankStage.dp_mesh``). Each unit is its own FSDP root: a pipeline rank runs no forward over
  its whole stage. What no unit holds stays replicated and is summed in the stage's group by
  ``RankStage`` as in the hybrid: a parameter tied across stages (in its tie group: one parameter on
  every rank), the model's own tensors (root attributes), a layer sharing a parameter with another.
- **Start**: ``RankStage.start`` broadcasts replica 0's stage; the units are sharded after it.
- **Reduction**: every backward of a step runs with FSDP2's gradient sync off (``set_requires_gradient_sync``,
  ``set_reshard_after_backward`` and ``set_is_last_backward`` all ``False``: gradients accumulate
  unsharded, parameters stay gathered from a micro-batch's backward to the next forward). Once this
  rank's last backward ran (``Reduction.finished``, where the replicated gradients' all-reduces
  start) each unit's post-backward runs by hand with sync on, as ``torch.distributed.pipelining``'s
  ``PipelineStage.perform_reduce_grad`` does: one reduce-scatter per unit per step, by SUM
  (``set_gradient_divide_factor(1.0)``, ``set_force_sum_reduction_for_comms(True)``). Each micro-batch's
  loss weight already holds its share of the global normalizer (``RankStage.weights``), so the sum
  is one device's gradient on the whole global batch; ``.grad`` is a ``DTensor`` (this rank's shard).
- **Precision**: ``"bf16"`` autocasts each stage as the hybrid does (no ``MixedPrecisionPolicy``: float32
  shards gathered and float32 gradients reduced).
- **Collective forwards**: a unit's forward all-gathers, so every replica runs every forward: the same
  micro-batch count (each shard has at least ``microbatches`` rows, as in the hybrid), ``spanned(x)`` on
  every rank, and a loss calibration's dry forward on every rank when any rank needs one
  (``resolve_together``: one flag all-reduce over the job).
- **Optimizers built before sharding**: ``fully_shard`` replaces each parameter by a new ``DTensor``
  parameter. The model's own forward places (and shards) its stage at the first call, so an optimizer
  built from ``spanned.parameters()`` before it holds the replaced parameters; its first ``step()``
  (a global optimizer step pre-hook) swaps them for their sharded replacements, exact while it holds
  no state for them (otherwise it raises). Build optimizers after the first ``train_step`` to skip it.
- **State dict**: ``full_state`` gathers this stage's ``DTensor`` entries into full tensors (other stages'
  entries stay ``meta``, as in the hybrid); ``load_full`` cuts full tensors to this rank's shards.

Usage (``RankStage`` does this)::

    shards = StageShards(model, [("0", model[0]), ("2", model[2])], stage_group, device, tied=set())
    shards.begin()                # before the step's first backward
    shards.reduce()               # after this rank's last backward: one reduce-scatter per unit
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..losscheck import LossChecks
from ..lossweights import LossSpec
from .sharded import device_mesh, exclusive_layers

__all__ = ["StageShards", "resolve_together"]


class StageShards:
    """``layers`` (this stage's ``(name, module)`` pairs) sharded over ``group`` (see the module docstring);
    ``tied``: ids of parameters tied across stages (never in a unit)."""

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[tuple[str, nn.Module]],
        group: Any,
        device: torch.device,
        *,
        tied: Collection[int] = (),
        reshard_after_forward: bool = True,
    ) -> None:
        from torch.distributed.fsdp import fully_shard

        self.units = [
            (n, m)
            for n, m in exclusive_layers(model, layers)
            if not any(id(p) in tied for p in m.parameters())
        ]
        self.mesh = (
            group if hasattr(group, "get_group") else device_mesh(group, device.type)
        )  # the job mesh's dp_shard
        for _, unit in self.units:
            before = {
                (id(m), k): p for m in unit.modules() for k, p in m._parameters.items() if p is not None
            }
            fully_shard(unit, mesh=self.mesh, reshard_after_forward=reshard_after_forward)
            after = {(id(m), k): p for m in unit.modules() for k, p in m._parameters.items() if p is not None}
            for key, old in before.items():
                _replace(old, after[key])
            unit.set_gradient_divide_factor(1.0)  # a SUM: the loss weights hold each replica's share
            unit.set_force_sum_reduction_for_comms(True)
        self._ids = {id(p) for _, unit in self.units for p in unit.parameters()}

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is a unit's (sharded) parameter, reduced by FSDP2 rather than all-reduced."""
        return id(p) in self._ids

    def _set(self, on: bool) -> None:
        for _, unit in self.units:
            unit.set_is_last_backward(on)
            unit.set_reshard_after_backward(on)
            unit.set_requires_gradient_sync(on)

    def begin(self) -> None:
        """Before a step: its backwards accumulate unsharded gradients, nothing is reduced yet."""
        self._set(False)

    def reduce(self) -> None:
        """After this rank's last backward of the step: each unit reduce-scatters its accumulated gradient
        (SUM) into ``.grad`` and reshards its parameters (FSDP2's post-backward, run by hand)."""
        self._set(True)
        for _, unit in self.units:
            state = unit._get_fsdp_state()  # type: ignore[operator]
            if not state._is_root:  # never ran a forward: nothing to reduce
                continue
            for each in state._state_ctx.all_states:
                for group in _param_groups(each):
                    group.post_backward()
            state._root_post_backward_final_callback()

    def abandon(self) -> None:
        """After a step that failed: discard what FSDP2 accumulated or gathered, sync back on."""
        for _, unit in self.units:
            state = unit._get_fsdp_state()  # type: ignore[operator]
            reset = getattr(unit, "reset_iter_state", None)
            if state._is_root and reset is not None:
                reset()
        self._set(True)

    def full_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` with every ``DTensor`` gathered into its full tensor (a collective in the stage's
        group)."""
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}

    def load_full(self, module: nn.Module, state: Mapping[str, Any], strict: bool = True) -> Any:
        """Load ``state`` into ``module``: a full tensor for a sharded entry keeps this rank's shard of it
        (other stages' entries are copied onto their ``meta`` stand-ins: nothing, as in the hybrid)."""
        from torch.distributed.tensor import distribute_tensor

        current = module.state_dict(keep_vars=True)
        local = {}
        for key, value in state.items():
            held = current.get(key)
            if (
                isinstance(held, DTensor)
                and isinstance(value, torch.Tensor)
                and not isinstance(value, DTensor)
            ):
                value = distribute_tensor(
                    value.detach().to(held.to_local().device),
                    held.device_mesh,
                    held.placements,
                    src_data_rank=None,
                )
            local[key] = value
        with (
            warnings.catch_warnings()
        ):  # other stages' entries land on their meta stand-ins: a no-op by design
            warnings.filterwarnings(
                "ignore", message=".*copying from a non-meta parameter in the checkpoint to a meta"
            )
            return module.load_state_dict(local, strict=strict)


# id(parameter fully_shard replaced) -> (a weak reference to it, its sharded replacement)
_REPLACED: dict[int, tuple[weakref.ref[torch.Tensor], nn.Parameter]] = {}
_HOOKED: list[Any] = []


def _replace(old: nn.Parameter, new: nn.Parameter) -> None:
    """Remember that ``new`` replaced ``old``; an optimizer holding ``old`` steps ``new``
    (``_swap_replaced``)."""
    if old is new:
        return
    for key in [k for k, (ref, _) in _REPLACED.items() if ref() is None]:
        del _REPLACED[key]
    _REPLACED[id(old)] = (weakref.ref(old), new)
    if not _HOOKED:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOKED.append(register_optimizer_step_pre_hook(_swap_replaced))


def _swap_replaced(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before any optimizer's step: parameters ``fully_shard`` replaced become their replacements in its
    groups."""
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            found = _REPLACED.get(id(p))
            if found is None or found[0]() is not p:
                continue
            if optimizer.state.get(p):
                raise RuntimeError(
                    "this optimizer has state for a parameter that span replaced by its sharded form "
                    "(pipeline x sharded shards a stage at its first call); build the optimizer from "
                    "spanned.parameters() after the first train_step"
                )
            params[i] = found[1]


def _param_groups(state: Any) -> list[Any]:
    """An FSDP state's parameter groups (``_fsdp_param_groups`` in newer PyTorch, one ``_fsdp_param_group``
    before)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    one = getattr(state, "_fsdp_param_group", None)
    return [one] if one is not None else []


class _NeedsForward(Exception):
    """Raised by a probe in place of a dry forward: this rank's calibration needs one."""


def resolve_together(
    checks: LossChecks,
    spec: LossSpec,
    targets: Sequence[Any],
    sizes: Sequence[int],
    dry_outputs: Callable[[], Sequence[Any]],
    target: Any,
    comm: torch.device,
) -> LossSpec:
    """``checks.resolve`` (a batch that is one shard of the global one) where a forward is a collective: each
    rank finds whether its calibration needs a dry forward without running one, one flag all-reduce over the
    job tells whether any rank does, and then every rank runs it (a rank that needs none discards the
    outputs)."""

    def probe() -> Sequence[Any]:
        raise _NeedsForward

    try:
        found: LossSpec | None = checks.resolve(spec, targets, sizes, probe, target=target, shards=True)
    except _NeedsForward:
        found = None
        checks.calibrations -= 1  # counted by the probe that ran no forward; counted again below
    flag = torch.tensor([0.0 if found is not None else 1.0], dtype=torch.float64, device=comm)
    dist.all_reduce(flag)
    if flag.item() == 0:
        return found  # type: ignore[return-value]
    outputs = list(dry_outputs())
    if found is not None:
        return found
    return checks.resolve(spec, targets, sizes, lambda: outputs, target=target, shards=True)

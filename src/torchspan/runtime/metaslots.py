"""Where each parameter and buffer of a meta-built model goes, as ``Slot``s: one per tensor (tied positions
share one), holding its ``meta`` original, its positions in the modules, and once materialised the real tensor
this rank holds (a full tensor, an FSDP2 shard, nothing for another stage's). ``runtime.metainit`` fills them.

Usage::

    slots = meta_slots(model)                       # before any placement
    materialize(slots, lambda slot: torch.device("cpu"))
    bind(slots, model)                              # the real tensors in every position
    restore(slots)                                  # or back to meta, when the span failed
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["Slot", "bind", "has_meta", "materialize", "meta_slots", "restore"]


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on ``meta``."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


class Slot:
    """One tensor of a meta-built model: its qualified ``names`` (several for a tie, the first registered
    first), ``positions`` ((module, "_parameters"/"_buffers", key) holding it), the ``meta`` original, and
    ``dest``: what this rank holds of it once materialized (a ``DTensor`` shard, a full tensor, or ``None``:
    not here)."""

    def __init__(
        self,
        meta: torch.Tensor,
        names: list[str],
        positions: list[tuple[nn.Module, str, str]],
        persistent: bool,
    ) -> None:
        self.meta, self.names, self.positions, self.persistent = meta, names, positions, persistent
        self.dest: torch.Tensor | None = None
        self.numel = meta.untyped_storage().nbytes() // max(meta.element_size(), 1)

    @property
    def name(self) -> str:
        return self.names[0]

    def region(self) -> tuple[slice, ...] | None:
        """The part of the full tensor this rank holds (``None``: none of it)."""
        if self.dest is None:
            return None
        if hasattr(self.dest, "device_mesh"):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(
                self.meta.shape, self.dest.device_mesh, self.dest.placements
            )
            return tuple(slice(o, o + s) for o, s in zip(offset, shape))
        return tuple(slice(0, s) for s in self.meta.shape)

    def local(self) -> torch.Tensor | None:
        """The tensor this rank's part is written into (a ``DTensor``'s local shard)."""
        if self.dest is None:
            return None
        return self.dest.to_local() if hasattr(self.dest, "to_local") else self.dest

    def write_local(self, piece: torch.Tensor) -> None:
        """``piece`` (this rank's ``region`` of the full tensor) into what this rank holds."""
        local = self.local()
        if local is not None:
            with torch.no_grad():
                local.copy_(piece.reshape(local.shape))

    def write(self, full: torch.Tensor) -> None:
        """The full tensor's value: this rank keeps its part."""
        region = self.region()
        if region is not None:
            self.write_local(full[region])

    def read(self) -> torch.Tensor | None:
        """The full value this rank can see (a ``DTensor`` is gathered: every rank calls it alike), on the
        CPU."""
        if self.dest is None:
            return None
        value = self.dest.full_tensor() if hasattr(self.dest, "full_tensor") else self.dest
        return value.detach().to("cpu")


def meta_slots(model: nn.Module) -> list[Slot]:
    """Every ``meta`` parameter and buffer of ``model``, one ``Slot`` per tensor (tied holders share it)."""
    slots: dict[int, Slot] = {}
    persistent = set(model.state_dict(keep_vars=True))
    for kind in ("_parameters", "_buffers"):
        for prefix, module in model.named_modules(remove_duplicate=False):
            for key, t in getattr(module, kind).items():
                if t is None or not t.is_meta:
                    continue
                name = f"{prefix}.{key}" if prefix else key
                found = slots.get(id(t))
                if found is None:
                    slots[id(t)] = Slot(t, [name], [(module, kind, key)], name in persistent)
                elif (module, kind, key) not in found.positions:
                    found.names.append(name)
                    found.positions.append((module, kind, key))
                    found.persistent = found.persistent or name in persistent
    return list(slots.values())


def bind(slots: Sequence[Slot], model: nn.Module) -> None:
    """Each slot's ``dest``: what its first position holds now (``None`` where that is still ``meta``)."""
    for slot in slots:
        module, kind, key = slot.positions[0]
        t = getattr(module, kind).get(key)
        slot.dest = None if t is None or t.is_meta else t


def materialize(slots: Sequence[Slot], where: Callable[[Slot], torch.device | None]) -> None:
    """Each slot ``where`` places becomes an empty tensor on that device in every position (a tie stays one
    tensor); the rest (``None``) stay ``meta``. Values come after (``run_init`` or a checkpoint)."""
    for slot in slots:
        device = where(slot)
        if device is None:
            continue
        real = torch.empty_like(slot.meta, device=device)
        if isinstance(slot.meta, nn.Parameter):
            real = nn.Parameter(real, requires_grad=slot.meta.requires_grad)
        for module, kind, key in slot.positions:
            getattr(module, kind)[key] = real


def restore(slots: Sequence[Slot]) -> None:
    """Every slot's positions back to its ``meta`` original (a span that failed leaves the model as it was
    given)."""
    for slot in slots:
        for module, kind, key in slot.positions:
            getattr(module, kind)[key] = slot.meta

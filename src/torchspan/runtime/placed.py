"""What a ``Spanned`` does about its state and its placement: torchspan owns where every stage lives.

``state_dict``/``load_state_dict`` speak the original model's keys (a sharded or tensor-parallel model's full
tensors); ``to``/``cuda``/``cpu``/``half()`` keep every stage where it is or refuse; a ``Spanned`` cannot be
pickled or deep-copied; the model's own attributes (``config``, ...) read through. :class:`Spanned` inherits
these from :class:`PlacedModule`, which reads ``self.module``, ``self._executor`` and ``self._settings``.

Usage: ``spanned.load_state_dict(torch.load("model.pt"))``; ``spanned.to("cpu")`` where every stage is on the
CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .ranks.checkpoint import model_keys
from .ranks.tensorparallel import full_tensors

__all__ = ["PlacedModule"]

_PLACEMENT_MSG = (
    "torchspan owns the placement of a Spanned model: each stage's layers already live on their "
    "device. To run elsewhere, build a new one: torchspan.span(spanned.module, devices=[...]) or with a plan"
)


def _load_under_module(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_rest: Any) -> None:
    """Load-state-dict pre-hook: ``{prefix}key`` (as ``Spanned.state_dict`` writes it) →
    ``{prefix}module.key``."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


def _same_device(placed: torch.device, asked: torch.device) -> bool:
    """Whether ``.to(asked)`` leaves a stage on ``placed`` where it is (``"cuda"`` means the current GPU)."""
    if placed.type != asked.type:
        return False
    if asked.index is None and placed.type == "cuda":  # pragma: no cover - needs a GPU
        return placed.index in (None, torch.cuda.current_device())
    return asked.index is None or placed.index == asked.index


class PlacedModule(nn.Module):
    """``Spanned``'s state and placement methods (module docstring); ``Spanned.__init__`` sets what they
    read."""

    module: nn.Module
    _executor: Any
    _settings: Any

    def __init__(self) -> None:
        super().__init__()
        # A Spanned nested in another module loads that module's checkpoints (keys without ``module.``).
        self._register_load_state_dict_pre_hook(
            _load_under_module, with_module=True
        )  # public name needs torch>=2.5

    def state_dict(
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> Any:  # type: ignore[override]
        """The original model's state dict (same keys as ``spanned.module.state_dict()``). Sharded
        (``mode == "sharded"``): full tensors gathered on every rank, a collective (call it on every rank);
        ``spanned.module.state_dict()`` is the sharded form (``DTensor`` shards, the same keys)."""
        if args:
            raise TypeError(
                "Spanned.state_dict takes keyword arguments only (destination=, prefix=, keep_vars=)"
            )
        state = self._executor.state_dict(
            self.module, destination=destination, prefix=prefix, keep_vars=keep_vars
        )
        split = "tp" in (
            getattr(self._settings.mesh, "mesh_dim_names", None) or ()
        )  # tensor parallel's DTensors
        return full_tensors(state) if split and not keep_vars else state

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:  # type: ignore[override]
        """Load the original model's keys; keys with a ``module.`` prefix (DataParallel/DDP) work too.

        Values are copied into the placed parameters, whatever device they were saved from (sharded: each
        rank keeps its shard of the full tensors).
        """
        if assign:
            raise ValueError(
                "load_state_dict(assign=True) would replace the placed parameters with the loaded tensors "
                "on their saved devices; torchspan owns placement, so use assign=False (values are copied "
                "in place)"
            )
        return self._executor.load_state_dict(self.module, model_keys(state_dict), strict=strict)

    def _apply(self, fn: Any, recurse: bool = True) -> PlacedModule:  # type: ignore[override]
        """``half()``/``float()`` work; anything that would move a stage off its device (``parent.cuda()``)
        raises."""
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            moved = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            if isinstance(moved, torch.Tensor) and moved.device != t.device:
                raise TypeError(
                    f"moving a Spanned's tensors from {t.device} to {moved.device} is not supported: "
                    f"{_PLACEMENT_MSG}"
                )
        return super()._apply(fn, recurse)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a Spanned cannot be pickled, saved whole or deep-copied (it holds worker state and a device "
            "placement). Save spanned.state_dict() (or torch.save(spanned.module)); to copy, span a copy "
            "of the model: torchspan.span(copy.deepcopy(spanned.module), devices=spanned.devices, "
            "balance=spanned.balance)"
        )

    def to(self, *args: Any, **kwargs: Any) -> PlacedModule:  # type: ignore[override]
        """A no-op to the device every stage already runs on (what a trainer asks while preparing a model); a
        dtype casts as ``half()`` does; anything that would move a stage raises ``TypeError``."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and any(not _same_device(d, device) for d in self._executor.devices):
            raise TypeError(f"Spanned.to({device}) is not supported: {_PLACEMENT_MSG}")
        return (
            self._apply(lambda t: t.to(dtype) if t.is_floating_point() else t) if dtype is not None else self
        )

    def __getattr__(self, name: str) -> Any:
        """The model's own attributes (``config``, ``generation_config``, ``main_input_name``, ...) for code
        that reads them from whatever it is handed, as trainers do; torchspan's own names come first."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if name.startswith("_") or module is None:
                raise
            return getattr(module, name)

    def cuda(self, device: Any = None) -> PlacedModule:  # type: ignore[override]
        raise TypeError(f"Spanned.cuda() is not supported: {_PLACEMENT_MSG}")

    def cpu(self) -> PlacedModule:  # type: ignore[override]
        if any(d.type != "cpu" for d in self._executor.devices):
            raise TypeError(f"Spanned.cpu() is not supported: {_PLACEMENT_MSG}")
        return self

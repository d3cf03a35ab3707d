"""fp16 with the loop every user writes: ``train_step`` leaves ``.grad`` unscaled, ``optimizer.step()`` is
right.

``SpanScaler`` is the ``torch.amp.GradScaler`` of ``span(..., precision="fp16")``. The executors
backpropagate ``scaler.scale(loss)``; the work ``GradScaler.step``/``update`` would do later happens
here, so the plain loop (``zero_grad(); train_step(...); [clip]; optimizer.step()``) trains as the
autocast + ``GradScaler`` loop does on one device:

- **End of each ``train_step``** (``finishing``): this step's gradients (earlier steps' are set
  aside first, so accumulation over several ``train_step`` calls stays exact) are unscaled in place
  and checked for inf/NaN by the kernel ``GradScaler.unscale_`` uses, then added to the earlier
  ones. On inf/NaN every ``.grad`` becomes ``None``, and stays ``None`` for the ``train_step`` calls
  before the next optimizer step: the optimizer skips those parameters, as ``GradScaler`` skips
  the step (costs one host sync per ``train_step``, as ``GradScaler.step`` has).
- **The optimizer step** (global ``torch.optim`` step hooks, acting only for optimizers holding
  these parameters): on an overflow every parameter of that optimizer is left without a gradient
  (the whole step is skipped); after the first such step the scale is updated once, as
  ``GradScaler.update`` (back off on overflow, grow after ``growth_interval`` clean steps).
- ``scaler.unscale_(opt)`` is a no-op (already unscaled), ``scaler.step(opt)`` is ``opt.step()`` and
  ``scaler.update()`` without a new scale a no-op, so loops written for a ``GradScaler`` stay right.

Across ranks each stage would decide alone to skip, so ``RankStage`` refuses ``precision="fp16"``.

Usage (``span`` and ``Spanned.train_step`` do this)::

    scaler = SpanScaler("cpu")
    with scaler.finishing(params):
        executor.train(...)                     # backward of scaler.scale(loss)
    optimizer.step()                            # skipped on overflow, then the scale updates
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

__all__ = ["SpanScaler"]


def _unscale(grads: Sequence[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    """Unscale ``grads`` in place (per device and dtype, ``GradScaler``'s kernel); 1.0 if any is inf/NaN."""
    found = torch.zeros(1, dtype=torch.float32, device=inv_scale.device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        values = g._values() if g.is_sparse else g
        groups.setdefault((values.device, values.dtype), []).append(values)
    per_device: dict[torch.device, torch.Tensor] = {}
    for (device, _), ts in groups.items():
        if device not in per_device:
            per_device[device] = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(ts, per_device[device], inv_scale.to(device))
    for f in per_device.values():
        found += f.to(found.device)
    return found


class SpanScaler(torch.amp.GradScaler):
    """The fp16 gradient scaler of a ``Spanned`` (see the module docstring); arguments as ``GradScaler``'s."""

    def __init__(self, device: str = "cuda", **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self.overflowed = False  # this window's gradients overflowed: dropped until the optimizer steps
        self._pending = False  # a train_step finished since the scale was last updated
        self._stepped = False  # an optimizer stepped since: the next train_step opens a new window
        self._ids: set[int] = set()
        self._owners: weakref.WeakKeyDictionary[Any, tuple[int, bool]] = weakref.WeakKeyDictionary()
        self._hooks: list[Any] = []

    # ------------------------------------------------------------------ train_step
    @contextlib.contextmanager
    def finishing(self, params: Sequence[nn.Parameter]) -> Iterator[None]:
        """Around one ``train_step``'s backward: its gradients unscaled and checked, earlier ones kept."""
        if not self.is_enabled():
            yield
            return
        if any(p.dtype == torch.float16 for p in params):
            raise ValueError(
                "precision='fp16' keeps float32 master weights, but some parameters are float16 (their "
                "gradients cannot be unscaled exactly, as GradScaler refuses too); keep the model in float32 "
                "(model.float()): autocast runs fp16"
            )
        self._watch(params)
        if self._stepped:  # the optimizer stepped since the last train_step: a new accumulation window
            self.overflowed, self._stepped = False, False
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        finished = False
        try:
            yield
            finished = True
        finally:
            self._finish(params, earlier, finished)

    def _finish(
        self, params: Sequence[nn.Parameter], earlier: list[torch.Tensor | None], finished: bool
    ) -> None:
        new = [p.grad for p in params]
        if finished and self._scale is not None:
            grads = [g for g in new if g is not None]
            inv_scale = self._scale.double().reciprocal().float()
            self.overflowed = self.overflowed or bool(_unscale(grads, inv_scale).item())
            self._pending = True
        if self.overflowed:
            for p in params:
                p.grad = None
            return
        for p, old, g in zip(params, earlier, new):
            if not finished:  # a failed step leaves what came before it
                p.grad = old
            elif old is not None:
                p.grad = old if g is None else old.add_(g)

    # ------------------------------------------------------------------ the optimizer step
    def _watch(self, params: Sequence[nn.Parameter]) -> None:
        self._ids = {id(p) for p in params}
        if self._hooks:
            return
        me = weakref.ref(self)

        def before(optimizer: Any, _args: Any, _kwargs: Any) -> None:
            scaler = me()
            if scaler is not None and scaler.overflowed and scaler._holds(optimizer):
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.grad = None  # GradScaler skips the whole step

        def after(optimizer: Any, _args: Any, _kwargs: Any) -> None:
            scaler = me()
            if scaler is not None and scaler._pending and scaler._holds(optimizer):
                scaler.stepped()

        self._hooks = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
        weakref.finalize(self, lambda hooks=self._hooks: [h.remove() for h in hooks])

    def _holds(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` steps any of these parameters (remembered per optimizer and parameter
        count)."""
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        known = self._owners.get(optimizer)
        if known is None or known[0] != count:
            known = (count, any(id(p) in self._ids for g in optimizer.param_groups for p in g["params"]))
            self._owners[optimizer] = known
        return known[1]

    def stepped(self) -> None:
        """An optimizer holding these parameters stepped: update the scale once for this window."""
        if self._pending and self._scale is not None and self._growth_tracker is not None:
            found = torch.full((1,), float(self.overflowed), dtype=torch.float32, device=self._scale.device)
            torch._amp_update_scale_(
                self._scale,
                self._growth_tracker,
                found,
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
            )
        self._pending = False
        self._stepped = True

    # ------------------------------------------------------------------ GradScaler's loop, kept right
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to do: ``train_step`` already left ``.grad`` unscaled."""

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()``: skipped on overflow and the scale updated by the step hooks."""
        result = optimizer.step(*args, **kwargs)
        self.stepped()  # an optimizer the hooks cannot see (not a torch.optim.Optimizer) counts too
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Set ``new_scale`` if given; otherwise nothing: the scale was updated when the optimizer stepped."""
        if new_scale is None or not self.is_enabled():
            return
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(torch.device(self._device))
        super().update(new_scale)

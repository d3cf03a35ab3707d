"""The pipelined executor: stage functions on local devices, run by the threaded ``Pipeline``.

Stage functions come from an ``nn.Sequential`` (its layers in order, ``mode="sequential"``) or
from an fx trace split at layer boundaries (``mode="fx"``; one split per set of non-tensor
arguments, the one ``span`` traced serving calls with the forward's defaults).

Usage (``Spanned`` does this)::

    ex = PipelinedExecutor(model, "fx", graph, devices, groups, settings, recorder, meter)
    loss = ex.train(ex.prepare((x,), {}), targets, loss_fn, weights)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...layers import Slot, buffer_slots, top_level_modules
from ...layers import fxsplit as split
from ..executor import Executor, Settings, Work
from ..memory import ActivationMeter
from ..microbatch import NoSplit, batch_size, split_batch, split_sizes, split_value
from ..placement import check_shared, place
from ..record import Recorder
from .pipeline import Pipeline

__all__ = ["PipelinedExecutor"]


def _concrete_id(concrete: dict[str, Any]) -> frozenset[tuple[str, str, str]]:
    """What identifies a trace's specialised arguments (as ``split.concrete_key`` keys them: type and repr)."""
    return frozenset((name, type(v).__name__, repr(v)) for name, v in concrete.items())


class PipelinedExecutor(Executor):
    """``mode`` ``"sequential"`` or ``"fx"``; places the model on construction."""

    def __init__(
        self,
        model: nn.Module,
        mode: str,
        graph: Any,
        devices: Sequence[torch.device],
        groups: Sequence[Sequence[str]],
        settings: Settings,
        recorder: Recorder,
        meter: ActivationMeter,
    ) -> None:
        if mode not in ("sequential", "fx"):
            raise ValueError(f"mode={mode!r} is not a pipelined mode; use 'sequential' or 'fx' (hook placement is HookedExecutor)")
        super().__init__(devices, groups)
        self.mode = mode
        self.model = model
        self.settings = settings
        self._graphs: dict[Any, list[Any]] = {}
        self._default_trace: tuple[Any, list[Any]] | None = None  # (concrete id, stage modules) of span's trace
        worker_groups = [[s] for s in range(len(self.devices))] if settings.workers == "stage" else None
        self._pipeline = Pipeline(
            self.devices,
            checkpoint=settings.checkpoint,
            precision=settings.precision,
            recorder=recorder,
            meter=meter,
            groups=worker_groups,
        )
        self._place(graph)

    def _place(self, graph: Any) -> None:
        stage_of = self.stage_of
        check_shared(self.model, stage_of)
        if graph is None:
            place(self.model, stage_of, self.devices, self.root_attrs)
            return

        # Where the model's own parameters are first read decides their stage; they are moved there
        # before the stage modules capture them. Those modules serve every call whose non-tensor
        # arguments are the forward's defaults, so the first forward does not trace again.
        def put(attrs: dict[str, int]) -> None:
            self.root_attrs = dict(attrs)
            place(self.model, stage_of, self.devices, self.root_attrs)

        mods, _ = split.split_graph(self.model, graph, stage_of, len(self.devices), before_build=put)
        self._default_trace = (_concrete_id(split.default_concrete_args(self.model)), mods)

    # ------------------------------------------------------------------ inputs
    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
        m = self.settings.microbatches
        if self.mode == "sequential":
            if kwargs or len(args) != 1:
                raise TypeError(
                    f"an nn.Sequential takes one positional input; got {len(args)} positional and {sorted(kwargs)} keyword "
                    "argument(s)"
                )
            chunks = split_batch(args, {}, m)
            return Work([list(a) for a, _ in chunks], self._sequential_fns())
        fns, values = self._fx_fns(args, kwargs)
        total = batch_size(tuple(values), {})
        split_sizes(total, m)
        return Work(split_value(values, m, total, name="inputs"), fns)

    def _sequential_fns(self) -> list[Callable[..., Any]]:
        """One callable per stage running its layers in order (non-last stages return a 1-tuple)."""
        n = len(self.devices)
        layers = top_level_modules(self.model)

        def make(group: list[str], last: bool) -> Callable[..., Any]:
            mods = [layers[name] for name in group]

            def run(x: Any) -> Any:
                for mod in mods:
                    x = mod(x)
                return x if last else (x,)

            return run

        return [make(g, s == n - 1) for s, g in enumerate(self.groups)]

    def _fx_fns(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Callable[..., Any]], list[Any]]:
        values, concrete, key = split.concrete_key(self.model, args, kwargs, tensor_like=(NoSplit,))
        mods = self._graphs.get(key)
        if mods is None and self._default_trace is not None and self._default_trace[0] == _concrete_id(concrete):
            mods = self._graphs[key] = self._default_trace[1]
        if mods is None:
            graph = split.trace(self.model, concrete)
            mods, _ = split.split_graph(self.model, graph, self.stage_of, len(self.devices))
            self._graphs[key] = mods
        return list(mods), values

    def _stage_buffers(self) -> list[list[Slot]] | None:
        """Each stage's buffer slots, which a checkpoint recompute must leave unchanged (None: no recompute)."""
        if self.settings.checkpoint == "never":
            return None
        layers = top_level_modules(self.model)
        own: list[list[Slot]] = [[] for _ in self.devices]
        for name, b in self.model._buffers.items():
            if b is not None:
                own[self.root_attrs.get(name, 0)].append((self.model, name))
        return [buffer_slots([layers[n] for n in g], own[s]) for s, g in enumerate(self.groups)]

    # ------------------------------------------------------------------ running
    def forward(self, work: Work) -> list[Any]:
        return self._pipeline.forward(self._fns(work), work.chunks, self._stage_buffers())

    def train(
        self,
        work: Work,
        targets: Sequence[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        weights: Sequence[float],
    ) -> torch.Tensor:
        s = self.settings
        return self._pipeline.train(self._fns(work), work.chunks, targets, loss_fn, weights, s.schedule, s.scaler, self._stage_buffers())

    @staticmethod
    def _fns(work: Work) -> list[Callable[..., Any]]:
        if work.fns is None:
            raise ValueError("work.fns is None: this Work was not made by PipelinedExecutor.prepare; call prepare(args, kwargs) first")
        return work.fns

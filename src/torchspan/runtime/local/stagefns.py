"""Stage functions: a model cut into one callable per stage, for the pipelines that pass values between
stages.

From an ``nn.Sequential`` (its layers in order, ``mode="sequential"``) or from an fx trace split at
layer boundaries (``mode="fx"``; one split per set of non-tensor arguments, the one ``span`` traced
serving calls with the forward's defaults). The local pipeline and the pipeline across ranks hold
one ``StageFunctions`` each; they differ in where the stages' layers are placed (``split``'s ``put``).

Usage (an executor does this)::

    fns = StageFunctions(model, "fx", groups)
    fns.split(graph, put=lambda root_attrs: place(model, stage_of, devices, root_attrs))
    work = fns.prepare((x,), {}, microbatches=4)       # Work(chunks, stage functions)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from ...layers import Slot, buffer_slots, top_level_modules
from ...layers import fxsplit as split
from ..executor import Work
from ..microbatch import NoSplit, batch_size, split_batch, split_sizes, split_value

__all__ = ["StageFunctions", "concrete_id"]


def concrete_id(concrete: dict[str, Any]) -> frozenset[tuple[str, str, str]]:
    """What identifies a trace's specialised arguments (as ``split.concrete_key`` keys them: type and
    repr)."""
    return frozenset((name, type(v).__name__, repr(v)) for name, v in concrete.items())


class StageFunctions:
    """One callable per stage of ``groups`` (layer names per stage) of ``model``, run ``mode``'s way."""

    def __init__(self, model: nn.Module, mode: str, groups: Sequence[Sequence[str]]) -> None:
        if mode not in ("sequential", "fx"):
            raise ValueError(f"mode={mode!r} is not a stage-function mode; use 'sequential' or 'fx'")
        self.model, self.mode = model, mode
        self.groups = [list(g) for g in groups]
        self._graphs: dict[Any, list[Any]] = {}
        self._default_trace: tuple[Any, list[Any]] | None = (
            None  # (concrete id, stage modules) of span's trace
        )

    @property
    def stage_of(self) -> dict[str, int]:
        return {name: s for s, g in enumerate(self.groups) for name in g}

    def split(self, graph: Any, put: Callable[[dict[str, int]], None]) -> None:
        """Cut ``graph`` (``None`` for an ``nn.Sequential``) into stages; ``put(root_attrs)`` places the
        layers and the model's own tensors (by the stage that first reads them) before the stage modules
        capture them."""
        if graph is None:
            put({})
            return
        mods, _ = split.split_graph(self.model, graph, self.stage_of, len(self.groups), before_build=put)
        self._default_trace = (concrete_id(split.default_concrete_args(self.model)), mods)

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any], microbatches: int) -> Work:
        """The call's inputs split into ``microbatches`` chunks, with the stage functions that run them."""
        if self.mode == "sequential":
            if kwargs or len(args) != 1:
                raise TypeError(
                    f"an nn.Sequential takes one positional input; got {len(args)} positional and "
                    f"{sorted(kwargs)} keyword argument(s)"
                )
            chunks = split_batch(args, {}, microbatches)
            return Work([list(a) for a, _ in chunks], self._sequential())
        fns, values = self._traced(args, kwargs)
        total = batch_size(tuple(values), {})
        split_sizes(total, microbatches)
        return Work(split_value(values, microbatches, total, name="inputs"), fns)

    def _sequential(self) -> list[Callable[..., Any]]:
        """One callable per stage running its layers in order (non-last stages return a 1-tuple)."""
        n = len(self.groups)
        layers = top_level_modules(self.model)

        def make(group: list[str], last: bool) -> Callable[..., Any]:
            mods = [layers[name] for name in group]

            def run(x: Any) -> Any:
                for mod in mods:
                    x = mod(x)
                return x if last else (x,)

            return run

        return [make(g, s == n - 1) for s, g in enumerate(self.groups)]

    def _traced(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[list[Callable[..., Any]], list[Any]]:
        values, concrete, key = split.concrete_key(self.model, args, kwargs, tensor_like=(NoSplit,))
        mods = self._graphs.get(key)
        if (
            mods is None
            and self._default_trace is not None
            and self._default_trace[0] == concrete_id(concrete)
        ):
            mods = self._graphs[key] = self._default_trace[1]
        if mods is None:
            graph = split.trace(self.model, concrete)
            mods, _ = split.split_graph(self.model, graph, self.stage_of, len(self.groups))
            self._graphs[key] = mods
        return list(mods), values

    def buffers(self, root_attrs: Mapping[str, int], recompute: str) -> list[list[Slot]] | None:
        """Each stage's buffer slots, which a recompute must leave unchanged (None: no recompute)."""
        if recompute == "never":
            return None
        layers = top_level_modules(self.model)
        own: list[list[Slot]] = [[] for _ in self.groups]
        for name, b in self.model._buffers.items():
            if b is not None:
                own[root_attrs.get(name, 0)].append((self.model, name))
        return [buffer_slots([layers[n] for n in g], own[s]) for s, g in enumerate(self.groups)]

"""Other stages' layers on ``meta``, run once per call shape and replayed from then on.

A rank runs the layers of other stages on ``meta`` only for their outputs' shapes and dtypes, yet
torch's meta kernels for common ops (``addmm``, ``relu``, ``add``) are Python decompositions that
cost more than the real op on a small batch (``benchmarks/RESULTS.md``: half of a 2-rank step).
``MetaCalls`` runs such a call once per key (the call's route, its tensor arguments' shapes,
strides and dtypes, its plain arguments, the layer's training flag) and records the outputs as a
``_Template``: new ``meta`` tensors by shape/stride/dtype, or "the i-th argument itself". Every
call, the first included, returns outputs built from the template, so a forward behaves the same
whether or not the layer ran. A call with an argument or output that is not a tensor or a plain
value (a cache object a layer may update) is run every time.

Usage (``RankOwnForwardExecutor`` does this)::

    calls = MetaCalls()
    leaves, spec = tree_flatten(to_meta((args, kwargs)))
    out = calls.run(route, module, fn, leaves, spec)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["MetaCalls"]

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
_LIMIT = 4096  # templates kept (distinct call shapes); past it the cache starts over


class _Template:
    """A call's outputs: the pytree spec, and per leaf ``("in", i)``, ``("new", shape, stride, dtype)`` or ``("value", v)``."""

    __slots__ = ("spec", "leaves")

    def __init__(self, spec: Any, leaves: list[tuple[Any, ...]]) -> None:
        self.spec, self.leaves = spec, leaves

    @classmethod
    def of(cls, out: Any, inputs: list[torch.Tensor]) -> _Template | None:
        leaves, spec = tree_flatten(out)
        ids = {id(t): i for i, t in enumerate(inputs)}
        made: list[tuple[Any, ...]] = []
        for v in leaves:
            if isinstance(v, torch.Tensor):
                if not v.is_meta:
                    return None
                made.append(("in", ids[id(v)]) if id(v) in ids else ("new", tuple(v.shape), v.stride(), v.dtype))
            elif isinstance(v, _PLAIN):
                made.append(("value", v))
            else:
                return None
        return cls(spec, made)

    def build(self, inputs: list[torch.Tensor]) -> Any:
        out = []
        for leaf in self.leaves:
            if leaf[0] == "in":
                out.append(inputs[leaf[1]])
            elif leaf[0] == "new":
                out.append(torch.empty_strided(leaf[1], leaf[2], dtype=leaf[3], device="meta"))
            else:
                out.append(leaf[1])
        return tree_unflatten(out, self.spec)


class MetaCalls:
    """Templates of other stages' layer calls on this rank (see the module docstring)."""

    def __init__(self) -> None:
        self._templates: dict[tuple[Any, ...], _Template] = {}
        self.ran = 0  # calls that ran the layer (the rest were replayed)

    @staticmethod
    def _key(route: Any, module: nn.Module, leaves: list[Any]) -> tuple[Any, ...] | None:
        key: list[Any] = [id(route), module.training]
        for v in leaves:
            if isinstance(v, torch.Tensor):
                key.append((tuple(v.shape), v.stride(), v.dtype))
            elif isinstance(v, _PLAIN):
                key.append(v)
            else:
                return None
        return tuple(key)

    def run(self, route: Any, module: nn.Module, fn: Callable[..., Any], leaves: list[Any], spec: Any) -> Any:
        """``fn(*args, **kwargs)`` for the flattened ``(args, kwargs)`` (``leaves``: meta tensors and plain
        values, ``spec``), run without grad, or its recorded outputs for this call's key."""
        inputs = [t for t in leaves if isinstance(t, torch.Tensor)]
        key = self._key(route, module, leaves)
        template = self._templates.get(key) if key is not None else None
        if template is None:
            self.ran += 1
            args, kwargs = tree_unflatten(leaves, spec)
            out = fn(*args, **kwargs)
            template = _Template.of(out, inputs) if key is not None else None
            if template is None:
                return out
            if len(self._templates) >= _LIMIT:
                self._templates.clear()
            self._templates[key] = template
        return template.build(inputs)

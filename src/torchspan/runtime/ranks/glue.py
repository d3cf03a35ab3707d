"""How the model's own code made a value another stage holds: glue ops recorded, to be replayed.

On a pipeline rank the glue between layers runs with other stages' values as ``meta``
(``taint``). A value the glue combines from two stages (``inputs_embeds + position_embeds`` with the
token embedding on stage 0 and the position embedding on stage 1; a skip connection across a cut)
is then held by no rank. ``Recipes`` records, during one forward, every glue op whose result is
``meta`` here: the op, its arguments (real ones kept) and each tensor argument's version. When a
layer needs such a value, the ranks compare their ``tree``s of it (per position: held here or
not, how it was made), the owner receives the operands that earlier stages hold (``routes``) and
replays the ops (``rebuild``) with autograd, so gradients reach the received operands (and go
back to their stages) and the owner's own. A recipe whose tensors changed in place since is not
replayed (its tree stops there).

Usage (``RankOwnForwardExecutor`` and ``MetaTaint`` do this)::

    recipes = Recipes()
    recipes.record(func, args, kwargs, out)          # in the glue, for a meta result
    tree = recipes.tree(t, code_of, layer_of)          # what a rank sends in the route exchange
    x = recipes.rebuild(t, {(0,): received}, value_of, device)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["Recipes", "Node", "node_at", "layers_in"]

_LIMIT = 64  # positions a tree describes (deeper or wider: held by nobody, so not rebuilt)

# A position of a value, as one rank sees it: (code, dtype, children, layer, replayable): ``code`` as
# ``routes``' META/REAL/GRAD; ``children`` the nodes of the tensor arguments of the op that made it (``None``:
# no recipe
# here); ``layer`` the layer whose output it is (``None``: made by the glue or given); ``replayable``: nothing
# the op read or made changed in place since.
Node = tuple[int, Any, "tuple[Node, ...] | None", "str | None", bool]


class _Recipe:
    __slots__ = ("func", "leaves", "spec", "index", "operands", "versions", "out", "version", "grad")

    def __init__(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], index: int, out: torch.Tensor
    ) -> None:
        self.func, self.index, self.out = func, index, out
        self.leaves, self.spec = tree_flatten((args, kwargs))
        self.operands = [v for v in self.leaves if isinstance(v, torch.Tensor)]
        self.versions = [t._version for t in self.operands]
        self.version = out._version
        self.grad = torch.is_grad_enabled()

    def valid(self) -> bool:
        """Nothing it read or made changed in place since."""
        return self.out._version == self.version and all(
            t._version == v for t, v in zip(self.operands, self.versions)
        )

    def replay(self, values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        it = iter(values)
        meta = torch.device("meta")
        leaves = [
            next(it)
            if isinstance(v, torch.Tensor)
            else device
            if v == meta and isinstance(v, torch.device)
            else v
            for v in self.leaves
        ]
        args, kwargs = tree_unflatten(leaves, self.spec)
        with torch.set_grad_enabled(self.grad):
            out = self.func(*args, **kwargs)
        return tree_flatten(out)[0][self.index]


class Recipes:
    """The glue ops of one forward whose results are ``meta`` on this rank (see the module docstring)."""

    def __init__(self) -> None:
        self._by_id: dict[int, _Recipe] = {}  # id(meta result) -> its recipe (which keeps the result alive)

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Remember how each new ``meta`` tensor in ``out`` was made (not one of the op's own arguments)."""
        given = None
        for i, v in enumerate(tree_flatten(out)[0]):
            if isinstance(v, torch.Tensor) and v.is_meta:
                if given is None:
                    given = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
                if id(v) not in given:
                    self._by_id[id(v)] = _Recipe(func, args, kwargs, i, v)

    def clear(self) -> None:
        self._by_id.clear()

    def _of(self, t: torch.Tensor, valid: bool = True) -> _Recipe | None:
        recipe = self._by_id.get(id(t))
        if recipe is None or recipe.out is not t:
            return None
        return recipe if recipe.valid() or not valid else None

    def tree(
        self,
        t: torch.Tensor,
        code_of: Callable[[torch.Tensor], tuple[int, Any]],
        layer_of: Callable[[torch.Tensor], str | None],
    ) -> Node:
        """``t`` as this rank sees it, down through the recipes of the ``meta`` values it does not hold
        (``code_of``: code and dtype, code 0 for not held; ``layer_of``: the layer whose output a tensor
        is)."""
        budget = [_LIMIT]

        def node(x: torch.Tensor) -> Node:
            budget[0] -= 1
            code, dtype = code_of(x)
            recipe = self._of(x, valid=False) if x.is_meta and code == 0 and budget[0] > 0 else None
            children = None if recipe is None else tuple(node(o) for o in recipe.operands)
            return (code, dtype, children, layer_of(x), recipe is not None and recipe.valid())

        return node(t)

    def at(self, t: torch.Tensor, path: tuple[int, ...]) -> torch.Tensor | None:
        """The tensor at ``path`` below ``t`` (operand indices through recipes), or ``None``."""
        for j in path:
            recipe = self._of(t)
            if recipe is None or j >= len(recipe.operands):
                return None
            t = recipe.operands[j]
        return t

    def rebuild(
        self,
        t: torch.Tensor,
        received: dict[tuple[int, ...], torch.Tensor],
        value_of: Callable[[torch.Tensor], torch.Tensor | None],
        device: torch.device,
    ) -> torch.Tensor | None:
        """``t``'s value here: ``received`` positions as given, tensors this rank holds as ``value_of`` gives
        them (``None``: not held), the rest replayed from their recipes. ``None`` when a recipe is missing."""

        def value(x: torch.Tensor, path: tuple[int, ...]) -> torch.Tensor | None:
            if path in received:
                return received[path]
            held = value_of(x)
            if held is not None:
                return held
            recipe = self._of(x)
            if recipe is None:
                return None
            values = [value(o, (*path, j)) for j, o in enumerate(recipe.operands)]
            return None if any(v is None for v in values) else recipe.replay(values, device)  # type: ignore[arg-type]

        return value(t, ())


def node_at(node: Node | None, path: tuple[int, ...]) -> Node | None:
    """The node at ``path`` below ``node`` through replayable recipes (``None``: that rank cannot reach
    it)."""
    for j in path:
        if node is None or node[2] is None or not node[4] or j >= len(node[2]):
            return None
        node = node[2][j]
    return node


def layers_in(nodes: Any) -> list[str]:
    """The layers whose outputs appear in ``nodes`` (trees, or ``None``s), in order of first appearance."""
    found: list[str] = []

    def walk(node: Node | None) -> None:
        if node is None:
            return
        if node[3] is not None and node[3] not in found:
            found.append(node[3])
        for child in node[2] or ():
            walk(child)

    for n in nodes:
        walk(n)
    return found

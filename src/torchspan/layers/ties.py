"""Tied parameters: one ``nn.Parameter`` used by two or more layers, which must stay one logical parameter.

A tie is found structurally — the same Parameter object reachable under qualified names that lie in
different layers (GPT-2's ``transformer.wte.weight`` is ``lm_head.weight``; T5's ``shared.weight``
is ``encoder.embed_tokens.weight``, ``decoder.embed_tokens.weight`` and ``lm_head.weight``; a user
model that hands one Parameter to two modules) — and, when ``layers`` comes from ``find_layers``,
functionally too: a layer's parameter read by an op while another layer ran (``logits = h @
self.embed.weight.T`` inside the head). Pure data: no device work, no forward.

The runtime keeps one copy per device that holds a layer of the tie, sums the gradients of every
use into each and keeps the copies equal after each optimizer step; the planner may co-locate
``Tie.layers`` instead.

A model may also *say* what is tied (``declared_ties``): transformers' ``_tied_weights_keys`` under a config's
``tie_word_embeddings``. A model built on ``meta`` can have lost such a tie
(``accelerate.init_empty_weights()`` copies each parameter registered, ``lm_head.weight =
embed_tokens.weight`` too); ``runtime.ranks.metaweights`` ties it again before the weights are made.

Usage: ``[t.name for t in find_ties(model, find_layers(model, x))]`` → ``["transformer.wte.weight"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from .blocks import Layer, param_layers

__all__ = ["Alias", "Tie", "declared_ties", "find_ties"]


@dataclass(frozen=True)
class Alias:
    """One qualified name of a tied parameter and the layer that name lies in."""

    name: str
    layer: str


@dataclass(frozen=True)
class Tie:
    """A parameter shared by several layers.

    ``name``: its canonical qualified name (the one ``model.named_parameters()`` gives, so the one an
    optimizer built from it sees; ``state_dict`` keeps every alias as a key). ``aliases``: every qualified
    name (the canonical one first) with its layer. ``readers``: layers that read it without holding it.
    ``layers``: every layer involved, in execution order.
    """

    name: str
    aliases: tuple[Alias, ...]
    layers: tuple[str, ...]
    readers: tuple[str, ...] = ()
    numel: int = 0
    nbytes: int = 0


def find_ties(model: nn.Module, layers: Sequence[Layer]) -> list[Tie]:
    """Every parameter that two or more of ``layers`` share, ordered by the first layer that uses it.

    ``layers``: ``find_layers(model, ...)`` (a plain list of ``Layer`` gives structural ties only).
    Raises ``ValueError`` if ``layers`` does not cover the model's parameters.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    owner = param_layers(model, layers)
    index = {layer.name: layer.index for layer in layers}
    groups: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for qname, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), (p, []))[1].append(qname)
    canonical = {id(p): n for n, p in model.named_parameters()}
    readers: dict[str, set[str]] = {}
    for read in getattr(layers, "foreign_reads", ()):
        if read.reader is not None:
            readers.setdefault(read.name, set()).add(read.reader)
    ties = []
    for pid, (p, names) in groups.items():
        aliases = tuple(Alias(n, owner[n]) for n in names)
        held = {a.layer for a in aliases}
        read = set().union(*(readers.get(n, set()) for n in names)) - held
        involved = held | read
        if len(involved) < 2:
            continue
        ties.append(
            Tie(
                name=canonical[pid],
                aliases=aliases,
                layers=tuple(sorted(involved, key=lambda n: index[n])),
                readers=tuple(sorted(read, key=lambda n: index[n])),
                numel=p.numel(),
                nbytes=p.numel() * p.element_size(),
            )
        )
    return sorted(ties, key=lambda t: (index[t.layers[0]], t.name))


def declared_ties(model: nn.Module) -> list[tuple[str, str]]:
    """``(holder, source)`` qualified parameter names that ``model`` says are one tensor, whether they are now
    or not: transformers' own mapping (``get_expanded_tied_weights_keys``, 5.x: ``_tied_weights_keys`` where
    the config ties), else a config's ``tie_word_embeddings`` with ``get_output_embeddings().weight`` held by
    ``get_input_embeddings()``. ``[]`` for a model that says nothing. Reads only; the model's own methods are
    asked, nothing is changed."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    if callable(expand):
        try:
            pairs = list(expand(all_submodels=True).items())
        except Exception:  # a mapping its own code cannot expand: no declared tie to restore
            pairs = []
        return [(t, s) for t, s in pairs if t in params and s in params and t != s]
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return []
    try:
        source, holder = model.get_input_embeddings(), model.get_output_embeddings()  # type: ignore[operator]
    except Exception:  # no such methods, or transformers' base raising NotImplementedError
        return []
    names = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), name)
    found = []
    for module in (holder, source):
        prefix = names.get(id(module)) if isinstance(module, nn.Module) else None
        weight = f"{prefix}.weight" if prefix else "weight"
        if prefix is None or weight not in params:
            return []
        found.append(weight)
    return [(found[0], found[1])] if found[0] != found[1] else []

"""A ``Spanned`` that reads like the model it spans to code that inspects a model's class.

Trainers read a model's labels and loss behaviour from its class (transformers' ``find_labels`` and
``can_return_loss`` look at ``type(model).forward``'s parameters). ``Spanned.forward`` takes
``*args, **kwargs``, so ``dressed`` gives a span a subclass of ``Spanned`` (one per model class, named
``Spanned``) whose ``forward`` carries the model's own signature; nothing else changes.

Usage (``span`` does this)::

    spanned = dressed(Spanned(model, ...), model)
    inspect.signature(type(spanned).forward)    # the model's: (input_ids, ..., labels, ...)
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from .spanned import Spanned

__all__ = ["dressed"]

_CLASSES: dict[type, type] = {}


def dressed(spanned: Spanned, model: nn.Module) -> Spanned:
    """``spanned`` as an instance of ``Spanned``'s subclass for ``type(model)`` (see the module docstring)."""
    cls = _CLASSES.get(type(model))
    if cls is None:
        try:
            signature = inspect.signature(type(model).forward)
        except (TypeError, ValueError):  # a forward without one (a C extension): keep Spanned's
            return spanned

        def forward(self: Spanned, *args: Any, **kwargs: Any) -> Any:
            return Spanned.forward(self, *args, **kwargs)

        forward.__signature__ = signature  # type: ignore[attr-defined]
        forward.__doc__ = Spanned.forward.__doc__
        forward.__qualname__ = "Spanned.forward"
        namespace = {"forward": forward, "__module__": Spanned.__module__, "__qualname__": "Spanned"}
        cls = _CLASSES.setdefault(type(model), type("Spanned", (Spanned,), namespace))
    spanned.__class__ = cls
    return spanned

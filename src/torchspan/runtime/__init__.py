"""The local runtime: ``span(model, ...)`` places a model's layers on devices and pipelines training.

Modules: ``microbatch`` (split/gather), ``stream`` (copy streams, transfers), ``worker`` (threads,
mailbox, error propagation), ``memory`` (saved-activation meter), ``record`` (timeline),
``pipeline`` (schedule executor), ``hooks`` (hook placement), ``placement``, ``spanned`` (``span``).

Usage: ``from torchspan.runtime import span, Spanned, NoSplit``.
"""

from .microbatch import NoSplit
from .spanned import Spanned, span

__all__ = ["span", "Spanned", "NoSplit"]

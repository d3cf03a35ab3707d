"""The runtime: ``span(model, ...)`` places a model's layers on devices and pipelines training.

Modules: ``spanned`` (``span`` and the ``Spanned`` façade), ``executor`` (the interface executors
implement), ``local`` (executors in one process: pipeline, workers, streams, hooks),
``placement`` (stages from a balance or a plan, moving layers), ``microbatch`` (split/gather),
``lossweights`` (exact micro-batch weights), ``memory`` (saved-activation meter), ``footprint``
(bytes per stage), ``record`` (timeline ``Event``s).

Usage: ``from torchspan.runtime import span, Spanned, NoSplit``.
"""

from .microbatch import NoSplit
from .spanned import Spanned, span

__all__ = ["span", "Spanned", "NoSplit"]

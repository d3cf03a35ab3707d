"""The runtime: ``span(model, ...)`` places a model's layers on devices and pipelines training.

Modules: ``build`` (``span``: arguments and the choice of executor), ``spanned`` (the ``Spanned``
façade), ``executor`` (the interface executors implement), ``local`` (executors in one process:
pipeline, workers, streams, hooks, threads), ``ranks`` (several processes: env, shards, data
parallel, pipelines across ranks, checkpoints),
``placement`` (stages from a balance or a plan, moving layers), ``microbatch`` (split/gather),
``lossweights`` (exact micro-batch weights), ``memory`` (saved-activation meter), ``footprint``
(bytes per stage), ``record`` (timeline ``Event``s).

Usage: ``from torchspan.runtime import span, Spanned, NoSplit``.
"""

from .microbatch import NoSplit
from .build import span
from .spanned import Spanned

__all__ = ["span", "Spanned", "NoSplit"]

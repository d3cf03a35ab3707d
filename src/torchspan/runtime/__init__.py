"""The runtime: ``span(model, ...)`` places a model's layers on devices and pipelines training.

Modules: ``build`` (``span``: arguments → settings → stages → executor), ``layout`` (layers to
stages), ``choose`` (the one place that knows every executor), ``spanned`` (the ``Spanned``
façade), ``executor`` (the interface executors implement), ``layercall`` (how one layer runs:
precision, recompute, tied copies), ``local`` (executors in one process), ``ranks`` (several
processes: env, shards, data parallel, pipelines across ranks, checkpoints),
``placement`` (stages from a balance or a plan, moving layers), ``microbatch`` (split/gather),
``lossweights`` (exact micro-batch weights), ``memory`` (saved-activation meter), ``footprint``
(bytes per stage), ``record`` (timeline ``Event``s).

Usage: ``from torchspan.runtime import span, Spanned, NoSplit``.
"""

from .build import span
from .microbatch import NoSplit
from .spanned import Spanned

__all__ = ["span", "Spanned", "NoSplit"]

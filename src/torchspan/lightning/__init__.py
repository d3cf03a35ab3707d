"""Lightning on torchspan: strategies for ``lightning.pytorch.Trainer`` and ``lightning.fabric.Fabric``.

``SpanStrategy(**span_kwargs)`` (Trainer) and ``SpanFabricStrategy(**span_kwargs)`` (Fabric) train the model
with ``torchspan.span(model, **span_kwargs)``: one process (a local pipeline with ``devices=["cpu", "cpu"]``),
or launched (``torchspan launch``, torchrun, Lightning's own launcher) as exact data-parallel replicas,
sharded replicas (``shard=True``) or a pipeline across ranks (``devices=["cpu", "cpu"]`` on 2 ranks:
``lightning.staged``). Lightning is imported here only (``import torchspan`` never imports it); without it
installed, building a strategy raises ``ImportError`` naming the ``lightning`` extra.

Usage::

    import lightning as L
    from torchspan.lightning import SpanStrategy
    L.Trainer(strategy=SpanStrategy(), accelerator="cpu", max_epochs=3).fit(lit_module, loader)
"""

from __future__ import annotations

from .fabric import SpanFabricStrategy
from .trainer import SpanStrategy

__all__ = ["SpanStrategy", "SpanFabricStrategy"]

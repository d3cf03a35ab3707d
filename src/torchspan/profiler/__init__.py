"""Profiler: per-layer costs of training a model on devices (``torchspan.profile``).

Modules: ``costs`` (``LayerCost``, ``Profile``, ``MEMORY_KINDS``: pure data, what the planner
reads), ``measure`` (``profile()``), ``sizing`` (the fake forward/backward: bytes, FLOPs, traffic),
``timing`` (measured and estimated layer times), ``optim_state`` (optimizer-state bytes).

Usage::

    prof = torchspan.profile(model, torch.randn(32, 512), devices="cuda:0,cpu", optimizer="adam")
    prof.layers[0].param_bytes, prof.layers[0].forward_seconds(device=0, samples=8)
"""

from .costs import MEMORY_KINDS, LayerCost, Profile
from .measure import profile
from .optim_state import OPTIMIZERS, optimizer_state_bytes

__all__ = ["profile", "Profile", "LayerCost", "MEMORY_KINDS", "optimizer_state_bytes", "OPTIMIZERS"]

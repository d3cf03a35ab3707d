"""What a model is to torchspan: its layers, in execution order, and how to cut it into stages.

Modules: ``discovery`` (layer names, execution order, the recording forward), ``fxsplit`` (fx
trace and split at layer boundaries), ``slots`` (buffer slots a recompute must leave unchanged).
Every other part of torchspan receives its layers from here.

Usage: ``from torchspan.layers import execution_order, top_level_layers``.
"""

from .discovery import execution_order, layer_modules, record_forward, top_level_layers
from .fxsplit import (
    MODES,
    LayerTracer,
    choose_mode,
    concrete_key,
    default_concrete_args,
    graph_layer_order,
    split_graph,
    trace,
)
from .slots import Slot, buffer_slots, kept

__all__ = [
    "top_level_layers",
    "layer_modules",
    "execution_order",
    "record_forward",
    "MODES",
    "LayerTracer",
    "choose_mode",
    "trace",
    "concrete_key",
    "default_concrete_args",
    "graph_layer_order",
    "split_graph",
    "Slot",
    "buffer_slots",
    "kept",
]

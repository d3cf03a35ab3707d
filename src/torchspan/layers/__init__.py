"""What a model is to torchspan: its layers, in execution order, and how to cut it into stages.

Modules: ``discovery`` (``model_layers``: the layers everything places), ``blocks`` (``find_layers``:
blocks inside containers, execution order), ``ties`` (``find_ties``: parameters shared by layers),
``calltrace`` (the recording forward), ``fxsplit`` (fx
trace and split at layer boundaries), ``reuse`` (a module called more than once: stages that keep
its calls together), ``slots`` (buffer slots a recompute must leave unchanged).
Every other part of torchspan receives its layers from here.

Usage: ``from torchspan.layers import model_layers, find_ties``.
"""

from .blocks import Layer, LayerSet, RootTensor, find_layers, param_layers
from .discovery import (
    descends,
    execution_order,
    model_layers,
    module_entries,
    record_forward,
    top_level_layers,
    top_level_modules,
)
from .fxsplit import (
    MODES,
    LayerTracer,
    choose_mode,
    concrete_key,
    default_concrete_args,
    graph_calls,
    graph_layer_order,
    split_graph,
    trace,
)
from .reuse import check_stages
from .slots import Slot, buffer_slots, kept
from .ties import Tie, find_ties

__all__ = [
    "model_layers",
    "descends",
    "find_layers",
    "find_ties",
    "param_layers",
    "Layer",
    "LayerSet",
    "RootTensor",
    "Tie",
    "top_level_layers",
    "top_level_modules",
    "module_entries",
    "execution_order",
    "record_forward",
    "MODES",
    "LayerTracer",
    "choose_mode",
    "trace",
    "concrete_key",
    "default_concrete_args",
    "graph_layer_order",
    "graph_calls",
    "check_stages",
    "split_graph",
    "Slot",
    "buffer_slots",
    "kept",
]

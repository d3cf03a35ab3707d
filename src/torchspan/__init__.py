"""torchspan: train one PyTorch model across every device a machine has.

Usage::

    import torchspan
    print(torchspan.devices())                      # what this machine has
    report = torchspan.doctor(model, x, target=y, loss_fn=criterion)
    plan = torchspan.plan(model, x, devices="cuda:0,cpu")
    spanned = torchspan.span(model, plan)
    loss = spanned.train_step(x, y, criterion)

    # in a script started by `torchspan launch` (or torchrun): one exact data-parallel replica per process
    torchspan.init_distributed()
    spanned = torchspan.span(model)
    loss = spanned.train_step(*torchspan.shard_batch((x, y)), criterion)
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first use, so `import torchspan` stays fast)
_EXPORTS: dict[str, str] = {
    "Device": "torchspan.hardware",
    "devices": "torchspan.hardware",
    "to_device": "torchspan.hardware",
    "doctor": "torchspan.diagnosis",
    "watch": "torchspan.diagnosis",
    "Report": "torchspan.diagnosis",
    "DeviceMismatchError": "torchspan.diagnosis",
    "span": "torchspan.runtime",
    "Spanned": "torchspan.runtime",
    "NoSplit": "torchspan.runtime",
    "profile": "torchspan.profiler",
    "Profile": "torchspan.profiler",
    "plan": "torchspan.planner",
    "Plan": "torchspan.planner",
    "PlanError": "torchspan.planner",
    # several processes (``torchspan launch`` / torchrun): join the job, shard data, checkpoint once
    "init_distributed": "torchspan.runtime.ranks",
    "shard_batch": "torchspan.runtime.ranks",
    "rank_batches": "torchspan.runtime.ranks",
    "save_checkpoint": "torchspan.runtime.ranks",
    "load_checkpoint": "torchspan.runtime.ranks",
    "export_safetensors": "torchspan.runtime.ranks",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if (
        name == "hf"
    ):  # integrations, imported on first use: torchspan.hf.Trainer, torchspan.lightning.SpanStrategy
        return importlib.import_module("torchspan.hf")
    if name == "lightning":
        return importlib.import_module("torchspan.lightning")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchspan' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

"""``torchspan demo``: train a small character-level language model across this machine's devices.

Usage: ``from torchspan.demo import run_demo; result = run_demo(devices="cpu,cpu", steps=50, out="demo")``.
The corpus is torchspan's own installed source code and documentation (``corpus.py``); the model
is a small transformer whose top-level children are the layers the planner places (``model.py``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_demo", "DemoResult", "CharTransformer", "build_corpus"]


def __getattr__(name: str) -> Any:
    if name in ("run_demo", "DemoResult"):
        from . import run

        return getattr(run, name)
    if name == "CharTransformer":
        from .model import CharTransformer

        return CharTransformer
    if name == "build_corpus":
        from .corpus import build_corpus

        return build_corpus
    raise AttributeError(f"module 'torchspan.demo' has no attribute {name!r}")

"""Device diagnosis: a static audit (``doctor``), a runtime op watcher (``watch``), and reports.

Usage::

    report = torchspan.doctor(model, x, target=y, loss_fn=criterion, optimizer=opt)
    print(report)
    with torchspan.watch(model=model):
        model(x).sum().backward()       # raises DeviceMismatchError naming module, parameter, fix
"""

from __future__ import annotations

from .audit import doctor
from .mismatch import DeviceMismatchError
from .report import Finding, Report, TensorArg
from .watcher import watch

__all__ = ["doctor", "watch", "Report", "Finding", "TensorArg", "DeviceMismatchError"]

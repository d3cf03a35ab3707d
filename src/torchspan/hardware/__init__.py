"""Devices: what this machine has, devices described from datasheets, byte units, moving objects.

Modules: ``device`` (``Device``, ``parse_memory``, ``format_bytes``), ``inventory`` (``devices()``,
device specs, budgets, ``CUDA_VISIBLE_DEVICES``), ``catalog`` (accelerators you do not have, and
this CPU's measured speed), ``move`` (``to_device``).

Usage::

    from torchspan.hardware import devices, to_device
    devs = devices("cuda:0,cpu", memory={"cuda:0": "10GiB"})
    batch = to_device(batch, devs[0])
"""

from .device import Device, format_bytes, parse_memory
from .inventory import budget_key, devices, physical_index, resolve_device
from .move import to_device

__all__ = [
    "Device",
    "devices",
    "parse_memory",
    "format_bytes",
    "to_device",
    "resolve_device",
    "physical_index",
    "budget_key",
]

"""Devices you do not have: a small table of common accelerators, described from vendor datasheets.

``torchspan.devices("a100-40gb*2,cpu")`` looks up ``a100-40gb`` here and returns a *described*
``Device`` (``present=False``) that the profiler and planner can reason about but the runtime cannot
run on. Described accelerators are numbered ``cuda:0``, ``cuda:1``, … in the order they appear, so
memory budgets use those keys (``--memory cuda:0=20GiB``).

Usage::

    from torchspan.hardware import catalog
    catalog.names()                      # ['a100-40gb', 'a100-80gb', 'generic-cpu', ...]
    dev = catalog.lookup("h100-80gb")    # Device(cuda, 'NVIDIA H100 80GB SXM5', ...) or None
    catalog.flops_for(dev, torch.bfloat16)   # (989.4e12, 'BF16 dense (tensor cores)')

Figures per entry
    ``total_memory``  nominal capacity in GiB as the datasheet names it; CUDA reports 1-3% less and
                      the CUDA context takes a few hundred MiB more; give ``--memory`` for exact budgets.
    ``peak_flops``    dense FP32 (CUDA-core) FLOP/s: what float32 PyTorch training gets by default
                      (``torch.backends.cuda.matmul.allow_tf32`` is off). ``extra["flops"]`` holds the
                      dense (no 2:4 sparsity) TF32/BF16/FP16 tensor-core figures; ``flops_for`` picks
                      the one that matches a dtype.
    ``host_bandwidth`` bytes/s in ONE direction over the host link (datasheets quote both directions
                      together, e.g. PCIe Gen4 x16 "64 GB/s" -> 32e9 here).
    ``extra["memory_bandwidth"]`` device memory bytes/s (datasheet peak).
    ``extra["compute_efficiency"]``, ``extra["memory_efficiency"]``, ``extra["kernel_overhead"]``:
                      the fraction of peak that eager PyTorch reaches and the per-op launch/dispatch
                      cost used when times are estimated (stated assumptions, not measurements).

The present CPU is different: ``measure_host()`` times a matmul, a copy and a tiny op once per
process (cached), so estimates and measurements are on the same footing (see ``profiler``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .device import Device

__all__ = [
    "Entry",
    "ENTRIES",
    "names",
    "lookup",
    "entry",
    "match_name",
    "with_figures",
    "flops_for",
    "HostSpeed",
    "measure_host",
]

GIB = 2**30
TERA = 1e12
GIGA = 1e9

# one direction of an x16 link (datasheets quote both directions together)
_PCIE = {"PCIe Gen3 x16": 16 * GIGA, "PCIe Gen4 x16": 32 * GIGA, "PCIe Gen5 x16": 64 * GIGA}

# Stated assumptions for estimated times (see module docstring).
GPU_COMPUTE_EFFICIENCY = 0.6  # eager matmul-heavy layers reach roughly 50-75% of the dense peak
GPU_MEMORY_EFFICIENCY = 0.8  # elementwise kernels reach roughly 75-90% of peak memory bandwidth
GPU_KERNEL_OVERHEAD = 8e-6  # seconds per aten op: Python + dispatcher + launch in eager mode
CPU_COMPUTE_EFFICIENCY = 0.5
CPU_MEMORY_EFFICIENCY = 0.6
CPU_OP_OVERHEAD = 5e-6


@dataclass(frozen=True)
class Entry:
    """One described device: figures and where they come from."""

    key: str
    name: str
    kind: str  # "cuda" or "cpu"
    memory_gib: float
    memory_type: str
    memory_bandwidth: float  # bytes/s
    flops: dict[str, float]  # dense peak FLOP/s by precision: fp32, tf32, bf16, fp16
    host_link: str
    source: str
    aliases: tuple[str, ...] = ()
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def host_bandwidth(self) -> float:
        return (
            _PCIE[self.host_link] if self.host_link in _PCIE else float(self.extra.get("host_bandwidth", 0.0))
        )

    def device(self) -> Device:
        """A fresh described ``Device`` for this entry (CUDA index left for ``devices()`` to number)."""
        gpu = self.kind == "cuda"
        extra: dict[str, Any] = {
            "catalog": self.key,
            "memory_bandwidth": self.memory_bandwidth,
            "memory_type": self.memory_type,
            "flops": dict(self.flops),
            "peak_flops_precision": "FP32 dense" + (" (CUDA cores)" if gpu else " (vector FMA)"),
            "host_link": self.host_link,
            "compute_efficiency": GPU_COMPUTE_EFFICIENCY if gpu else CPU_COMPUTE_EFFICIENCY,
            "memory_efficiency": GPU_MEMORY_EFFICIENCY if gpu else CPU_MEMORY_EFFICIENCY,
            "kernel_overhead": GPU_KERNEL_OVERHEAD if gpu else CPU_OP_OVERHEAD,
        }
        if self.notes:
            extra["notes"] = self.notes
        extra.update({k: v for k, v in self.extra.items() if k != "host_bandwidth"})
        return Device(
            device=torch.device(self.kind),
            name=f"{self.name} (described)",
            total_memory=int(self.memory_gib * GIB),
            free_memory=None,
            physical="described",
            peak_flops=self.flops["fp32"],
            host_bandwidth=self.host_bandwidth,
            source=f"described: {self.source}",
            extra=extra,
        )


def _t(fp32: float, tf32: float, bf16: float, fp16: float) -> dict[str, float]:
    return {"fp32": fp32 * TERA, "tf32": tf32 * TERA, "bf16": bf16 * TERA, "fp16": fp16 * TERA}


ENTRIES: tuple[Entry, ...] = (
    Entry(
        "h100-80gb",
        "NVIDIA H100 80GB SXM5",
        "cuda",
        80,
        "HBM3",
        3350 * GIGA,
        _t(67, 494.7, 989.4, 989.4),
        "PCIe Gen5 x16",
        "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column; tensor figures halved to remove 2:4 "
        "sparsity)",
        aliases=("h100", "h100-sxm", "h100-sxm5", "h100-80gb-sxm"),
        notes="NVLink 900 GB/s between GPUs is not modelled; transfers use the host link",
    ),
    Entry(
        "h100-pcie",
        "NVIDIA H100 80GB PCIe",
        "cuda",
        80,
        "HBM2e",
        2000 * GIGA,
        _t(51, 378, 756, 756),
        "PCIe Gen5 x16",
        "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe column; tensor figures halved to remove 2:4 "
        "sparsity)",
        aliases=("h100-80gb-pcie",),
    ),
    Entry(
        "a100-40gb",
        "NVIDIA A100 40GB SXM4",
        "cuda",
        40,
        "HBM2",
        1555 * GIGA,
        _t(19.5, 156, 312, 312),
        "PCIe Gen4 x16",
        "NVIDIA A100 Tensor Core GPU datasheet (A100 40GB column; dense figures)",
        aliases=("a100-40g", "a100-sxm4-40gb"),
    ),
    Entry(
        "a100-80gb",
        "NVIDIA A100 80GB SXM4",
        "cuda",
        80,
        "HBM2e",
        2039 * GIGA,
        _t(19.5, 156, 312, 312),
        "PCIe Gen4 x16",
        "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column; dense figures)",
        aliases=("a100-80g", "a100-sxm4-80gb"),
    ),
    Entry(
        "v100-16gb",
        "NVIDIA V100 16GB SXM2",
        "cuda",
        16,
        "HBM2",
        900 * GIGA,
        _t(15.7, 15.7, 15.7, 125),
        "PCIe Gen3 x16",
        "NVIDIA Tesla V100 datasheet (V100 SXM2 column)",
        aliases=("v100-16g", "v100-sxm2-16gb"),
        notes="no TF32 or BF16 tensor cores: those precisions run at the FP32 rate here (an assumption)",
    ),
    Entry(
        "v100-32gb",
        "NVIDIA V100 32GB SXM2",
        "cuda",
        32,
        "HBM2",
        900 * GIGA,
        _t(15.7, 15.7, 15.7, 125),
        "PCIe Gen3 x16",
        "NVIDIA Tesla V100 datasheet (V100 SXM2 column)",
        aliases=("v100-32g", "v100-sxm2-32gb"),
        notes="no TF32 or BF16 tensor cores: those precisions run at the FP32 rate here (an assumption)",
    ),
    Entry(
        "l4",
        "NVIDIA L4 24GB",
        "cuda",
        24,
        "GDDR6",
        300 * GIGA,
        _t(30.3, 60, 121, 121),
        "PCIe Gen4 x16",
        "NVIDIA L4 Tensor Core GPU datasheet (tensor figures halved to remove 2:4 sparsity)",
        aliases=("l4-24gb", "nvidia-l4"),
    ),
    Entry(
        "t4",
        "NVIDIA T4 16GB",
        "cuda",
        16,
        "GDDR6",
        320 * GIGA,
        _t(8.1, 8.1, 8.1, 65),
        "PCIe Gen3 x16",
        "NVIDIA T4 Tensor Core GPU datasheet (FP16 figure is mixed FP16/FP32 tensor)",
        aliases=("t4-16gb", "tesla-t4"),
        notes="no TF32 or BF16 tensor cores: those precisions run at the FP32 rate here (an assumption)",
    ),
    Entry(
        "rtx-4090",
        "NVIDIA GeForce RTX 4090 24GB",
        "cuda",
        24,
        "GDDR6X",
        1008 * GIGA,
        _t(82.6, 82.6, 165.2, 165.2),
        "PCIe Gen4 x16",
        "NVIDIA Ada GPU Architecture whitepaper, appendix (GeForce RTX 4090; tensor FP16/BF16 with FP32 "
        "accumulate, dense)",
        aliases=("rtx4090", "4090", "geforce-rtx-4090"),
    ),
    Entry(
        "generic-cpu",
        "generic 16-core AVX2 server CPU, 64 GiB",
        "cpu",
        64,
        "DDR4-3200 (4 channels)",
        102.4 * GIGA,
        _t(1.28, 1.28, 1.28, 1.28),
        "PCIe Gen4 x16",
        "torchspan nominal figures: 16 cores x 2.5 GHz x 2 FMA units x 8 FP32 lanes x 2 FLOP; 4 x 25.6 "
        "GB/s DDR4-3200",
        aliases=("cpu-generic", "server-cpu"),
        notes="a stand-in for a CPU you do not have; the CPU you do have is measured instead ('cpu')",
    ),
)

_AMBIGUOUS: dict[str, tuple[str, ...]] = {
    "a100": ("a100-40gb", "a100-80gb"),
    "v100": ("v100-16gb", "v100-32gb"),
}


def _normalise(token: str) -> str:
    text = token.strip().lower()
    text = re.sub(r"^nvidia[-_ ]", "", text)
    text = re.sub(r"[\s_]+", "-", text)
    return text


def _index() -> dict[str, Entry]:
    table: dict[str, Entry] = {}
    for e in ENTRIES:
        table[e.key] = e
        for alias in e.aliases:
            table[alias] = e
    return table


_TABLE = _index()


def names() -> list[str]:
    """Catalog keys, sorted: ``['a100-40gb', 'a100-80gb', 'generic-cpu', 'h100-80gb', ...]``."""
    return sorted(e.key for e in ENTRIES)


def entry(token: str) -> Entry | None:
    """The catalog ``Entry`` for a name or alias (case-insensitive), or ``None``."""
    return _TABLE.get(_normalise(token))


def lookup(token: str) -> Device | None:
    """A described ``Device`` for ``token`` (``"a100-40gb"``, ``"H100"``, ``"rtx4090"``), else ``None``.

    Usage: ``catalog.lookup("l4").total_memory == 24 * 2**30``. A family name that matches more
    than one entry (``"a100"``) raises ``ValueError`` listing the choices.
    """
    if not isinstance(token, str):
        return None
    key = _normalise(token)
    if key in _AMBIGUOUS:
        choices = ", ".join(repr(c) for c in _AMBIGUOUS[key])
        raise ValueError(f"device {token!r} is ambiguous in torchspan's catalog; name one of {choices}")
    found = _TABLE.get(key)
    return None if found is None else found.device()


# (substrings that must all appear in a CUDA device name, catalog key); first match wins
_NAME_RULES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("h100", "pcie"), "h100-pcie"),
    (("h100",), "h100-80gb"),
    (("a100", "80g"), "a100-80gb"),
    (("a100",), "a100-40gb"),
    (("v100", "32g"), "v100-32gb"),
    (("v100",), "v100-16gb"),
    (("rtx", "4090"), "rtx-4090"),
    (("l4",), "l4"),
    (("t4",), "t4"),
)


def match_name(name: str) -> Entry | None:
    """The catalog entry for a GPU name as CUDA reports it (``"NVIDIA A100-SXM4-80GB"``), or ``None``."""
    words = re.split(r"[\s_-]+", name.lower())
    text = " ".join(words)
    for needles, key in _NAME_RULES:
        if all((n in words) if n in ("l4", "t4") else (n in text) for n in needles):
            return _TABLE[key]
    return None


def with_figures(device: Device) -> Device:
    """``device`` with speed figures from its catalog match filled in where it has none (a copy).

    Usage: ``with_figures(torchspan.devices("cuda:0")[0])`` on an A100 machine gets the A100's
    peak FLOP/s and memory bandwidth, so its times can be estimated. Unmatched devices come back as is.
    """
    if device.peak_flops or device.kind != "cuda":
        return device
    found = match_name(device.name)
    if found is None:
        return device
    described = found.device()
    extra = {**described.extra, **device.extra}
    return dataclasses.replace(
        device,
        peak_flops=described.peak_flops,
        host_bandwidth=device.host_bandwidth or described.host_bandwidth,
        extra=extra,
    )


_DTYPE_PRECISION = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}
_PRECISION_LABEL = {
    "fp32": "FP32 dense",
    "tf32": "TF32 dense (tensor cores)",
    "bf16": "BF16 dense (tensor cores)",
    "fp16": "FP16 dense (tensor cores)",
}


def flops_for(device: Device, dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """Peak FLOP/s of ``device`` for matmuls in ``dtype``, and which figure that is.

    float32 uses the TF32 tensor-core figure when PyTorch is set to allow it
    (``torch.set_float32_matmul_precision("high")``), else FP32. Devices without a per-precision
    table use ``device.peak_flops``. Raises ``ValueError`` when the device has no speed figure.
    """
    table = device.extra.get("flops") if isinstance(device.extra, dict) else None
    if table:
        precision = _DTYPE_PRECISION.get(dtype, "fp32")
        if precision == "fp32" and torch.get_float32_matmul_precision() != "highest" and "tf32" in table:
            precision = "tf32"
        return float(table[precision]), _PRECISION_LABEL[precision]
    if device.peak_flops:
        return float(device.peak_flops), str(device.extra.get("peak_flops_precision", "peak"))
    raise ValueError(
        f"device {device} ({device.name}) has no FLOP/s figure, so its times cannot be estimated; "
        f"use a catalog name ({', '.join(names())}) or set Device.peak_flops and extra['memory_bandwidth']"
    )


# --------------------------------------------------------------------------- the CPU that is here


@dataclass(frozen=True)
class HostSpeed:
    """Measured speed of this machine's CPU (PyTorch's current thread count)."""

    flops: float  # float32 matmul FLOP/s
    memory_bandwidth: float  # bytes/s (read + write of a large copy)
    op_overhead: float  # seconds for a tiny op (dispatch cost)
    threads: int
    method: str


@functools.cache
def _measure_host(threads: int) -> HostSpeed:
    n = 512
    gen = torch.Generator().manual_seed(0)  # a private generator: the caller's random state stays as it was
    a = torch.randn(n, n, generator=gen)
    b = torch.randn(n, n, generator=gen)
    out = torch.empty(n, n)

    def best(fn: Any, repeats: int) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    t_mm = best(lambda: torch.mm(a, b, out=out), 7)
    src = torch.empty(8 * 2**20)  # 32 MiB, well beyond caches
    dst = torch.empty_like(src)
    t_copy = best(lambda: dst.copy_(src), 7)
    tiny = torch.zeros(1)

    def ops() -> None:
        for _ in range(200):
            torch.add(tiny, 1.0)

    t_op = best(ops, 5) / 200
    return HostSpeed(
        flops=2 * n**3 / t_mm,
        memory_bandwidth=2 * src.numel() * src.element_size() / t_copy,
        op_overhead=t_op,
        threads=threads,
        method=f"measured: median of 7 float32 {n}x{n} matmuls, 7 copies of 32 MiB, 200 tiny adds; {threads} "
        "thread(s)",
    )


def measure_host() -> HostSpeed:
    """Measure this CPU once per process and thread count (about 0.1 s), then return the cached figures.

    Usage: ``catalog.measure_host().flops`` → e.g. ``1.1e11`` float32 FLOP/s.
    """
    return _measure_host(torch.get_num_threads())

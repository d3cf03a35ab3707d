"""What this machine has: find and describe devices, parse device specs and memory budgets.

``devices("cuda:0,1,cpu", memory={"cuda:0": "10GiB"})`` checks each entry against what is visible
(``CUDA_VISIBLE_DEVICES`` included), looks names it does not know up in ``catalog`` (devices you do
not have, described from datasheets) and applies the budgets.

Usage::

    from torchspan.hardware import devices, resolve_device
    devs = devices("cuda:0,cpu", memory={"cuda:0": "10GiB"})
    resolve_device("cpu") == torch.device("cpu")
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import warnings
from collections.abc import Mapping, Sequence

import torch

from . import catalog
from .device import Device, format_bytes, parse_memory

__all__ = ["devices", "resolve_device", "physical_index", "budget_key"]


def _cuda_count() -> int:
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # pragma: no cover - broken drivers
        return 0


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def physical_index(logical: int, env: Mapping[str, str] | None = None) -> str:
    """The physical GPU behind logical CUDA index ``logical``, per ``CUDA_VISIBLE_DEVICES``.

    Usage: with ``CUDA_VISIBLE_DEVICES=2,3``, ``physical_index(1) == "3"``. Entries may be
    indices or UUIDs (``GPU-…``/``MIG-…``); without the variable, physical == logical.
    """
    env = os.environ if env is None else env
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return str(logical)
    entries = [e.strip() for e in raw.split(",") if e.strip()]
    # PyTorch (like the CUDA runtime) stops at the first invalid entry.
    visible: list[str] = []
    for e in entries:
        if e.isdigit() or e.startswith(("GPU-", "MIG-")):
            visible.append(e)
        else:
            break
    if logical < len(visible):
        return visible[logical]
    return "?"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _cpu_memory() -> tuple[int | None, int | None]:
    total = free = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            info = {k.strip(): v for k, v in (line.split(":", 1) for line in fh if ":" in line)}
        total = int(info["MemTotal"].split()[0]) * 1024
        free = int(info.get("MemAvailable", info.get("MemFree", "0 kB")).split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            pass
    return total, free


def _describe_found(dev: torch.device) -> Device:
    if dev.type == "cpu":
        total, free = _cpu_memory()
        return Device(
            torch.device("cpu"), f"{_cpu_name()} ({os.cpu_count()} cores)", total, free, physical="cpu"
        )
    if dev.type == "cuda":
        idx = dev.index or 0
        props = torch.cuda.get_device_properties(idx)
        try:
            free, total = torch.cuda.mem_get_info(idx)
        except Exception:  # pragma: no cover - needs a GPU
            free, total = None, props.total_memory
        return Device(torch.device("cuda", idx), props.name, total, free, physical=physical_index(idx))
    if dev.type == "mps":
        total = None
        try:
            total = int(torch.mps.recommended_max_memory())  # type: ignore[attr-defined]
        except Exception:
            pass
        return Device(torch.device("mps"), "Apple GPU (MPS)", total, total, physical="mps")
    if dev.type == "meta":
        return Device(torch.device("meta"), "meta (shapes only, no data)", None, None, physical="meta")
    raise ValueError(f"device type {dev.type!r} is not supported; use cpu, cuda, mps or meta")


def _visible_summary() -> str:
    names = ["cpu"]
    n = _cuda_count()
    if n:
        names = [f"cuda:{i}" for i in range(n)] + names
    if _mps_available():
        names.insert(0, "mps")
    return ", ".join(names)


def resolve_device(device: str | int | torch.device | Device, *, name: str = "device") -> torch.device:
    """Check that ``device`` exists on this machine and return it as a ``torch.device``.

    Usage: ``resolve_device("cuda")`` → ``torch.device("cuda", 0)`` on a GPU machine; on a CPU-only
    machine a ``ValueError`` that lists what is visible and how to select it.
    """
    if isinstance(device, Device):
        if not device.present:
            raise ValueError(
                f"{name}={str(device)!r} ({device.name}) is described, not present on this machine; "
                f"it can be planned for but not run on. Visible devices: {_visible_summary()}."
            )
        return device.device
    if isinstance(device, bool):
        raise ValueError(f"{name}={device!r} is not a device; use e.g. 'cpu', 'cuda:0' or 0")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"{name}={device!r}: a CUDA index must be >= 0")
        dev = torch.device("cuda", device)
    elif isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device.strip())
        except RuntimeError:
            raise ValueError(
                f"{name}={device!r} is not a device spec; use 'cpu', 'cuda', 'cuda:N', 'mps' or 'meta' "
                f"(visible here: {_visible_summary()})"
            ) from None
    else:
        raise ValueError(
            f"{name}={device!r} ({type(device).__name__}) is not a device; use a string, int or torch.device"
        )

    if dev.type in ("cpu", "meta"):
        return torch.device(dev.type)
    if dev.type == "cuda":
        n = _cuda_count()
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        cvd_note = f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else ""
        if n == 0:
            why = (
                "this PyTorch build has no CUDA support"
                if torch.version.cuda is None
                else "no CUDA GPU is visible"
            )
            raise ValueError(
                f"{name}={str(device)!r}: {why}{cvd_note}. Visible devices: {_visible_summary()}. "
                "Use 'cpu' (or 'auto' to take whatever is present), or run on a machine with a GPU."
            )
        idx = 0 if dev.index is None else dev.index
        if idx >= n:
            listed = ", ".join(f"cuda:{i}" for i in range(n))
            raise ValueError(
                f"{name}={str(device)!r} does not exist: {n} CUDA device(s) are visible "
                f"({listed}){cvd_note}. Pick one of them, or make the GPU visible with CUDA_VISIBLE_DEVICES."
            )
        return torch.device("cuda", idx)
    if dev.type == "mps":
        if not _mps_available():
            raise ValueError(
                f"{name}={str(device)!r}: MPS (Apple GPU) is not available here. Visible devices: "
                f"{_visible_summary()}."
            )
        return torch.device("mps")
    raise ValueError(
        f"{name}={str(device)!r}: device type {dev.type!r} is not supported; use cpu, cuda, mps or meta "
        f"(visible here: {_visible_summary()})"
    )


_REPEAT_RE = re.compile(r"^(.*?)\s*\*\s*(\d+)$")
# torch.device keeps its index in 8 signed bits: cuda:127 is the last one it can name
MAX_DEVICES = 128


def _split_spec(spec: str) -> list[str]:
    """``"cuda:0,1,cpu"`` → ``["cuda:0", "cuda:1", "cpu"]``; ``"cpu*2"`` → ``["cpu", "cpu"]``."""
    tokens: list[str] = []
    last_type: str | None = None
    for raw in spec.split(","):
        tok = raw.strip()
        if not tok:
            raise ValueError(
                f"devices={spec!r} has an empty entry; separate devices with single commas, e.g. 'cuda:0,cpu'"
            )
        count = 1
        m = _REPEAT_RE.match(tok)
        if m:
            tok, count = m.group(1).strip(), int(m.group(2))
            if count < 1:
                raise ValueError(f"devices={spec!r}: repeat count in {raw.strip()!r} must be >= 1")
        if len(tokens) + count > MAX_DEVICES:
            raise ValueError(
                f"devices={spec!r} lists {len(tokens) + count} or more devices; at most {MAX_DEVICES} fit "
                f"one spec (torch.device indices end at cuda:{MAX_DEVICES - 1}); lower the repeat count, "
                f"e.g. '{tok}*8'"
            )
        if tok.isdigit():
            if last_type != "cuda":
                raise ValueError(
                    f"devices={spec!r}: bare index {tok!r} follows no 'cuda:N' entry; write 'cuda:{tok}'"
                )
            tok = f"cuda:{tok}"
        last_type = tok.split(":", 1)[0].lower()
        tokens.extend([tok] * count)
    return tokens


def _expand(item: str | int | torch.device | Device, spec_repr: str) -> list[Device]:
    if isinstance(item, Device):
        return [dataclasses.replace(item)]
    if isinstance(item, str):
        low = item.strip().lower()
        if low == "auto":
            out = [_describe_found(torch.device("cuda", i)) for i in range(_cuda_count())]
            if _mps_available():
                out.append(_describe_found(torch.device("mps")))
            out.append(_describe_found(torch.device("cpu")))
            return out
        if low == "cuda":
            n = _cuda_count()
            if n == 0:
                resolve_device("cuda", name="devices")  # raises the helpful error
            return [_describe_found(torch.device("cuda", i)) for i in range(n)]
        head = low.split(":", 1)[0]
        if head not in ("cpu", "cuda", "mps", "meta"):
            described = catalog.lookup(low)
            if described is not None:
                return [described]
            raise ValueError(
                f"devices={spec_repr}: unknown device {item!r}. Use 'auto', 'cpu', 'cuda', 'cuda:N', "
                f"'mps', 'meta', a catalog name ({', '.join(catalog.names())}), or a comma list; visible "
                f"here: {_visible_summary()}"
            )
    return [_describe_found(resolve_device(item, name="devices"))]


def _number_described(found: list[Device]) -> None:
    """Give described accelerators from the catalog (CUDA index ``None``) distinct ``cuda:N`` names.

    They are numbered in order of appearance, skipping indices already used by present GPUs in the
    list: ``"a100-40gb*2,cpu"`` → ``cuda:0, cuda:1, cpu``; budgets then use those keys.
    """
    used = {d.device.index for d in found if d.kind == "cuda" and d.device.index is not None}
    nxt = 0
    for d in found:
        if d.kind == "cuda" and d.device.index is None and not d.present:
            while nxt in used:
                nxt += 1
            if nxt >= MAX_DEVICES:
                raise ValueError(
                    f"devices: a described {d.name} would need index cuda:{nxt}, past "
                    f"cuda:{MAX_DEVICES - 1}, the last index torch.device can name; list fewer described GPUs"
                )
            d.device = torch.device("cuda", nxt)
            used.add(nxt)


def devices(
    spec: str | int | torch.device | Device | Sequence[str | int | torch.device | Device] = "auto",
    memory: Mapping[str, int | float | str] | None = None,
) -> list[Device]:
    """Find, describe and budget the devices named by ``spec``.

    Usage::

        devices()                                   # every accelerator, then the CPU
        devices("cuda:0,1")                         # two GPUs
        devices("cuda:0,cpu", memory={"cuda:0": "10GiB", "cpu": "32GB"})
        devices(["cpu", "cpu"])                     # two CPU stages (testing pipelines)

    Raises ``ValueError`` for devices the machine lacks (saying what is visible), for budgets
    naming a device not in the list, and for negative or unparseable budgets. A budget above the
    device's capacity is a ``UserWarning``.
    """
    spec_repr = repr(spec)
    items: list[str | int | torch.device | Device]
    if isinstance(spec, str):
        if not spec.strip():
            raise ValueError("devices='' is empty; use 'auto', 'cpu', 'cuda:0,1', ...")
        items = list(_split_spec(spec))
    elif isinstance(spec, (int, torch.device, Device)):
        items = [spec]
    elif isinstance(spec, Sequence):
        items = list(spec)
        if not items:
            raise ValueError("devices=[] is empty; name at least one device, e.g. ['cpu']")
    else:
        raise ValueError(
            f"devices={spec_repr} ({type(spec).__name__}) is not a device spec; use a string or a list"
        )

    found: list[Device] = []
    for item in items:
        found.extend(_expand(item, spec_repr))
    if len(found) > MAX_DEVICES:
        raise ValueError(
            f"devices={spec_repr} gives {len(found)} devices; at most {MAX_DEVICES} fit one list "
            f"(torch.device indices end at cuda:{MAX_DEVICES - 1})"
        )
    _number_described(found)
    if memory:
        _apply_budgets(found, memory)
    return found


def budget_key(key: str | torch.device | int) -> str:
    """The device name a memory budget key stands for: ``0`` and ``"cuda"`` -> ``"cuda:0"``, ``" CPU "`` ->
    ``"cpu"``."""
    if isinstance(key, int) and not isinstance(key, bool):
        return f"cuda:{key}"
    k = str(key).strip().lower()
    if k == "cuda":
        return "cuda:0"
    return k


def _apply_budgets(found: list[Device], memory: Mapping[str, int | float | str]) -> None:
    if not isinstance(memory, Mapping):
        raise ValueError(f"memory={memory!r} must be a mapping like {{'cuda:0': '10GiB', 'cpu': '32GB'}}")
    names = {str(d.device) for d in found}
    for key, value in memory.items():
        k = budget_key(key)
        if k not in names:
            raise ValueError(
                f"memory[{key!r}]={value!r} names a device that is not in the device list "
                f"({', '.join(sorted(names))}); give budgets only for listed devices, or add {key!r} to "
                "the devices"
            )
        nbytes = parse_memory(value, name=f"memory[{key!r}]")
        for d in found:
            if str(d.device) == k:
                d.budget = nbytes
                cap = d.total_memory
                if cap is not None and nbytes > cap:
                    warnings.warn(
                        f"memory[{key!r}]={value!r} ({format_bytes(nbytes)}) is above {k}'s capacity "
                        f"({format_bytes(cap)}); the budget can never be reached",
                        UserWarning,
                        stacklevel=3,
                    )

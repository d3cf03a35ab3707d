"""Why nothing fits, with numbers: builds the ``PlanError`` that ``search`` raises.

Usage: ``raise explain_no_fit(profile, settings)`` where ``settings`` is ``search``'s grid of
``(microbatches, schedule, recompute)``. Every suggestion is checked with the same search
(a larger budget, another device, other settings) before it is printed. Figures are per physical
device: entries of one device (``['cpu', 'cpu']``) share one budget and are reported once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from ..hardware import Device, format_bytes
from ..profiler.costs import LayerCost, Profile
from .cost import CostModel
from .errors import PlanError
from .physical import INF, physical_names
from .settings import Setting, microbatch_candidates
from .solver import Solver

__all__ = ["explain_no_fit", "fits", "frugal_needs"]


def fits(profile: Profile, settings: Sequence[Setting]) -> bool:
    """True when some placement fits the budgets under one of ``settings``."""
    for m, s, c in settings:
        if Solver(CostModel(profile, m, s, c)).run(INF) is not None:
            return True
    return False


def _with_capacity(profile: Profile, index: int, capacity: int) -> Profile:
    """``profile`` with ``capacity`` on device ``index`` and every other entry of that physical device."""
    names = physical_names(profile.devices)
    devs = [
        dataclasses.replace(dev, budget=capacity) if names[d] == names[index] else dev
        for d, dev in enumerate(profile.devices)
    ]
    return dataclasses.replace(profile, devices=devs)


def _with_extra(profile: Profile, like: int, capacity: int) -> Profile:
    """``profile`` plus a described (so distinct) copy of accelerator ``like`` with ``capacity`` bytes."""
    src = profile.devices[like]
    extra = dataclasses.replace(src, budget=capacity, source=f"described: another {src.device}")

    def grow(lay: LayerCost) -> LayerCost:
        return dataclasses.replace(
            lay,
            forward_fixed=[*lay.forward_fixed, lay.forward_fixed[like]],
            forward_per_sample=[*lay.forward_per_sample, lay.forward_per_sample[like]],
            backward_fixed=[*lay.backward_fixed, lay.backward_fixed[like]],
            backward_per_sample=[*lay.backward_per_sample, lay.backward_per_sample[like]],
            time_source=[*lay.time_source, *(lay.time_source[like : like + 1] or ["copied"])],
        )

    return dataclasses.replace(
        profile, devices=[*profile.devices, extra], layers=[grow(x) for x in profile.layers]
    )


def _smallest(lo: int, hi: int, ok) -> int | None:  # type: ignore[no-untyped-def]
    """Smallest capacity in ``(lo, hi]`` for which ``ok`` holds (within 0.2%), or ``None``."""
    if not ok(hi):
        return None
    for _ in range(40):
        if hi - lo <= max(hi * 0.002, 1):
            break
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def frugal_needs(profile: Profile, settings: Sequence[Setting]) -> tuple[int, int, str]:
    """(whole model on one device, largest single layer, its name) at the most frugal setting."""
    whole, largest, name = None, None, ""
    L = len(profile.layers)
    for m, s, c in settings:
        cm = CostModel(profile, m, s, c)
        k = cm.in_flight(0, 1)
        w = float(cm.memory_total(np.array([0]), np.array([L]), k)[0])
        per = cm.memory_total(np.arange(L), np.arange(1, L + 1), k)
        j = int(np.argmax(per))
        whole = w if whole is None else min(whole, w)
        if largest is None or per[j] < largest:
            largest, name = float(per[j]), profile.layers[j].name
    assert whole is not None and largest is not None
    return int(whole), int(largest), name


def _longest_run(cm: CostModel, capacity: float) -> tuple[int, int]:
    ends = cm.max_end(capacity, cm.in_flight(0, 1))
    lengths = ends - np.arange(cm.L)
    i = int(np.argmax(lengths))
    return int(lengths[i]), i


def _at_least(n: float) -> str:
    """``format_bytes`` rounded UP in its last digit, so a budget typed as printed is never short."""
    text = format_bytes(n)
    number, unit = text.split()
    if unit == "B":
        return text
    scale = 1024 ** ("KiB", "MiB", "GiB", "TiB").index(unit) * 1024
    return f"{math.ceil(n / scale * 100 - 1e-9) / 100:.2f} {unit}"


def _describe(dev: Device) -> str:
    return f"{dev.device} ({dev.name})" if dev.name else str(dev.device)


def _device_tips(
    profile: Profile,
    settings: Sequence[Setting],
    cm: CostModel,
    capacity: dict[int, int | None],
    whole: int,
    largest: int,
    largest_name: str,
) -> list[str]:
    """Checked ways to fit by the devices: the largest layer alone, a larger budget on one, another device."""
    devs, names, physical = profile.devices, cm.names, sorted(capacity)
    tips: list[str] = []
    finite = [d for d in physical if capacity[d] is not None]
    if largest > max((capacity[d] or 0) for d in finite) if finite else False:
        tips.append(
            f"layer {largest_name!r} needs {_at_least(largest)} by itself, more than any device offers: "
            f"a device with at least {_at_least(largest)} free, or split that layer into smaller child "
            "modules"
        )
    # a larger budget on one device
    for d in finite:
        cap = int(capacity[d] or 0)
        need = _smallest(
            cap, max(whole, cap + 1), lambda c, d=d: fits(_with_capacity(profile, d, c), settings)
        )
        if need is not None:
            tips.append(f"a larger budget on {names[d]}: {_at_least(need)} (now {format_bytes(cap)}) fits")
    # another device: an accelerator like the largest listed one (another entry of the CPU would be the same
    # CPU)
    accels = [d for d in physical if devs[d].kind != "cpu"]
    if accels:
        like = max(accels, key=lambda d: capacity[d] or 0)
        cap = int(capacity[like] or whole)
        if fits(_with_extra(profile, like, cap), settings):
            tips.append(f"another device like {_describe(devs[like])} with {_at_least(cap)} fits")
        else:
            need = _smallest(0, max(whole, 1), lambda c: fits(_with_extra(profile, like, c), settings))
            if need is not None:
                tips.append(
                    f"another device like {devs[like].device} with at least {_at_least(need)} free fits"
                )
    return tips


def _setting_tips(profile: Profile, settings: Sequence[Setting]) -> list[str]:
    """Checked ways to fit by settings other than the ones the caller fixed."""
    ms = sorted({m for m, _, _ in settings})
    scheds = sorted({s for _, s, _ in settings})
    recomputes = sorted({c for _, _, c in settings})
    tips: list[str] = []
    all_ms = microbatch_candidates(profile.batch_size)
    if "1f1b" not in scheds and fits(profile, [(m, "1f1b", c) for m, _, c in settings]):
        tips.append(
            "schedule='1f1b' fits (a stage keeps at most as many micro-batches in flight as stages after it)"
        )
    for c in ("except_last", "always"):
        if c not in recomputes and fits(profile, [(m, s, c) for m, s, _ in settings]):
            tips.append(
                f"recompute={c!r} fits (stages keep their inputs and recompute activations in backward)"
            )
            break
    if len(ms) == 1:
        for m in all_ms:
            if m != ms[0] and fits(profile, [(m, s, c) for _, s, c in settings]):
                tips.append(
                    f"microbatches={m} fits (micro-batches of {-(-profile.batch_size // m)} sample(s))"
                )
                break
    relaxed = [(m, "1f1b", c) for c in ("never", "except_last") for m in all_ms]
    settings_tips = [t for t in tips if t.startswith(("schedule=", "recompute=", "microbatches="))]
    if not settings_tips and set(settings) != set(relaxed) and fits(profile, relaxed):
        tips.append("letting torchspan choose (microbatches, schedule and recompute 'auto') fits")
    return tips


def explain_no_fit(profile: Profile, settings: Sequence[Setting]) -> PlanError:
    """A ``PlanError`` with needed vs available memory per device and checked ways to make it fit."""
    devs = profile.devices
    L = len(profile.layers)
    whole, largest, largest_name = frugal_needs(profile, settings)
    ms = sorted({m for m, _, _ in settings})
    scheds = sorted({s for _, s, _ in settings})
    recomputes = sorted({c for _, _, c in settings})
    head = (
        f"no placement of the {L} layer(s) fits the memory budgets "
        f"(tried microbatches {ms[0]}..{ms[-1]}, schedule {'/'.join(scheds)}, recompute "
        f"{'/'.join(recomputes)}, optimizer {profile.optimizer}, batch {profile.batch_size}).\n"
        f"The whole model needs {_at_least(whole)} on one device at its most frugal setting; "
        f"its largest layer {largest_name!r} alone needs {_at_least(largest)}."
    )
    frugal = max(settings, key=lambda t: (t[2] != "never", t[1] == "1f1b", t[0]))
    cm = CostModel(profile, *frugal)
    names = cm.names
    physical = sorted(set(cm.rep))  # first entry of each physical device
    capacity = {d: (None if cm.capacity[d] == INF else int(cm.capacity[d])) for d in physical}
    rows = []
    needed: dict[str, int] = {}
    available: dict[str, int | None] = {}
    for d in physical:
        cap = capacity[d]
        run, start = _longest_run(cm, cap if cap is not None else INF)
        held = f"{run} of {L} layers" + (f" ({profile.layers[start].name} ..)" if run else "")
        count = names.count(names[d])
        shared = f" (listed {count} times: one device, one budget for all its entries)" if count > 1 else ""
        rows.append(f"  {_describe(devs[d])}: available {format_bytes(cap)}, holds at most {held}{shared}")
        needed[names[d]] = whole
        available[names[d]] = cap
    head += "\nPer device (needed: the whole model, " + _at_least(whole) + "):\n" + "\n".join(rows)

    tips = _device_tips(profile, settings, cm, capacity, whole, largest, largest_name)
    tips += _setting_tips(profile, settings)
    if not tips:
        tips.append(
            f"a smaller batch than {profile.batch_size}, or a device with {_at_least(whole)} free for the "
            "whole model"
        )
    return PlanError(head, needed=needed, available=available, suggestions=tips)

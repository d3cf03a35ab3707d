"""The price of Megatron's interleaved 1F1B (``schedule="interleaved-1f1b"``) and the looped placement it runs
on.

Stages placed looped: ``S = v P`` stages over ``P`` physical devices, stage ``s`` on the device of stage ``s %
P`` (``runtime.local.looped``, ``runtime.ranks.looped``). Each device works through ``v`` smaller stages per
micro-batch, so its busy time per micro-batch ``R_p`` is 1F1B's, but the pipeline fills and drains ``v`` times
faster: with ``lat`` and ``c`` as in ``planner.cost``,

    step_time = sum_s lat_s / v + c_in + sum_j c_j  +  (M - 1/v) * max(max_p R_p, max_{p,q} C_pq, c_in)

i.e. ``(M + (P - 1)/v) R`` for ``P`` equal devices, a bubble of ``(P - 1) / (v M)`` of the step against 1F1B's
``(P - 1) / M``. The extra point-to-point: every one of the ``S - 1`` boundaries is a transfer (``v`` times
1F1B's), each on the trip, and a link between two devices carries all of theirs per micro-batch (``C_pq``: the
sum of their ``c_j``). Memory: stage ``s`` holds what the schedule keeps in flight on it
(``schedule.max_live`` of its actions: the warm-up of ``2 (P - r - 1) + (v - 1) P`` forwards spread over a
device's stages).

``looped(cm, ev)`` makes the placement from a one-stage-per-device one (``ev``, e.g. 1F1B's best): the layers
cut into ``v P`` stages in order, the ``k``-th on device ``k % P`` with about ``1/v`` of that device's work.

Usage::

    ev = CostModel(profile, 8, "interleaved-1f1b", "never").evaluate(stages)   # looped stages
    stages = looped(cm_1f1b, cm_1f1b.evaluate(one_per_device), v=2)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .. import schedule as sched
from .stages import Evaluation, Stage

if TYPE_CHECKING:
    from .cost import CostModel

__all__ = ["INTERLEAVED", "choose", "evaluate_interleaved", "looped", "positions"]

INTERLEAVED = "interleaved-1f1b"


def positions(names: Sequence[str], stages: Sequence[Stage]) -> int | None:
    """``P`` when ``stages`` are looped over ``P`` physical devices (stage ``s`` on stage ``s % P``'s), else
    ``None``."""
    on = [names[s.device] for s in stages]
    p = len(dict.fromkeys(on))
    if len(on) % p or any(on[s] != on[s % p] for s in range(len(on))):
        return None
    return p


def evaluate_interleaved(cm: CostModel, stages: tuple[Stage, ...], ties: Sequence[Any] | None) -> Evaluation:
    """Step time and memory of looped ``stages`` under the interleaved schedule (module docstring);
    ``ValueError`` for stages that are not looped or a micro-batch count it cannot run."""
    p = positions(cm.names, stages)
    if p is None:
        raise ValueError(
            f"schedule='interleaved-1f1b' runs stage s on the device of stage s % P: stages on "
            f"{[cm.names[s.device] for s in stages]} are not placed so"
        )
    v = len(stages) // p
    plan = sched.build(INTERLEAVED, cm.M, len(stages), p)  # raises for microbatches not a multiple of P
    ev = cm.evaluate_with(stages, ties, [max(1, sched.max_live(actions)) for actions in plan])
    c_in, cuts = ev.links[0], ev.links[1:]
    load: dict[tuple[str, str], float] = {}
    for a, b, c in zip(stages, stages[1:], cuts):
        pair = tuple(sorted((cm.names[a.device], cm.names[b.device])))
        load[pair] = load.get(pair, 0.0) + c  # type: ignore[index]
    compute = ev.latency_sum - sum(ev.links)
    latency = compute / v + sum(ev.links)
    bottleneck = max([*ev.device_busy, *load.values(), c_in])
    return Evaluation(
        stages=ev.stages,
        forward=ev.forward,
        backward=ev.backward,
        links=ev.links,
        memory=ev.memory,
        latency_sum=latency,
        bottleneck=bottleneck,
        step_time=latency + (cm.M - 1 / v) * bottleneck,
        devices=ev.devices,
        device_busy=ev.device_busy,
        device_memory=ev.device_memory,
        device_capacity=ev.device_capacity,
        ties=ev.ties,
    )


def looped(cm: CostModel, ev: Evaluation, v: int = 2) -> list[Stage] | None:
    """``v`` stages per device, looped, from ``ev``'s one stage per physical device (``None`` when ``ev``'s
    stages share a device, or the model has fewer than ``v P`` layers): stage ``k`` on ``ev``'s device ``k %
    P``, about ``1/v`` of that device's steady time in ``ev``, every stage at least one layer."""
    base = ev.stages
    p = len(base)
    if p < 2 or len({cm.names[s.device] for s in base}) != p or cm.L < v * p:
        return None
    share = [float(cm.PS[s.device, s.end] - cm.PS[s.device, s.start]) / v for s in base]
    out: list[Stage] = []
    pos = 0
    for k in range(v * p):
        d, left = base[k % p].device, v * p - k - 1  # stages still to cut after this one
        if left == 0:
            end = cm.L
        else:
            ends = range(pos + 1, cm.L - left + 1)
            end = min(ends, key=lambda j: abs(float(cm.PS[d, j] - cm.PS[d, pos]) - share[k % p]))
        out.append(Stage(d, pos, end))
        pos = end
    return out


def choose(cm: CostModel, ev: Evaluation, schedule: str) -> tuple[CostModel, Evaluation, list[str]] | None:
    """After a search (``planner.optimize.search``): the interleaved plan to return instead of ``(cm, ev)``,
    with notes, or ``None`` to keep it. ``schedule="interleaved-1f1b"``: the looped placement of ``ev``'s (2
    stages per device) when it runs and fits, else ``ev``'s own stages (one per device: interleaved is 1F1B
    there), saying why. ``"auto"``: the looped placement only when it fits and is predicted faster than
    ``ev``."""
    if schedule not in (INTERLEAVED, "auto"):
        return None
    inter = copy.copy(cm)  # the same tables; only the schedule's pricing differs
    inter.schedule = INTERLEAVED
    stages = looped(cm, ev)
    why = ""
    if stages is None:
        why = "the plan has one device or fewer layers than 2 stages per device need"
    elif cm.M % len(ev.stages):
        why = (
            f"microbatches={cm.M} is not a multiple of the {len(ev.stages)} devices (rounds of one per "
            "device)"
        )
    if not why:
        assert stages is not None
        looped_ev = evaluate_interleaved(inter, tuple(stages), None)
        if not looped_ev.fits:
            why = "2 stages per device do not fit the memory budgets (more micro-batches in flight)"
        elif schedule == "auto" and looped_ev.step_time >= ev.step_time:
            return None
        else:
            note = (
                f"interleaved-1f1b: {len(stages)} stages looped over {len(ev.stages)} devices, predicted "
                f"{looped_ev.step_time * 1e3:.3f} ms/step against {ev.step_time * 1e3:.3f} ms for "
                f"{cm.schedule}"
            )
            return inter, looped_ev, [note]
    if schedule == "auto":
        return None
    return inter, evaluate_interleaved(inter, ev.stages, None), [f"interleaved-1f1b runs as 1F1B here: {why}"]

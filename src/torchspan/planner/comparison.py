"""The table of strategies a cluster plan weighed (``Plan.comparison``), and why the chosen one won.

``compare`` keeps, per strategy (``strategies.STRATEGIES``), the fastest candidate that fits, else the one
needing the least memory (``fits: False``, what is over), else why no split of the world is that strategy
(``reasons``). ``unfitting`` prices, for the strategies with no candidate that fits, the split needing the
least memory, so the table can say by how much it is over. ``why_chosen`` is the sentence a plan's notes give.

Usage::

    probes = unfitting(profile, cluster, splits, candidates, opts)
    rows = compare(candidates + probes, chosen, reasons(cluster, profile, splits, opts), host)
    why_chosen(rows)   # "sharded: 3 of 6 strategies fit; ..."
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from ..profiler.costs import Profile
from .candidates import ClusterCandidate, evaluate_cluster, even_cut, strategy_of
from .cost import CostModel
from .physical import INF, budget_of
from .settings import settings_grid, sharded_schedule
from .stages import Stage
from .strategies import (
    SHARD_MARGIN,
    STRATEGIES,
    Host,
    Options,
    replica_settings,
    sharded_pipeline,
    sharded_profile,
    unfit,
)
from .topology import Cluster, layouts, replica_profile, shard_size

__all__ = ["compare", "reasons", "unfitting", "why_chosen"]


def compare(
    candidates: Sequence[ClusterCandidate],
    chosen: ClusterCandidate | None,
    reasons: dict[str, str],
    host: Host | None = None,
) -> list[dict[str, Any]]:
    """``Plan.comparison``: per strategy (``STRATEGIES`` order) its fastest candidate that fits, else the one
    needing the least device memory, else a row saying why the world has no split of that kind
    (``reasons[strategy]``)."""
    rows = []
    for name in STRATEGIES:
        mine = [c for c in candidates if c.strategy == name]
        fitting = [c for c in mine if c.fits]
        if fitting:
            best = (
                chosen
                if any(c is chosen for c in fitting)
                else min(fitting, key=lambda c: (c.step, c.pp, c.layout))
            )
        elif mine:
            best = min(mine, key=lambda c: (c.peak, c.step))
        else:
            rows.append(
                {
                    "strategy": name,
                    "ranks": "",
                    "data_parallel": 0,
                    "stages": 0,
                    "shard": "sharded" in name,
                    "offload": "cpu" if "offload" in name else None,
                    "predicted_step_time": None,
                    "peak_memory": None,
                    "budget": None,
                    "host_memory": 0,
                    "host_budget": None,
                    "fits": False,
                    "chosen": False,
                    "note": f"not possible: {reasons.get(name, 'no split of the ranks is this strategy')}",
                }
            )
            continue
        rows.append(_row(best, best is chosen, chosen))
        if best.offload and host is not None:
            rows[-1]["host_budget"] = host.budget
    return rows


def _row(c: ClusterCandidate, is_chosen: bool, chosen: ClusterCandidate | None) -> dict[str, Any]:
    capacity = budget_of(c.cm.profile.devices[0])
    if is_chosen:
        note = "chosen"
    elif not c.fits:
        note = f"does not fit: {c.why}"
    elif chosen is not None and chosen.step > 0:
        note = f"fits, {(c.step / chosen.step - 1) * 100:+.1f}% step"
        if c.step < chosen.step and c.tp > 1:
            note += (
                f": tensor parallelism must gain {SHARD_MARGIN:.0%} or more (DTensor's and FSDP2's "
                "per-layer costs are not modelled)"
            )
        elif c.step < chosen.step:
            note += (
                f": sharding must gain {SHARD_MARGIN:.0%} or more (FSDP2's per-unit costs are not modelled)"
            )
    else:
        note = "fits"
    ranks = f"dp {c.dp}" if c.pp == 1 else f"pp {c.pp}" if c.dp == 1 else f"dp {c.dp} x pp {c.pp}"
    if c.tp > 1:
        ranks = f"tp {c.tp} x dp {c.dp}" if c.dp > 1 else f"tp {c.tp}"
        ranks = f"tp {c.tp} x pp {c.pp}" + (f" x dp {c.dp}" if c.dp > 1 else "") if c.pp > 1 else ranks
    extra = {"tp": c.tp, "tp_allreduce": c.tp_comm} if c.tp > 1 else {}
    return {
        "strategy": c.strategy,
        "ranks": ranks,
        "data_parallel": c.dp,
        "stages": c.pp,
        "shard": c.shard,
        "offload": c.offload,
        "predicted_step_time": c.step,
        "peak_memory": c.peak,
        "budget": capacity if math.isfinite(capacity) else None,
        "host_memory": c.host,
        "host_budget": None,
        "fits": c.fits,
        "chosen": is_chosen,
        "note": note,
        **extra,
    }


def unfitting(
    profile: Profile,
    cluster: Cluster,
    splits: Sequence[tuple[int, int]],
    candidates: Sequence[ClusterCandidate],
    opts: Options,
) -> list[ClusterCandidate]:
    """For each unsharded strategy and pipeline x sharded with no candidate that fits: its split needing the
    least device memory, cut without budgets (``fits`` False, ``why`` what is over), so the comparison can say
    how far off."""
    found = {c.strategy for c in candidates}
    out = []
    for name in ("replicas", "pipeline", "hybrid", "pipeline x sharded"):
        shard = name == "pipeline x sharded"
        if name in found:
            continue
        probes = [
            c
            for dp, pp in splits
            if strategy_of(dp, pp, shard) == name
            for c in _probe(profile, cluster, dp, pp, opts, shard)
        ]
        if probes:
            out.append(min(probes, key=lambda c: (c.peak, c.step)))
    return out


def _probe(
    profile: Profile, cluster: Cluster, dp: int, pp: int, opts: Options, shard: bool
) -> list[ClusterCandidate]:
    """Every setting's cut of ``dp x pp`` into exactly ``pp`` stages by time alone (budgets ignored), judged
    against them."""
    b = shard_size(profile.batch_size, dp)
    if isinstance(opts.microbatches, int) and opts.microbatches > b:
        return []
    plain = replica_profile(profile, pp, b)
    shaped = sharded_profile(plain, dp) if shard else plain
    schedule = sharded_schedule(opts.schedule) if shard else opts.schedule
    grid = (
        settings_grid(b, opts.microbatches, schedule, opts.recompute)
        if pp > 1
        else replica_settings(opts.microbatches, opts.schedule, opts.recompute)
    )
    layout, ranks = layouts(dp, pp)[0]
    capacity = budget_of(plain.devices[0])
    out = []
    for setting in grid:
        cm = CostModel(shaped, *setting)
        cm.capacity = [INF] * cm.D
        ev = even_cut(cm, pp) if pp > 1 else cm.evaluate([Stage(0, 0, cm.L)])
        if ev is None:
            continue
        if shard:
            cand = sharded_pipeline(
                cm, ev, CostModel(plain, *setting), cluster, ranks, layout, opts.bucket_bytes, opts.ties
            )
        else:
            cand = evaluate_cluster(cm, ev, cluster, ranks, layout, opts.bucket_bytes, opts.ties)
        why = unfit(cand.peak, capacity)
        out.append(dataclasses.replace(cand, fits=not why, why=why))
    return out


def reasons(
    cluster: Cluster, profile: Profile, splits: Sequence[tuple[int, int]], opts: Options
) -> dict[str, str]:
    """Per strategy, why no split of the world is that strategy (used where ``compare`` finds no
    candidate)."""
    world, L, B = cluster.world, len(profile.layers), profile.batch_size
    dps = sorted({dp for dp, _ in splits})
    fixed = f"; data_parallel {dps[0]} was fixed" if len(dps) == 1 and world > 1 and len(splits) == 1 else ""
    one_batch = (
        ""
        if replica_settings(opts.microbatches, opts.schedule, opts.recompute)
        else ("a data-parallel replica runs its shard as one batch (microbatches=1, recompute='never')")
    )
    replicas = one_batch or (
        f"{world} replicas need a batch of {world} or more (it is {B}){fixed}"
        if world > B
        else f"no dp {world} split{fixed}"
    )
    out = {
        "replicas": replicas,
        "sharded": "one rank has nothing to share with (its sharded form is sharded + offload)"
        if world == 1
        else replicas,
        "sharded + offload": "CPU devices: FSDP2's CPUOffloadPolicy needs an accelerator"
        if cluster.device.kind == "cpu"
        else replicas,
        "pipeline": "one rank is one stage"
        if world == 1
        else (f"{world} stages for {L} layers" if world > L else f"no pp {world} split{fixed}"),
    }
    both = [(d, world // d) for d in range(2, world) if world % d == 0 and world // d > 1]
    mixed = (
        f"{world} rank(s) have no split into dp > 1 x pp > 1"
        if not both
        else (f"no split dp > 1 x pp > 1 within the batch ({B}) and the layers ({L}){fixed}")
    )
    out["hybrid"] = out["pipeline x sharded"] = mixed
    return out


def why_chosen(rows: Sequence[dict[str, Any]]) -> str:
    """One sentence: the chosen strategy, how many fit, and the faster ones that do not."""
    chosen = next((r for r in rows if r.get("chosen")), None)
    if chosen is None:
        return "no strategy fits"
    fit = [r for r in rows if r.get("fits")]
    step = chosen["predicted_step_time"]
    quicker = [r for r in fit if r["predicted_step_time"] < step]
    how = "the fastest" if not quicker else f"within {SHARD_MARGIN:.0%} of the fastest and simpler"
    text = (
        f"{chosen['strategy']} ({chosen['ranks']}) is {how} of the {len(fit)} "
        f"strateg{'y' if len(fit) == 1 else 'ies'} that fit"
    )
    faster = [
        r
        for r in rows
        if not r.get("fits") and r.get("predicted_step_time") is not None and r["predicted_step_time"] < step
    ]
    if faster:
        text += "; faster but over budget: " + "; ".join(
            f"{r['strategy']} ({r['note'].removeprefix('does not fit: ')})" for r in faster
        )
    if chosen.get("tp", 1) > 1:
        text += (
            f"; tp {chosen['tp']} divides each block's compute over a node's {chosen['tp']} devices for "
            f"{chosen['tp_allreduce'] * 1e3:.2f} ms of all-reduces per step on the intra-node link"
        )
    runner = sorted((r for r in fit if not r.get("chosen")), key=lambda r: r["predicted_step_time"])
    if runner:
        text += f"; next: {runner[0]['strategy']} at {runner[0]['predicted_step_time'] * 1e3:.2f} ms"
    return text

"""Data x pipeline plans for a cluster you describe: ``cluster_search(profile, cluster) -> Plan``.

Usage::

    cluster = Cluster.describe(profile.devices, nodes=2, interconnect="ib-400g")   # profile of ONE node
    # plan.data_parallel, plan.stage_ranks, plan.predicted_times
    plan = cluster_search(profile, cluster)

What is searched: every data-parallel degree ``dp`` with ``dp * pp = nodes * per_node`` (the world
size; ``pp <= layers``, ``dp <= batch``), both ``cluster.layouts``, and for each the pipeline cut,
micro-batch count, schedule and recompute mode of one replica (``optimize.search`` on
``cluster.replica_profile``: ``pp`` copies of the node's device, ``ceil(B / dp)`` samples, hand-overs
priced at the slowest link the layout's pipelines cross). When that best pipeline leaves some
of its ``pp`` devices idle (fewer stages are faster for one replica), ``even_cut`` cuts it into
exactly ``pp`` stages instead, for every setting: ``dp * pp`` fills the world. Beside them, every
``tp x dp`` of the world with each block split over ``tp`` ranks of a node (``planner.tensorparallel``), and
every ``tp x pp x dp`` with pipelines of such stages (``planner.tppipeline``).

What is predicted, per replica (all replicas alike; ``M`` micro-batches)::

    compute   = existing cost model's step time with free hand-overs (input from the host included)
    pipeline  = same formula with hand-over c_j = 2 * p2p(out_j, link_j) per boundary
                (activation forward, gradient back; link_j intra-node, or the interconnect where a
                replica's adjacent stages sit on different nodes)
    p2p       = pipeline - compute
    exposed   = max(0, max_s end_s)                          (the step's all-reduce: added to it)
    ties      = max(0, max_s end_s, max_t end_t) - exposed   (tied parameters' all-reduces, beyond it)
    step      = pipeline + exposed + ties

``end_s`` is when stage ``s``'s gradient all-reduce over its ``dp`` replicas (``comm.allreduce_time``
on the link its replicas span) ends, in seconds after the pipeline's last backward ends (stage
0's), following how the runtime launches it (``stage_reductions``):

* one stage (pure data parallel, ``DataParallelReplica``): DDP buckets of ``comm.BUCKET_BYTES``,
  filled in reverse layer order during the (last micro-batch's) backward, each all-reduced once
  full, one after another (``comm.buckets``, ``comm.finish_time``): only what does not fit under
  the rest of the backward is exposed, and at least the last bucket's all-reduce;
* several stages (``RankStage``): one flat buffer per stage, launched once its last backward ran;
  stage ``s`` finishes ``lead_s = sum_{s' < s} (Bw_s' + p2p(out_s'))`` before stage 0 (``Bw``: one
  micro-batch's backward, plus its recompute under ``recompute="always"``), so
  ``end_s = AR_s - lead_s``: later stages hide their reduction behind earlier stages' backward.

Tied parameters (``planner.ties``; ``RankStage``): a tie held by stages ``T`` (more than one) is all-reduced
in its own group, the ranks of ``T`` in every replica (``n = dp * |T|``), on the slowest link among them
(``cluster.link``), one flat buffer launched with the stage's own, after each rank's last backward; its
bytes leave the home stage's buffer. A collective starts when its last member joins, the stage of
``T`` that finished backward last (the least ``lead_s``), so ``end_t = AR_t - min_{s in T} lead_s``.
It runs beside the stages' all-reduces (other groups, other communicators), so only what it adds
past them is charged (``ties``). A pipeline's first and last stages finish their backward last and
first, so an embedding tied to the head (stage 0 in ``T``) is exposed in full. The replica's cut is
searched without this charge (``optimize.search`` on one replica); candidates are compared with it.

``allreduce_total`` is the longest stage's all-reduce were none of it hidden. Not modelled: the
optimizer step, an all-reduce slowing the compute it overlaps, and several stages' all-reduces
sharing one node's network link.

Memory per device is the existing model's (parameters, gradients and optimizer state of its stage;
activations for the per-replica micro-batches); all-reduce buckets are not counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..hardware.links import Link
from ..profiler.costs import Profile
from .candidates import ClusterCandidate, Reduction, evaluate_cluster, even_cut, slowest_hop, stage_reductions
from .clusterplan import to_plan
from .comm import BUCKET_BYTES
from .comparison import compare, reasons, unfitting
from .cost import CostModel
from .errors import PlanError
from .optimize import search
from .plans import Plan, StagePlan
from .settings import settings_grid, sharded_schedule
from .stages import Evaluation
from .strategies import (
    TP,
    TPP,
    Host,
    Options,
    choose,
    host_of,
    replica_settings,
    sharded_pipeline,
    sharded_profile,
    sharded_replicas,
)
from .tensorparallel import tp_candidates, tp_degrees
from .ties import TieCost
from .topology import Cluster, layouts, replica_profile, shard_size
from .tppipeline import tp_pipeline_candidates

__all__ = [
    "ClusterCandidate",
    "Reduction",
    "cluster_search",
    "evaluate_cluster",
    "even_cut",
    "stage_reductions",
    "world_splits",
]


def world_splits(
    world: int, layers: int, batch_size: int, data_parallel: int | str = "auto", *, strict: bool = True
) -> list[tuple[int, int]]:
    """``(dp, pp)`` pairs with ``dp * pp == world``, ``pp <= layers`` and ``dp <= batch_size``, widest dp
    first.

    Raises ``ValueError`` naming the equation when a fixed ``data_parallel`` does not divide the world, and
    (``strict``) when no pair exists; ``strict=False`` returns ``[]`` then (tensor parallel may still split
    the world: ``cluster_search``).
    """
    if data_parallel == "auto":
        dps = [d for d in range(world, 0, -1) if world % d == 0]
    elif isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel={data_parallel!r} must be 'auto' or an int >= 1")
    elif world % data_parallel:
        raise ValueError(
            f"data_parallel={data_parallel} does not divide the world size: nodes * devices per node = "
            f"{world} = data_parallel * pipeline stages has no whole number of stages; use a divisor of "
            f"{world}"
        )
    else:
        dps = [data_parallel]
    out = [(d, world // d) for d in dps if world // d <= layers and d <= batch_size]
    if not out and strict:
        raise ValueError(
            f"no data x pipeline split of {world} ranks fits: data_parallel must be <= the batch "
            f"({batch_size}) and world / data_parallel <= the layers ({layers}); "
            f"data_parallel={data_parallel!r}. Use a larger batch, fewer nodes or fewer devices per node"
        )
    return out


def cluster_search(
    profile: Profile,
    cluster: Cluster,
    *,
    microbatches: int | str = "auto",
    schedule: str = "auto",
    recompute: str = "auto",
    data_parallel: int | str = "auto",
    bucket_bytes: float = BUCKET_BYTES,
    ties: Sequence[TieCost] = (),
    host_memory: float | None = None,
    tp: int | str = "auto",
) -> Plan:
    """The fastest plan of ``profile`` (one node's devices) on ``cluster`` among every strategy
    (``planner.strategies``: replicas, sharded, sharded + offload, pipeline, hybrid, pipeline x sharded,
    tensor parallel x sharded, tensor parallel x pipeline).

    ``bucket_bytes``: the data-parallel runtime's gradient bucket (``DataParallelReplica``'s 25 MiB).
    ``ties``: tied parameters (``planner.ties``), all-reduced per step where a candidate splits them.
    ``host_memory``: bytes of one node's host memory for offloaded states (``strategies.host_of``'s default).
    ``tp``: the tensor-parallel degrees priced (``planner.tensorparallel``): ``"auto"`` (2, 4, 8 dividing the
    devices per node), an int to fix one, 1 for none.
    ``plan.comparison`` holds each strategy's best, whether it fits and why the chosen one.

    Usage: ``cluster_search(profile, Cluster.describe(profile.devices, nodes=2))``. Raises ``PlanError``
    when no strategy fits memory, ``ValueError`` when no split of the world exists.
    """
    if len(profile.devices) != cluster.per_node:
        raise ValueError(
            f"profile has {len(profile.devices)} device(s) but cluster.per_node={cluster.per_node}; "
            "profile one node's devices and describe the cluster from them"
        )
    # no dp x pp split (a batch or layers too few for the world) leaves tensor parallel's splits to try
    splits = world_splits(cluster.world, len(profile.layers), profile.batch_size, data_parallel, strict=False)
    tp_degrees(cluster.per_node, tp)  # a bad tp= is refused before the search
    opts = Options(microbatches, schedule, recompute, bucket_bytes, tuple(ties))
    host = host_of(cluster, host_memory) if cluster.device.kind != "cpu" else None
    candidates, probes, skipped, last_error = _per_split(profile, cluster, splits, opts, host)
    split = tp_candidates(
        profile,
        cluster,
        setting=next(iter(replica_settings(microbatches, schedule, recompute)), None),
        ties=ties,
        data_parallel=data_parallel,
        tp=tp,
    )
    staged = tp_pipeline_candidates(profile, cluster, opts, data_parallel=data_parallel, tp=tp)
    candidates += [c for c in split[0] + staged[0] if c.fits]
    probes += [c for c in split[0] + staged[0] if not c.fits]
    probes += unfitting(profile, cluster, splits, candidates, opts)
    best = choose(candidates) if candidates else None
    why = {**reasons(cluster, profile, splits, opts), TP: split[1], TPP: staged[1]}
    rows = compare([*candidates, *probes], best, why, host)
    if best is None and not splits:  # nothing tensor parallel either: why no dp x pp split exists
        world_splits(cluster.world, len(profile.layers), profile.batch_size, data_parallel)
    if best is None:
        raise _no_fit(cluster, splits, rows, skipped, last_error)
    return to_plan(best, candidates, skipped, cluster, profile.batch_size, bucket_bytes, ties, rows, host)


def _per_split(
    profile: Profile, cluster: Cluster, splits: list[tuple[int, int]], opts: Options, host: Host | None
) -> tuple[list[ClusterCandidate], list[ClusterCandidate], list[str], PlanError | None]:
    """Every split's fitting candidates, the sharded replicas that do not fit (probes), the splits skipped and
    why, and the last memory error met (``cluster_search``'s loop over ``world_splits``)."""
    microbatches, schedule, recompute, ties = opts.microbatches, opts.schedule, opts.recompute, opts.ties
    candidates: list[ClusterCandidate] = []
    probes: list[ClusterCandidate] = []
    skipped: list[str] = []
    last_error: PlanError | None = None
    for dp, pp in splits:
        b = shard_size(profile.batch_size, dp)
        if isinstance(microbatches, int) and microbatches > b:
            skipped.append(
                f"dp {dp} x pp {pp}: {microbatches} micro-batches exceed the {b}-sample replica batch"
            )
            continue
        for shard in (False, True) if dp > 1 and pp > 1 else (False,):
            found, why, error = _split(profile, cluster, dp, pp, opts, shard)
            candidates += found
            skipped += why
            last_error = error or last_error
        setting = replica_settings(microbatches, schedule, recompute)
        if pp == 1 and setting:
            sharded = sharded_replicas(profile, cluster, dp, host=host, setting=setting[0], ties=ties)
            candidates += [c for c in sharded if c.fits]
            probes += [c for c in sharded if not c.fits]
    return candidates, probes, skipped, last_error


def _no_fit(
    cluster: Cluster,
    splits: list[tuple[int, int]],
    rows: list[dict[str, object]],
    skipped: list[str],
    last_error: PlanError | None,
) -> Exception:
    """Why ``cluster_search`` found nothing: ``PlanError`` when memory stopped every split, else
    ``ValueError``."""
    table = "\n".join(Plan([StagePlan("cpu", ["-"])], comparison=rows).comparison_lines())
    if last_error is not None and all("does not fit" in s for s in skipped):
        return PlanError(
            f"no strategy fits {cluster.world} ranks: even {splits[-1][1]} stage(s) per replica, sharded "
            f"or offloaded, need more memory than a device has.\n{table}\n{last_error}"
        )
    return ValueError(
        f"no data x pipeline split of {cluster.world} ranks fills the world: "
        + "; ".join(skipped)
        + ". Use fewer devices per node or nodes, or a larger batch"
    )


def _split(
    profile: Profile, cluster: Cluster, dp: int, pp: int, opts: Options, shard: bool
) -> tuple[list[ClusterCandidate], list[str], PlanError | None]:
    """``(candidates, skipped, error)`` of one split ``dp x pp`` over its layouts: the replica's cut searched
    within the budgets (``shard``: each stage's states sharded over its ``dp`` replicas,
    ``strategies.sharded_profile``)."""
    b = shard_size(profile.batch_size, dp)
    shape = (lambda p: sharded_profile(p, dp)) if shard else (lambda p: p)
    plain = replica_profile(profile, pp, b)
    compute_only = shape(plain)
    what = "sharded " if shard else ""
    if shard:
        opts = dataclasses.replace(opts, schedule=sharded_schedule(opts.schedule))
    out: list[ClusterCandidate] = []
    skipped: list[str] = []

    def finish(cm: CostModel, ev: Evaluation, ranks: list[list[int]], layout: str) -> ClusterCandidate:
        if not shard:
            return evaluate_cluster(cm, ev, cluster, ranks, layout, opts.bucket_bytes, opts.ties)
        unsharded = CostModel(plain, cm.M, cm.schedule, cm.recompute)
        return sharded_pipeline(cm, ev, unsharded, cluster, ranks, layout, opts.bucket_bytes, opts.ties)

    for layout, ranks in layouts(dp, pp):
        priced = shape(replica_profile(profile, pp, b, _stage_link(cluster, ranks).effective_bandwidth))
        try:
            chosen = search(
                priced, microbatches=opts.microbatches, schedule=opts.schedule, recompute=opts.recompute
            )
        except PlanError as exc:
            skipped.append(f"dp {dp} x pp {pp} ({layout}): a {pp}-stage {what}replica does not fit")
            return out, skipped, exc  # the other layout has the same memory
        if len(chosen.stages) == pp and pp > 1:
            cm = CostModel(compute_only, chosen.microbatches, chosen.schedule, chosen.recompute)
            out.append(finish(cm, cm.evaluate(cm.stages_for(chosen)), ranks, layout))
            continue
        # the replica's best pipeline leaves devices idle: cut it into exactly pp stages instead. One stage is
        # a data-parallel replica (DataParallelReplica): it runs its shard as one batch, without recompute
        grid = (
            settings_grid(b, opts.microbatches, opts.schedule, opts.recompute)
            if pp > 1
            else replica_settings(opts.microbatches, opts.schedule, opts.recompute)
        )
        if not grid:
            skipped.append(
                f"dp {dp} x pp 1: a data-parallel replica runs its shard as one batch (microbatches=1, "
                "recompute='never')"
            )
            continue
        forced = [
            finish(cm, ev, ranks, layout)
            for m, sch, rc in grid
            for cm in [CostModel(compute_only, m, sch, rc)]
            for ev in [even_cut(cm, pp)]
            if ev is not None
        ]
        if forced:
            out.append(min(forced, key=lambda c: c.step))
        else:
            skipped.append(f"dp {dp} x pp {pp} ({layout}): no cut into exactly {pp} {what}stages fits")
    return out, skipped, None


def _stage_link(cluster: Cluster, ranks: list[list[int]]) -> Link:
    """The slowest link any hand-over of this layout crosses (the search prices every boundary at it)."""
    hops = [slowest_hop(cluster, ranks[s], ranks[s + 1]) for s in range(len(ranks) - 1)]
    return cluster.inter if cluster.inter in hops else cluster.intra

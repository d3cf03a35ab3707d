"""Tensor parallel x pipeline (x replicas) on a cluster you describe: ``pp`` stages, each split over ``tp``
ranks of a node, ``dp`` replicas of that pipeline.

What it prices is what ``span(model, tp=T, balance=[...])`` runs (``runtime.ranks.tpstages``): a
``DeviceMesh`` ``("pp", "dp_replicate", "tp")``, ``tp`` innermost, so rank ``(s, r, t) = (s * dp + r) * tp
+ t``: a stage's ``tp`` ranks are neighbours within one node (``tp`` divides the devices per node), each
``tp`` coordinate ``t`` runs its own pipelines (stage ``s`` hands its whole output to ``(s + 1, r, t)``), and
a stage's gradients are all-reduced over its ``dp`` replicas of the same ``tp`` coordinate. Degrees: ``tp`` in
``tensorparallel.TP_DEGREES`` dividing the devices per node (``tp=`` fixes one), ``pp >= 2`` dividing ``world
/ tp`` (``pp <= layers``), ``dp = world / (tp * pp)`` (``dp <= batch``); sharding beside ``tp`` in a pipeline
is not run, so not priced.

Which layers are split: ``tensorparallel.split_layers`` (the blocks). A split layer as one ``tp`` rank runs
it, per micro-batch of ``m`` samples (``out_i``, ``out0_i``: its output bytes per sample and per call)::

    AR_i(m)  = comm.allreduce_time(out0_i + m out_i, tp, intra-node link)
             = AR0_i + m ARs_i      AR0_i = 2 (tp-1)/tp out0_i / bw + 2 (tp-1) latency,
                                    ARs_i = 2 (tp-1)/tp out_i / bw
    F'_i(m)  = F_fixed + 2 AR0_i + m (F_sample / tp + 2 ARs_i)      Bw'_i likewise (2 all-reduces each way)
    memory   = states / tp, activations W_i + (A_i - W_i) / tp      (tensorparallel's, per sample)

Whole layers (embedding, final norm, head) keep their one-device times and bytes. On that profile one
replica of ``pp`` stages is priced by the cluster planner's pipeline functions: ``candidates.even_cut`` cuts
it into exactly ``pp`` stages within the budget for every setting of ``settings.settings_grid`` (1F1B and
merged-weights, or the fixed schedule; interleaved is refused: several stages per rank do not run with
``tp``), and ``candidates.evaluate_cluster`` adds the bubble, the hand-overs (``2 p2p(out)`` per boundary
and micro-batch, on the link between the stages' nodes) and each stage's gradient all-reduce over its
``dp`` replicas on the link they span (overlapping earlier stages' backward), ties likewise::

    tp_comm  = pipeline step with the all-reduces - the same cut's step without them (the all-reduces
               on the pipeline's critical path, bubble included; DTensor waits for each: not overlapped)
    compute  = the step without them;   step = compute + tp_comm + p2p + exposed all-reduce + ties

Not modelled: the ``tp`` ranks of a stage all sending their (identical) hand-overs over one node's links at
once, the TP all-reduces sharing NVLink with hand-overs inside a node, DTensor's per-op dispatch and the
optimizer step.

Usage::

    found, why = tp_pipeline_candidates(profile, cluster, opts)     # fitting or not (c.fits, c.why)
    c = min((c for c in found if c.fits), key=lambda c: c.step)    # c.tp, c.pp, c.dp, c.tp_comm
"""

from __future__ import annotations

import dataclasses

from ..profiler.costs import Profile
from .candidates import ClusterCandidate, evaluate_cluster, even_cut
from .comm import ring_bytes
from .cost import CostModel
from .physical import INF, budget_of
from .settings import settings_grid
from .stages import Evaluation
from .strategies import Options, unfit
from .tensorparallel import TP_DEGREES, split_layer, split_layers, tp_degrees
from .topology import Cluster, replica_profile, shard_size

__all__ = ["LAYOUT", "tp_pipeline_candidates", "tp_split_profile", "tp_pipeline_ranks", "tp_pipeline_splits"]

LAYOUT = "pp-dp-tp"  # the runtime's mesh ("pp", "dp_replicate", "tp"), tp innermost


def tp_pipeline_ranks(pp: int, dp: int, tp: int) -> list[list[int]]:
    """Per stage, its ``dp * tp`` ranks (replica ``r``'s ``row[r * tp:(r + 1) * tp]``), as
    ``Plan.stage_ranks`` holds them."""
    return [[s * dp * tp + k for k in range(dp * tp)] for s in range(pp)]


def tp_pipeline_splits(
    world: int,
    per_node: int,
    layers: int,
    batch: int,
    tp: int | str = "auto",
    data_parallel: int | str = "auto",
) -> list[tuple[int, int, int]]:
    """``(tp, pp, dp)`` with ``tp * pp * dp == world``, ``tp`` within a node, ``2 <= pp <= layers``, ``dp <=
    batch`` (a fixed ``data_parallel`` kept)."""
    out = []
    for t in tp_degrees(per_node, tp):
        for pp in range(2, min(layers, world // t) + 1):
            dp = world // (t * pp)
            if dp * t * pp == world and dp <= batch and data_parallel in ("auto", dp):
                out.append((t, pp, dp))
    return out


def tp_split_profile(profile: Profile, cluster: Cluster, tp: int, comm: bool = True) -> Profile:
    """``profile`` (one device) as one rank of a ``tp``-way stage holds and runs it: split layers divided,
    their all-reduces on the intra-node link folded into their fixed and per-sample times (``comm=False``:
    without them)."""
    layers = []
    for lay, split in zip(profile.layers, split_layers(profile)):
        if not split:
            layers.append(lay)
            continue
        bw, latency = cluster.intra.effective_bandwidth, cluster.intra.latency
        ar0 = ring_bytes(lay.output_fixed_bytes, tp) / bw + 2 * (tp - 1) * latency  # once per call
        ars = ring_bytes(lay.output_bytes, tp) / bw  # per sample
        layers.append(split_layer(lay, tp, ar0, ars) if comm else split_layer(lay, tp, 0.0))
    return dataclasses.replace(profile, layers=layers)


def tp_pipeline_candidates(
    profile: Profile,
    cluster: Cluster,
    opts: Options,
    *,
    data_parallel: int | str = "auto",
    tp: int | str = "auto",
) -> tuple[list[ClusterCandidate], str]:
    """Per ``tp x pp x dp`` of ``cluster``'s world its fastest fitting setting (else the one needing the least
    memory, ``fits`` False), and why there is none (``""`` when some)."""
    if opts.schedule == "interleaved-1f1b":
        return [], "several stages per rank (interleaved-1f1b) do not run with tp"
    splits = tp_pipeline_splits(
        cluster.world, cluster.per_node, len(profile.layers), profile.batch_size, tp, data_parallel
    )
    if not splits:
        return [], _none(profile, cluster, tp, data_parallel)
    out = []
    for t, pp, dp in splits:
        found = _best(profile, cluster, opts, t, pp, dp)
        if found is not None:
            out.append(found)
    return out, "" if out else f"no cut into exactly pp stages of {len(profile.layers)} layers"


def _none(profile: Profile, cluster: Cluster, tp: int | str, data_parallel: int | str) -> str:
    """Why the world has no ``tp x pp x dp`` split."""
    if tp == 1:
        return "tp=1 was fixed"
    if not tp_degrees(cluster.per_node, tp):
        return f"no tp in {', '.join(map(str, TP_DEGREES))} divides the {cluster.per_node} device(s) per node"
    fixed = f" with data_parallel {data_parallel} fixed" if data_parallel != "auto" else ""
    return (
        f"no tp x pp x dp of {cluster.world} ranks with pp >= 2 stages of {len(profile.layers)} layers and "
        f"dp <= the batch ({profile.batch_size}){fixed}"
    )


def _best(
    profile: Profile, cluster: Cluster, opts: Options, tp: int, pp: int, dp: int
) -> ClusterCandidate | None:
    """``tp x pp x dp``'s fastest fitting setting, else (budgets ignored) the one needing the least memory."""
    b = shard_size(profile.batch_size, dp)
    if isinstance(opts.microbatches, int) and opts.microbatches > b:
        return None
    split, bare = tp_split_profile(profile, cluster, tp), tp_split_profile(profile, cluster, tp, comm=False)
    rep, rep0 = replica_profile(split, pp, b), replica_profile(bare, pp, b)
    capacity = budget_of(rep.devices[0])
    fitting, probes = [], []
    for setting in settings_grid(b, opts.microbatches, opts.schedule, opts.recompute):
        cm = CostModel(rep, *setting)
        ev = even_cut(cm, pp)
        if ev is not None:
            fitting.append(_priced(cm, ev, CostModel(rep0, *setting), cluster, opts, tp, dp))
            continue
        cm.capacity = [INF] * cm.D
        ev = even_cut(cm, pp)
        if ev is not None and not fitting:
            cand = _priced(cm, ev, CostModel(rep0, *setting), cluster, opts, tp, dp)
            why = unfit(cand.peak, capacity)
            probes.append(dataclasses.replace(cand, fits=not why, why=why))
    if fitting:
        return min(fitting, key=lambda c: c.step)
    return min(probes, key=lambda c: (c.peak, c.step)) if probes else None


def _priced(
    cm: CostModel, ev: Evaluation, bare: CostModel, cluster: Cluster, opts: Options, tp: int, dp: int
) -> ClusterCandidate:
    """One cut priced on ``cluster`` (module docstring): the tp coordinate 0's pipelines and replicas stand
    for every coordinate's (they run alike, on the same kinds of links)."""
    pp = len(ev.stages)
    ranks0 = [[(s * dp + r) * tp for r in range(dp)] for s in range(pp)]
    cand = evaluate_cluster(cm, ev, cluster, ranks0, LAYOUT, opts.bucket_bytes, opts.ties)
    plain = evaluate_cluster(
        bare,
        bare.evaluate(ev.stages),
        cluster,
        ranks0,
        LAYOUT,
        opts.bucket_bytes,
        opts.ties,
    )
    return dataclasses.replace(
        cand,
        stage_ranks=tp_pipeline_ranks(pp, dp, tp),
        compute=plain.compute,
        tp_comm=cand.compute - plain.compute,
        tp=tp,
    )

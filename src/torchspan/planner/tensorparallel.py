"""Tensor parallel x sharded on a cluster you describe: each block split over ``tp`` ranks of a node, FSDP2
over the rest.

What it prices is what ``span(model, tp=T, shard=True)`` runs (``runtime.ranks.tensorparallel``): a
``DeviceMesh`` ``(dp_shard, tp)``, ``tp`` innermost (a node's neighbouring ranks split the layers), each
block's attention heads and MLP width split column- then row-wise, the replica then sharded by FSDP2 over
``dp_shard``. Degrees: ``tp`` in ``TP_DEGREES`` (2, 4, 8) dividing the devices per node (``tp=`` fixes one),
``dp = world / tp`` replicas (``dp <= batch``), ``pp = 1``; each replica (``tp`` ranks) runs ``b = ceil(B /
dp)`` samples as one batch, every rank of it the same rows.

Which layers are split (``split_layers``): the profile cannot see 2-D weights, so the blocks stand for them:
the layers of the kind that holds parameters most often when it repeats (a transformer's blocks; an
``nn.Sequential``'s ``Linear``), else every layer holding parameters. The others (embedding, final norm,
head) stay whole on every rank of a replica, as the runtime keeps them (a model's own TP plan names its
blocks' projections only): full time at ``b`` samples, states sharded over ``dp`` alone.

Time of one step (``F_i``, ``Bw_i``: layer ``i``'s forward and backward at ``b`` samples; per-call fixed
parts kept whole, per-sample parts divided; ``out_i``: its output bytes at ``b`` samples)::

    split layer i : F'_i = F_fixed + F_sample * b / tp     Bw'_i likewise
    whole layer i : F'_i = F_i                             Bw'_i = Bw_i
    AR_i          = comm.allreduce_time(out_i, tp, intra-node link)       (split layers; 0 for whole ones)
    compute       = c_in + sum_i (F'_i + Bw'_i)                          (c_in: the batch from the host)
    tp_comm       = sum_{split i} 4 AR_i       (2 in forward, 2 in backward: after the attention's and the
                                                MLP's row-wise projection, and their inputs' gradients)
    collectives   = sharded.sharded_step's exposed part, the units' times F'_i + 2 AR_i and Bw'_i + 2 AR_i,
                    their bytes P_i / tp (split) or P_i (whole), over dp ranks on the link the dp group
                    spans (every tp rank's group {t, t + tp, ...}: the interconnect once it spans nodes);
                    0 for dp = 1
    step          = compute + tp_comm + collectives

The TP all-reduces are on the compute's path (DTensor waits for each before the next op): not overlapped
with compute. FSDP2's all-gathers and reduce-scatters overlap both, as for a sharded replica (another
link unless dp stays in the node). Not modelled: the TP all-reduces and a node's FSDP2 traffic sharing
NVLink when dp stays in a node, DTensor's per-op dispatch, uneven head or width splits, and the optimizer
step.

Memory of one rank (``sharded.sharded_memory`` over ``dp`` on the profile with split layers divided)::

    states      = (params + grads + optimizer) / (tp * dp)     split layers (whole ones / dp)
    gathered, unsharded: as a sharded replica's, of the units' P_i / tp (split) or P_i (whole)
    activations = b samples' of every layer; a split layer's saved bytes A_i are
                  W_i + (A_i - W_i) / tp,   W_i = min(A_i, WHOLE_OUTPUTS * out_i)

``W_i``: what every tp rank saves whole, ``WHOLE_OUTPUTS = 4`` tensors the size of the block's output (the
two norms' inputs and outputs, the projections' whole input; Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models": ``sbh (10 + 24 / t + 5 as / (h t))`` bytes per layer without
sequence parallelism, whose ``10 sbh`` is these four half-precision tensors and the two 1-byte dropout
masks, which Llama has not); the rest (q, k, v, attention scores and output, the MLP's intermediates) split.

Usage::

    found, why = tp_candidates(profile, cluster, setting=(1, "gpipe", "never"))   # fitting or not; why: none
    # c.tp, c.dp, c.tp_comm, c.peak
    best = min((c for c in found if c.fits), key=lambda c: c.step)
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence

from ..profiler.costs import LayerCost, Profile
from .candidates import ClusterCandidate, Reduction, evaluate_cluster
from .comm import allreduce_time
from .cost import CostModel
from .sharded import sharded_memory, sharded_step
from .stages import Stage
from .strategies import unfit
from .ties import TieCost
from .topology import Cluster, replica_profile, shard_size

__all__ = [
    "TP_DEGREES",
    "WHOLE_OUTPUTS",
    "LAYOUT",
    "tp_degrees",
    "split_layers",
    "split_layer",
    "tp_profile",
    "tp_candidates",
    "tp_notes",
]

TP_DEGREES = (2, 4, 8)  # searched degrees (within a node: those dividing its devices)
WHOLE_OUTPUTS = 4  # output-sized tensors a split block saves whole on every tp rank (module docstring)
LAYOUT = "tp-in-node"  # tp innermost: replica r on ranks r*tp .. r*tp + tp - 1


def tp_degrees(per_node: int, tp: int | str = "auto") -> list[int]:
    """The degrees to price: ``TP_DEGREES`` dividing ``per_node`` (``"auto"``), ``[]`` for ``tp=1``, or
    ``[tp]``. Raises ``ValueError`` for a fixed ``tp`` that is not an int >= 1 dividing the devices per
    node."""
    if tp == "auto":
        return [t for t in TP_DEGREES if t <= per_node and per_node % t == 0]
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(
            f"tp={tp!r} must be 'auto' or an int >= 1 (ranks of one node each layer is split over)"
        )
    if per_node % tp:
        raise ValueError(
            f"tp={tp} does not divide the {per_node} device(s) per node: tensor parallelism splits each "
            "layer over devices of one node (its all-reduces need the intra-node link); use a divisor of "
            f"{per_node}, or 1 for none"
        )
    return [] if tp == 1 else [tp]


def split_layers(profile: Profile) -> list[bool]:
    """Per layer: whether tensor parallelism splits it (the blocks; module docstring)."""
    counts = Counter(lay.kind for lay in profile.layers if lay.param_bytes > 0)
    kind, n = counts.most_common(1)[0] if counts else ("", 0)
    return [lay.param_bytes > 0 and (n < 2 or lay.kind == kind) for lay in profile.layers]


def split_layer(lay: LayerCost, tp: int, ar: float, ar_per_sample: float = 0.0) -> LayerCost:
    """``lay`` (one device) as one of ``tp`` ranks holds and runs it, its two forward and two backward
    all-reduces (``ar + m * ar_per_sample`` seconds each for ``m`` samples) in its times.

    Usage: ``split_layer(layer, 2, 1e-4)``."""
    whole = min(lay.activation_bytes, WHOLE_OUTPUTS * lay.output_bytes)
    return dataclasses.replace(
        lay,
        param_bytes=math.ceil(lay.param_bytes / tp),
        grad_bytes=math.ceil(lay.grad_bytes / tp),
        optimizer_bytes=math.ceil(lay.optimizer_bytes / tp),
        activation_bytes=whole + (lay.activation_bytes - whole) / tp,
        forward_fixed=[lay.forward_fixed[0] + 2 * ar],
        forward_per_sample=[lay.forward_per_sample[0] / tp + 2 * ar_per_sample],
        backward_fixed=[lay.backward_fixed[0] + 2 * ar],
        backward_per_sample=[lay.backward_per_sample[0] / tp + 2 * ar_per_sample],
    )


def tp_profile(profile: Profile, cluster: Cluster, tp: int, batch: int) -> tuple[Profile, float, list[float]]:
    """``(profile, tp_comm, ar)``: one rank of a ``tp``-way replica running ``batch`` samples (one device;
    split layers divided, their all-reduces folded into their times), the step's TP all-reduce seconds, and
    each layer's ``AR_i``."""
    rep = replica_profile(profile, 1, batch)
    ars = [
        allreduce_time(lay.output_bytes * batch + lay.output_fixed_bytes, tp, cluster.intra) if split else 0.0
        for lay, split in zip(rep.layers, split_layers(rep))
    ]
    layers = [
        split_layer(lay, tp, ar) if split else lay
        for lay, split, ar in zip(rep.layers, split_layers(rep), ars)
    ]
    return dataclasses.replace(rep, layers=layers), 4 * sum(ars), ars


def tp_candidates(
    profile: Profile,
    cluster: Cluster,
    *,
    setting: tuple[int, str, str] | None,
    ties: Sequence[TieCost] = (),
    data_parallel: int | str = "auto",
    tp: int | str = "auto",
) -> tuple[list[ClusterCandidate], str]:
    """Every ``tp x dp`` of ``cluster``'s world (fitting or not: ``fits``, ``why``), and why there is none
    (``""`` when some). ``setting``: the replica's ``(microbatches, schedule, recompute)`` (None: the caller
    fixed another)."""
    degrees = tp_degrees(cluster.per_node, tp)
    B, world = profile.batch_size, cluster.world
    if not degrees:
        return (
            [],
            "tp=1 was fixed"
            if tp == 1
            else f"no tp in {', '.join(map(str, TP_DEGREES))} divides the {cluster.per_node} device(s) per "
            "node",
        )
    if setting is None:
        return [], "a tensor-parallel replica runs its rows as one batch (microbatches=1, recompute='never')"
    splits = [(t, world // t) for t in degrees if world // t <= B and data_parallel in ("auto", world // t)]
    if not splits:
        fixed = f" and data_parallel {data_parallel} was fixed" if data_parallel != "auto" else ""
        return (
            [],
            f"tp {' / '.join(map(str, degrees))} leaves {' / '.join(str(world // t) for t in degrees)} "
            f"replicas for a batch of {B}{fixed}",
        )
    return [_candidate(profile, cluster, t, dp, setting, ties) for t, dp in splits], ""


def _candidate(
    profile: Profile,
    cluster: Cluster,
    tp: int,
    dp: int,
    setting: tuple[int, str, str],
    ties: Sequence[TieCost],
) -> ClusterCandidate:
    """``tp x dp`` priced (module docstring)."""
    prof, tp_comm, _ = tp_profile(profile, cluster, tp, shard_size(profile.batch_size, dp))
    cm = CostModel(prof, *setting)
    stage = Stage(0, 0, cm.L)
    group = [r * tp for r in range(dp)]  # tp rank 0's dp_shard group; every tp rank's spans the same nodes
    base = evaluate_cluster(cm, cm.evaluate([stage]), cluster, [group], LAYOUT)
    link = cluster.link(group)
    mem = sharded_memory(cm, stage, dp, ties=ties)
    if dp > 1:
        t = sharded_step(cm, stage, dp, link, ties=ties)
        exposed, totals = (
            t.exposed,
            (("allgather_total", t.allgather), ("reduce_scatter_total", t.reduce_scatter)),
        )
        reduction = Reduction(link.key, t.allgather + t.reduce_scatter, t.collectives, t.exposed)
    else:
        exposed, totals, reduction = 0.0, (), Reduction(link.key, 0.0, 0, 0.0)
    why = unfit(mem.total, cm.capacity[0])
    return dataclasses.replace(
        base,
        dp=dp,
        stage_ranks=[list(range(cluster.world))],
        compute=base.compute - tp_comm,
        allreduce=exposed,
        reductions=(reduction,),
        shard=dp > 1,
        memory=(mem.stage_memory(),),
        totals=totals,
        fits=not why,
        why=why,
        tp=tp,
        tp_comm=tp_comm,
    )


def tp_notes(best: ClusterCandidate, cluster: Cluster) -> list[str]:
    """What a tensor-parallel plan runs and how it was priced (for ``Plan.notes``)."""
    if best.tp <= 1:
        return []
    split = split_layers(best.cm.profile)
    names = [lay.name for lay, s in zip(best.cm.profile.layers, split) if not s and lay.param_bytes > 0]
    whole = f"; whole on every rank of a replica: {', '.join(names)}" if names else ""
    if best.pp > 1:
        return _pipeline_notes(best, cluster, sum(split), whole)
    run = f"span(model, tp={best.tp}, shard=True)" if best.dp > 1 else f"span(model, tp={best.tp})"
    sharded = f", then FSDP2 over dp_shard {best.dp} ({best.reductions[0].link})" if best.dp > 1 else ""
    return [
        f"tensor parallel: {sum(split)} block(s) split over tp {best.tp} ranks of a node (DTensor: "
        f"attention heads and MLP width column- then row-wise){sharded}{whole}; span(model, plan) runs it "
        f"in a job of {cluster.world} processes, as {run} does (on fewer: shrunk, tp = gcd(tp, "
        "WORLD_SIZE)); planner.tensorparallel has the formulas",
        f"tp all-reduces: 4 per block (2 forward, 2 backward) of its output over {cluster.intra.key}, "
        f"{best.tp_comm * 1e3:.3f} ms per step, not overlapped with compute; a split block keeps "
        f"{WHOLE_OUTPUTS} output-sized activations whole and 1/tp of the rest",
    ]


def _pipeline_notes(best: ClusterCandidate, cluster: Cluster, blocks: int, whole: str) -> list[str]:
    """What a tensor parallel x pipeline plan runs (``planner.tppipeline``) and how it was priced."""
    balance = [st.end - st.start for st in best.evaluation.stages]
    replicas = f", {best.dp} replicas (dp_replicate)" if best.dp > 1 else ""
    return [
        f"tensor parallel x pipeline: {best.pp} stages {balance} (layers), each split over tp {best.tp} "
        f"ranks of a node{replicas}: {blocks} block(s) split (DTensor: attention heads and MLP width "
        f"column- then row-wise){whole}; span(model, plan) runs it in a job of {cluster.world} processes, as "
        f"span(model, tp={best.tp}, balance={balance}) does (mesh pp x dp_replicate x tp, tp innermost; on "
        "fewer: shrunk, the stages kept, tp = gcd(tp, WORLD_SIZE / pp)); planner.tppipeline has the formulas",
        f"tp all-reduces: 4 per block and micro-batch (2 forward, 2 backward) of its output over "
        f"{cluster.intra.key}, {best.tp_comm * 1e3:.3f} ms of the step (on the pipeline's path, bubble "
        f"included), not overlapped with compute; hand-overs whole on every tp rank, {best.p2p * 1e3:.3f} ms",
    ]

"""Sharded data parallel (FSDP2, ZeRO-3) and CPU offload: what one rank holds and how long its step takes.

Usage::

    mem = sharded_memory(cm, stage, n=16)                        # one rank of a 16-way sharded replica
    t = sharded_step(cm, stage, n=16, link=cluster.link(ranks))  # t.exposed: collectives the step waits for
    mem = sharded_memory(cm, stage, n=16, offload=True); mem.host  # states in host memory instead
    t = sharded_step(cm, stage, 16, link, pcie=pcie_link(device))  # + host copies over PCIe

Units are torchspan's layers (``model_layers``: blocks by qualified name), each one ``fully_shard``
unit as ``span(model, shard=True)`` wraps them; a tied parameter lives in the root unit (FSDP2 keeps
a parameter two units share in their common parent), gathered for the whole step. Per unit ``k``:
``P_k``, ``G_k`` parameter and gradient bytes (whole), ``F_k``, ``B_k`` forward and backward seconds
of the rank's batch; ``n`` ranks share the states. ``ag(S) = rs(S) = (n-1)/n * S / bw + (n-1) * lat``
(``comm.allgather_time``) on the link the ranks span.

Memory of one rank (bytes), ``reshard_after_forward=True`` (FSDP2's default, what a plan runs)::

    states      = (params + grads + optimizer) / n            (ceil; buffers are not sharded)
    gathered    = P_root + max_k (2 P_k + max(P_{k-1}, P_{k+1}))
                  (the unit computing, the all-gather buffer FSDP2 keeps until the next unit's copy-out,
                  and a neighbour gathered ahead: ``_fsdp_param_group.wait_for_unshard``)
    unsharded   = G_root + max_k G_k                          (a unit's gradients before their reduce-scatter)
    device      = states + gathered + unsharded + buffers + activations + workspace
    offload     : states go to host memory (``host``); the device keeps the rest

``reshard_after_forward=False`` keeps every unit gathered from its forward to its backward
(``gathered = sum_k P_k``: no all-gather in backward). A pipeline stage sharded over its replicas
(``pipeline=True``) runs as ``torch.distributed.pipelining`` runs FSDP stages (torchtitan: no
reshard after forward, gradients accumulated unsharded over the micro-batches and reduce-scattered
once after the last backward): ``gathered = P``, ``unsharded = G`` of the whole stage (the one
unit's all-gather buffer alive at a time is not counted in these two).

Time of one step (pp = 1, one batch per rank): two resources, the device's compute stream and the
link (every collective in the order FSDP2 issues it, one after another)::

    forward : root gathered first; unit k's all-gather starts when the link is free and unit k-2
              has finished its forward (two units gathered at most); its forward starts when
              gathered and unit k-1's forward is done
    backward: (reshard) unit K-1 gathered again, then before unit k's backward the all-gather of
              unit k-1 (prefetched once unit k+1's backward freed its unit); after unit k's
              backward its reduce-scatter; the root's reduce-scatter after unit 0's
    exposed = end - sum_k (F_k + B_k)           (the collectives the step waits for)

Each gathered unit is copied out of the all-gather buffer on the compute stream (``2 P_k / membw``:
read and write at the device's memory bandwidth, once per all-gather) and each unit's gradients into
the reduce-scatter's input on its stream (``2 G_k / membw``, folded into the reduce-scatter): these
copies are in ``exposed`` too, which makes a sharded step slower than a replica's when the
collectives hide behind compute either way.

With ``offload``: each all-gather first copies the unit's shard to the device and each reduce-scatter
then copies the gradient shard to the host, over the device's PCIe link (``pcie_link``): folded into
the collective's time (``P_k / n`` and ``G_k / n`` bytes), so PCIe and network do not overlap each
other (an upper bound) but both overlap compute. Then the optimizer steps on the CPU, after backward,
exposed in full (``cpu_optimizer_time``): memory-bound elementwise passes over the node's parameters,
``seconds = passes(optimizer) * param bytes of the node's ranks / host memory bandwidth``, ``passes``
counted from ``torch.optim``'s single-tensor step (CPU tensors take it): Adam 18 (lerp 3, mul 2,
addcmul 3, sqrt 2, div 2, add 2, addcdiv 4), AdamW 20 (+ the decay's mul), SGD 3, SGD with
momentum 8, any other 20. The node's ranks step at once and share its memory bandwidth. Measured
once on this project's shared 2-core machine (33.5M float32 parameters, under load), Adam, AdamW, SGD
and SGD with momentum took 1.40, 1.35, 0.82 and 1.65 times this figure at ``catalog.measure_host()``'s
copy bandwidth: the right order, optimistic by up to 1.7x where the elementwise work is not
memory-bound on few cores.

Not modelled: the optimizer step on the device (for every strategy alike), FSDP2's padding of
each shard to a multiple of ``n`` rows, and collectives slowing the compute they overlap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..hardware import Device, catalog
from ..hardware.links import Link, lookup
from .comm import allgather_time, p2p_time, reduce_scatter_time
from .cost import CostModel
from .physical import host_bandwidth, memory_bandwidth
from .stages import Stage, StageMemory
from .ties import TieCost

__all__ = [
    "ShardMemory",
    "ShardTimes",
    "sharded_memory",
    "sharded_step",
    "first_forward_exposed",
    "cpu_optimizer_time",
    "optimizer_passes",
    "pcie_link",
    "host_memory_bandwidth",
    "OPTIMIZER_PASSES",
]

# elementwise passes (reads + writes of one element) of torch.optim's single-tensor step, per parameter
OPTIMIZER_PASSES = {
    "none": 0,
    "sgd": 3,
    "sgd-momentum": 8,
    "momentum": 8,
    "adam": 18,
    "adamw": 20,
    "adam-amsgrad": 22,
}
OTHER_OPTIMIZER_PASSES = 20


@dataclass(frozen=True)
class ShardMemory:
    """Bytes one rank of a sharded stage holds on its device, by kind, and in host memory (offload)."""

    params: int  # the parameter shard (unless offloaded) and the gathered units
    grads: int  # the gradient shard (unless offloaded) and the unsharded gradients awaiting reduce-scatter
    optimizer: int  # the optimizer-state shard (0 when offloaded)
    buffers: int
    activations: int
    workspace: int
    host: int = 0  # offloaded: parameter, gradient and optimizer shards in host memory (pinned)
    gathered: int = 0  # of ``params``: the gathered units and their all-gather inputs
    unsharded: int = 0  # of ``grads``: gradients before their reduce-scatter

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers + self.activations + self.workspace

    def stage_memory(self) -> StageMemory:
        return StageMemory(
            self.params, self.grads, self.optimizer, self.buffers, self.activations, self.workspace
        )


@dataclass(frozen=True)
class ShardTimes:
    """Seconds of one sharded step's communication: totals and the part the step waits for (``exposed``)."""

    compute: float  # sum of the units' forward and backward
    exposed: float  # collectives (and their host copies) the step waits for, beyond compute
    allgather: float  # all of the all-gathers (with offload: their host-to-device copies too)
    reduce_scatter: float  # all of the reduce-scatters (with offload: their device-to-host copies too)
    pcie: float = 0.0  # of those: the host copies
    optimizer: float = 0.0  # the optimizer step on the CPU (offload), exposed in full
    collectives: int = 0  # how many all-gathers and reduce-scatters
    notes: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class _Unit:
    params: float
    grads: float
    forward: float
    backward: float
    copy_out: float = 0.0  # seconds to copy the unit out of its all-gather buffer (compute stream)
    copy_in: float = 0.0  # seconds to copy its gradients into the reduce-scatter's input


def _units(cm: CostModel, stage: Stage, ties: Sequence[TieCost]) -> tuple[list[_Unit], _Unit]:
    """The stage's layers as units, and the root: the ties held by two of its layers (moved out of their home
    layer)."""
    layers = cm.profile.layers
    params = [float(layers[i].param_bytes) for i in range(stage.start, stage.end)]
    grads = [float(layers[i].grad_bytes) for i in range(stage.start, stage.end)]
    root_p = root_g = 0.0
    for tie in ties:
        inside = [i for i in tie.layers if stage.start <= i < stage.end]
        if len(inside) < 2:
            continue
        home = inside[0] - stage.start
        moved = min(float(tie.nbytes), params[home])
        params[home] -= moved
        root_p += moved
        taken = min(float(tie.nbytes), grads[home])
        grads[home] -= taken
        root_g += taken
    d = stage.device
    bw = memory_bandwidth(cm.profile.devices[d])

    def copy(nbytes: float) -> float:
        return 2.0 * nbytes / bw if bw > 0 else 0.0

    units = [
        _Unit(p, g, float(cm.fwd[d, i]), float(cm.bwd[d, i]), copy(p), copy(g))
        for p, g, i in zip(params, grads, range(stage.start, stage.end))
    ]
    return units, _Unit(root_p, root_g, 0.0, 0.0, copy(root_p), copy(root_g))


def sharded_memory(
    cm: CostModel,
    stage: Stage,
    n: int,
    *,
    reshard: bool = True,
    offload: bool = False,
    pipeline: bool = False,
    in_flight: int = 1,
    ties: Sequence[TieCost] = (),
) -> ShardMemory:
    """One rank's bytes for ``stage`` sharded over ``n`` ranks (module docstring). ``pipeline``: a stage of a
    pipeline (parameters gathered and gradients accumulated unsharded for the whole step); ``in_flight``:
    micro-batches whose activations the stage holds at once (``cm.in_flight``)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"sharded_memory(n={n!r}) must be an int >= 1 (ranks sharing the states)")
    base = cm.stage_memory(stage.start, stage.end, in_flight)
    units, root = _units(cm, stage, ties)
    shard = [math.ceil(x / n) for x in (base.params, base.grads, base.optimizer)]
    if pipeline or not reshard:
        gathered = float(base.params)
    else:
        near = [0.0, *(u.params for u in units), 0.0]
        gathered = root.params + max(
            2 * near[k] + max(near[k - 1], near[k + 1]) for k in range(1, len(near) - 1)
        )
    gathered_bytes = math.ceil(gathered) if n > 1 or offload else 0
    if pipeline:
        unsharded = int(base.grads) if n > 1 or offload else 0
    else:
        unsharded = int(root.grads + max(u.grads for u in units)) if n > 1 or offload else 0
    here = [0, 0, 0] if offload else shard
    return ShardMemory(
        params=here[0] + gathered_bytes,
        grads=here[1] + unsharded,
        optimizer=here[2],
        buffers=base.buffers,
        activations=base.activations,
        workspace=base.workspace,
        host=sum(shard) if offload else 0,
        gathered=gathered_bytes,
        unsharded=unsharded,
    )


def sharded_step(
    cm: CostModel,
    stage: Stage,
    n: int,
    link: Link,
    *,
    reshard: bool = True,
    pcie: Link | None = None,
    ties: Sequence[TieCost] = (),
) -> ShardTimes:
    """Communication of one step of ``stage`` (the whole model, pp = 1, one batch) sharded over ``n`` ranks on
    ``link``; ``pcie``: the offloaded states' host link (None: not offloaded). See the module docstring."""
    units, root = _units(cm, stage, ties)

    def gather(u: _Unit) -> tuple[float, float]:
        copy = p2p_time(u.params / n, pcie) if pcie is not None and u.params else 0.0
        return allgather_time(u.params, n, link) + copy, copy

    def scatter(u: _Unit) -> tuple[float, float]:
        copy = p2p_time(u.grads / n, pcie) if pcie is not None and u.grads else 0.0
        return u.copy_in + reduce_scatter_time(u.grads, n, link) + copy, copy

    ag = [gather(u) for u in units]
    rs = [scatter(u) for u in units]
    root_ag, root_rs = gather(root), scatter(root)
    comm, fwd_end = _forward(units, [a for a, _ in ag], root_ag[0] + root.copy_out)
    comp = fwd_end[-1]
    K = len(units)
    ready_b = [0.0] * K
    if reshard:
        comm = max(comm, comp) + ag[K - 1][0]
        ready_b[K - 1] = comm
    bwd_end = [0.0] * (K + 1)
    bwd_end[K] = comp
    for k in range(K - 1, -1, -1):
        if reshard and k >= 1:  # prefetch unit k-1 once unit k+1's backward freed its unit
            comm = max(comm, bwd_end[k + 1]) + ag[k - 1][0]
            ready_b[k - 1] = comm
        comp = max(comp, ready_b[k]) + units[k].backward + (units[k].copy_out if reshard else 0.0)
        bwd_end[k] = comp
        comm = max(comm, comp) + rs[k][0]
    comm = max(comm, comp) + root_rs[0]
    pure = sum(u.forward + u.backward for u in units)
    gathers = root_ag[0] + sum(a for a, _ in ag) * (2 if reshard else 1)
    copies = root_ag[1] + root_rs[1] + sum(c for _, c in ag) * (2 if reshard else 1) + sum(c for _, c in rs)
    count = sum(1 for u in units if u.params) * (2 if reshard else 1) + sum(1 for u in units if u.grads)
    count += 2 if root.params else 0
    return ShardTimes(
        compute=pure,
        exposed=max(comp, comm) - pure,
        allgather=gathers,
        reduce_scatter=root_rs[0] + sum(r for r, _ in rs),
        pcie=copies,
        collectives=count if n > 1 else 0,
    )


def _forward(units: Sequence[_Unit], ag: Sequence[float], root: float) -> tuple[float, list[float]]:
    """``(link free, forward end of each unit)``: the forward's all-gathers, two units gathered at most."""
    comm = comp = root  # the root is gathered (and copied out) before anything runs
    ends: list[float] = []
    for k, u in enumerate(units):
        comm = max(comm, ends[k - 2] if k >= 2 else 0.0) + ag[k]
        comp = max(comp, comm) + u.copy_out + u.forward
        ends.append(comp)
    return comm, ends


def first_forward_exposed(
    cm: CostModel, stage: Stage, n: int, link: Link, ties: Sequence[TieCost] = ()
) -> tuple[float, float]:
    """``(exposed, total)`` seconds of a pipeline stage sharded over ``n`` ranks gathering its parameters in
    its first micro-batch's forward (they stay gathered for the rest of the step): the forward with the
    all-gathers and their copy-outs minus without, and all of them."""
    units, root = _units(cm, stage, ties)
    ag = [allgather_time(u.params, n, link) for u in units]
    first = allgather_time(root.params, n, link) + root.copy_out
    _, ends = _forward(units, ag, first)
    return ends[-1] - sum(u.forward for u in units), first + sum(ag) + sum(u.copy_out for u in units)


def optimizer_passes(label: str) -> int:
    """Elementwise passes per parameter of ``label``'s CPU step (module docstring); unknown optimizers: 20."""
    return OPTIMIZER_PASSES.get(str(label).lower(), OTHER_OPTIMIZER_PASSES)


def cpu_optimizer_time(param_bytes: float, label: str, bandwidth: float) -> float:
    """Seconds of an optimizer step on the CPU over ``param_bytes`` of parameters at ``bandwidth`` bytes/s."""
    if not bandwidth > 0:
        raise ValueError(f"cpu_optimizer_time(bandwidth={bandwidth!r}) must be > 0 bytes/s")
    return optimizer_passes(label) * float(param_bytes) / bandwidth


def host_memory_bandwidth(device: Device) -> tuple[float, str]:
    """``(bytes/s, where from)`` of the host memory behind ``device``: this machine's measured copy bandwidth
    for a present device, else the catalog's generic server CPU at its memory efficiency (a described node's
    host)."""
    if device.present:
        speed = catalog.measure_host()
        return (
            speed.memory_bandwidth,
            f"this machine's measured copy bandwidth ({speed.memory_bandwidth / 1e9:.1f} GB/s)",
        )
    cpu = catalog.lookup("generic-cpu")
    assert cpu is not None
    bw = float(cpu.extra["memory_bandwidth"]) * float(cpu.extra["memory_efficiency"])
    return bw, f"assumed: the catalog's generic-cpu host ({bw / 1e9:.1f} GB/s effective)"


def pcie_link(device: Device) -> Link:
    """The link offloaded states cross between host and ``device``: its catalog host link
    (``pcie4``/``pcie5``), else a PCIe link at the device's host bandwidth."""
    host = device.extra.get("host_link") if isinstance(device.extra, dict) else None
    key = {"PCIe Gen4 x16": "pcie4", "PCIe Gen5 x16": "pcie5"}.get(str(host))
    if key is not None:
        return lookup(key)
    bw = host_bandwidth(device)
    base = lookup("pcie4")
    return Link(
        "host",
        f"host link of {device.device}",
        bw if math.isfinite(bw) else base.bandwidth,
        base.latency,
        1.0 if math.isfinite(bw) else base.efficiency,
        "the device's host bandwidth" if math.isfinite(bw) else base.source,
    )

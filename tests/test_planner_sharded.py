"""The planner weighs every strategy (issue 20 items 5 and 6): sharded (FSDP2) and offload memory and time,
the comparison table and JSON, the winner in the plan, and planning a transformers model built on ``meta``
(the command line: test_cli_plan.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from planner_synth import device, layer
from torch import nn

import torchspan
from torchspan.hardware import catalog
from torchspan.hardware.links import Link
from torchspan.planner import Plan, StagePlan
from torchspan.planner.cluster import cluster_search
from torchspan.planner.comm import allgather_time, allreduce_time, reduce_scatter_time
from torchspan.planner.cost import CostModel
from torchspan.planner.sharded import (
    cpu_optimizer_time,
    optimizer_passes,
    pcie_link,
    sharded_memory,
    sharded_step,
)
from torchspan.planner.stages import Stage
from torchspan.planner.strategies import SHARD_MARGIN, STRATEGIES
from torchspan.planner.ties import TieCost
from torchspan.planner.topology import Cluster
from torchspan.profiler.costs import LayerCost, Profile

MB = 10**6


def _link(bw: float = 1e9, lat: float = 0.0) -> Link:
    return Link("test", "test link", bw, lat, 1.0, "test figures")


def _profile(
    per_node: int, capacity: int | None, layers: int = 16, params: int = MB, batch: int = 64
) -> Profile:
    """``layers`` equal layers (``params`` bytes, Adam) on ``per_node`` equal described GPUs with an HBM-class
    memory bandwidth."""
    devs = [
        device("cuda", "gpu", capacity, bandwidth=32e9, index=k, memory_bandwidth=2e12)
        for k in range(per_node)
    ]
    lays = [
        layer(f"l{k}", params=params, act=1e3, out=1e3, speeds=[1.0] * per_node, fixed=1e-5)
        for k in range(layers)
    ]
    return Profile(layers=lays, devices=devs, batch_size=batch, input_bytes=1e3, optimizer="adam")


def _units(params: list[int], fwd: float = 1e-3, bwd: float = 2e-3) -> CostModel:
    """One device without a memory figure (no copy costs), layers of ``params`` bytes with fixed times, batch
    1."""
    lays = [
        LayerCost(
            f"u{k}", "Linear", p, p, 2 * p, 0, 0.0, 0.0, 0.0, [fwd], [0.0], [bwd], [0.0], ["estimated: test"]
        )
        for k, p in enumerate(params)
    ]
    prof = Profile(lays, [device("cuda", "gpu", None)], batch_size=1, input_bytes=0.0, optimizer="adam")
    return CostModel(prof, 1, "gpipe", "never")


# ---------------------------------------------------------------- formulas
def test_allgather_and_reduce_scatter_are_the_halves_of_the_ring_all_reduce() -> None:
    link = _link(bw=1e9, lat=1e-5)
    # (n - 1) / n * S / bw + (n - 1) * latency
    assert allgather_time(1e6, 4, link) == pytest.approx(0.75e-3 + 3e-5, rel=1e-12)
    assert reduce_scatter_time(1e6, 4, link) == allgather_time(1e6, 4, link)
    assert allgather_time(1e6, 4, link) + reduce_scatter_time(1e6, 4, link) == pytest.approx(
        allreduce_time(1e6, 4, link), rel=1e-12
    )
    assert allgather_time(1e6, 1, link) == 0.0 and allgather_time(0, 8, link) == 0.0


def test_sharded_memory_by_kind() -> None:
    cm = _units([1 * MB, 2 * MB, 4 * MB, 1 * MB])  # 8 MB of parameters, 8 of gradients, 16 of Adam state
    stage = Stage(0, 0, 4)
    mem = sharded_memory(cm, stage, 4)
    # states / 4; gathered: the largest unit twice (itself and its all-gather buffer) and its larger neighbour
    assert mem.gathered == 2 * 4 * MB + 2 * MB and mem.unsharded == 4 * MB
    assert (mem.params, mem.grads, mem.optimizer) == (2 * MB + mem.gathered, 2 * MB + 4 * MB, 4 * MB)
    assert (
        mem.host == 0
        and mem.total == mem.params + mem.grads + mem.optimizer + mem.activations + mem.workspace
    )
    off = sharded_memory(cm, stage, 4, offload=True)
    assert off.host == 8 * MB and (off.params, off.grads, off.optimizer) == (mem.gathered, 4 * MB, 0)
    zero2 = sharded_memory(cm, stage, 4, reshard=False)  # every unit stays gathered from forward to backward
    assert zero2.gathered == 8 * MB
    pipe = sharded_memory(
        cm, stage, 4, pipeline=True
    )  # torch.distributed.pipelining: whole stage gathered, grads unsharded
    assert (pipe.params, pipe.grads, pipe.optimizer) == (8 * MB + 2 * MB, 8 * MB + 2 * MB, 4 * MB)
    # a tie held by two units lives in the root, gathered for the whole step
    tied = sharded_memory(cm, stage, 4, ties=[TieCost("w", (0, 3), MB)])
    assert tied.gathered == MB + 2 * 4 * MB + 2 * MB
    assert (
        sharded_memory(cm, stage, 1).total == cm.stage_memory(0, 4, 1).total
    )  # one rank: the replica itself


def test_sharded_step_overlaps_collectives_with_compute_exactly() -> None:
    """2 units of 1 MB, 1 ms forward, 2 ms backward, 2 ranks on 1 GB/s: each all-gather / reduce-scatter 0.5
    ms.

    forward: AG0 0-0.5, F0 0.5-1.5, AG1 0.5-1.0, F1 1.5-2.5; backward: AG1 again 2.5-3.0, AG0 3.0-3.5
    (prefetched), B1 3.0-5.0, RS1 5.0-5.5, B0 5.0-7.0, RS0 7.0-7.5: 7.5 ms for 6 ms of compute."""
    cm = _units([MB, MB])
    t = sharded_step(cm, Stage(0, 0, 2), 2, _link())
    assert t.compute == pytest.approx(6e-3) and t.exposed == pytest.approx(1.5e-3, rel=1e-9)
    assert (
        t.allgather == pytest.approx(2e-3) and t.reduce_scatter == pytest.approx(1e-3) and t.collectives == 6
    )
    # reshard_after_forward=False: no all-gathers in backward (B1 2.5-4.5, RS1 4.5-5.0, B0 4.5-6.5, RS0
    # 6.5-7.0)
    assert sharded_step(cm, Stage(0, 0, 2), 2, _link(), reshard=False).exposed == pytest.approx(
        1.0e-3, rel=1e-9
    )
    # offload: every all-gather first copies the 0.5 MB shard in, every reduce-scatter copies it out (1 GB/s):
    # 1 ms each
    off = sharded_step(cm, Stage(0, 0, 2), 2, _link(), pcie=_link())
    assert off.exposed == pytest.approx(3.0e-3, rel=1e-9) and off.pcie == pytest.approx(3.0e-3)


def test_cpu_optimizer_step_and_pcie_link() -> None:
    # Adam on the CPU: 18 elementwise passes over the parameters, memory-bound
    assert optimizer_passes("adam") == 18 and optimizer_passes("sgd") == 3 and optimizer_passes("adamw") == 20
    assert cpu_optimizer_time(4e9, "adam", 60e9) == pytest.approx(18 * 4e9 / 60e9)
    assert (
        pcie_link(catalog.lookup("h100-80gb")).key == "pcie5"
        and pcie_link(catalog.lookup("a100-40gb")).key == "pcie4"
    )


# ---------------------------------------------------------------- the choice flips where it should
def test_fits_as_replicas_on_a_fast_link_is_replicas() -> None:
    prof = _profile(4, None)
    plan = cluster_search(prof, Cluster.describe(prof.devices, 1, intra="nvlink4"))
    rows = {r["strategy"]: r for r in plan.comparison}
    assert plan.data_parallel == 4 and len(plan.stages) == 1 and not plan.shard and plan.offload is None
    assert (
        rows["replicas"]["chosen"] and rows["sharded"]["fits"]
    )  # a genuine choice: sharding fits, gains under 2%
    assert rows["sharded"]["predicted_step_time"] > plan.predicted_step_time * (1 - SHARD_MARGIN)


def test_replicas_do_not_fit_sharded_does() -> None:
    prof = _profile(
        4, 40 * MB
    )  # 64 MB of states; the replica needs 61 MiB, a quarter of them plus two units fit
    plan = cluster_search(prof, Cluster.describe(prof.devices, 1, intra="nvlink4"))
    rows = {r["strategy"]: r for r in plan.comparison}
    assert plan.shard and plan.offload is None and plan.data_parallel == 4 and len(plan.stages) == 1
    assert not rows["replicas"]["fits"] and "needs 61.34 MiB per device" in rows["replicas"]["note"]
    assert rows["sharded"]["chosen"] and rows["pipeline"]["fits"]  # a pipeline fits too, and is slower
    assert rows["pipeline"]["predicted_step_time"] > plan.predicted_step_time
    assert all(s.total_bytes <= 40 * MB for s in plan.stages)
    assert plan.peak_memory["rank 0 (cuda:0, node 0)"] == rows["sharded"]["peak_memory"] <= 40 * MB
    assert any(n.startswith("sharded: span(model, plan) runs FSDP2") for n in plan.notes)


def test_sharded_does_not_fit_offload_does() -> None:
    prof = _profile(4, 8 * MB)
    plan = cluster_search(prof, Cluster.describe(prof.devices, 1, intra="nvlink4"), host_memory=100 * MB)
    rows = {r["strategy"]: r for r in plan.comparison}
    assert plan.shard and plan.offload == "cpu" and plan.data_parallel == 4
    assert [r["fits"] for r in plan.comparison] == [False, False, True, False, False, False, False, False]
    host = rows["sharded + offload"]["host_memory"]
    assert (
        host == 4 * 16 * MB and rows["sharded + offload"]["host_budget"] == 100 * MB
    )  # the node's 4 ranks' shards
    assert plan.peak_memory["host of node 0 (cpu)"] == host
    t = plan.predicted_times
    assert t["optimizer_cpu"] > 0 and t["pcie_total"] > 0
    assert plan.predicted_step_time == pytest.approx(
        sum(v for k, v in t.items() if not k.endswith("_total")), rel=1e-12
    )
    # the host holds less than the node's shards: nothing fits, and the error carries the comparison
    with pytest.raises(
        torchspan.PlanError, match=r"no strategy fits(.|\n)*needs 61.04 MiB of host memory per node"
    ):
        cluster_search(prof, Cluster.describe(prof.devices, 1, intra="nvlink4"), host_memory=10 * MB)


def test_slow_interconnect_flips_replicas_to_an_overlapping_strategy() -> None:
    """The same model as the fast-link test on 2 nodes joined by 25 Gb/s Ethernet: the replicas' all-reduce
    after backward is exposed; sharding hides its all-gathers and reduce-scatters behind each layer's
    compute."""
    prof = _profile(4, None)
    fast = cluster_search(prof, Cluster.describe(prof.devices, 2, intra="nvlink4", interconnect="ib-400g"))
    slow = cluster_search(prof, Cluster.describe(prof.devices, 2, intra="nvlink4", interconnect="eth-25g"))
    assert not fast.shard and fast.data_parallel == 8
    rows = {r["strategy"]: r for r in slow.comparison}
    assert slow.shard and slow.data_parallel == 8 and rows["sharded"]["chosen"]
    assert rows["replicas"]["predicted_step_time"] * (1 - SHARD_MARGIN) > slow.predicted_step_time


def test_offload_is_not_offered_on_cpus_and_pipeline_x_sharded_is_priced() -> None:
    devs = [device("cpu", "cpu", None)]
    lays = [layer(f"l{k}", params=MB, act=1e3, out=1e3, speeds=[1.0], fixed=1e-5) for k in range(8)]
    prof = Profile(layers=lays, devices=devs, batch_size=16, input_bytes=1e3, optimizer="adam")
    plan = cluster_search(prof, Cluster.describe(devs, 4, interconnect="eth-25g"))
    rows = {r["strategy"]: r for r in plan.comparison}
    assert "CPUOffloadPolicy needs an accelerator" in rows["sharded + offload"]["note"]
    assert (
        rows["pipeline x sharded"]["predicted_step_time"] is not None
        and rows["pipeline x sharded"]["ranks"] == "dp 2 x pp 2"
    )
    # dp 2 x pp 2: a sharded stage holds P + G whole for the step and (P + G + O) / 2 at rest: as much as a
    # replica's
    assert rows["pipeline x sharded"]["peak_memory"] == pytest.approx(rows["hybrid"]["peak_memory"], rel=1e-3)


# ---------------------------------------------------------------- the plan: table, JSON, old plans
def test_comparison_table_and_json(tmp_path: Path) -> None:
    prof = _profile(4, 40 * MB)
    plan = cluster_search(prof, Cluster.describe(prof.devices, 1, intra="nvlink4"))
    assert [r["strategy"] for r in plan.comparison] == list(STRATEGIES)
    chosen = [r for r in plan.comparison if r["chosen"]]
    assert len(chosen) == 1 and chosen[0]["predicted_step_time"] == plan.predicted_step_time
    text = str(plan)
    assert "sharded, batch=64" in text.splitlines()[0]
    assert "strategies compared (* chosen; step: predicted time per step; memory: peak per device):" in text
    for name in STRATEGIES:
        assert any(line.startswith(name) for line in text.splitlines()), name
    assert "sharded *" in text and "does not fit: needs 61.34 MiB per device, budget 38.15 MiB" in text
    assert (
        "note: strategy: sharded (dp 4) is the fastest of the 7 strategies that fit; next: tensor parallel "
        "x sharded" in text
    )
    data = plan.to_dict()
    assert data["shard"] is True and "offload" not in data and len(data["comparison"]) == len(STRATEGIES)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert json.loads(path.read_text())["comparison"][1]["strategy"] == "sharded"


def test_plan_fields_validate_and_old_plans_load() -> None:
    stages = [StagePlan("cuda:0", ["a"])]
    assert Plan(stages, shard=True, offload="cpu").offload == "cpu"
    with pytest.raises(ValueError, match="needs shard=True"):
        Plan(stages, offload="cpu")
    with pytest.raises(ValueError, match="offload='nvme'"):
        Plan(stages, shard=True, offload="nvme")
    with pytest.raises(ValueError, match="shard=1"):
        Plan(stages, shard=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'comparison' must be a JSON list"):
        Plan.from_dict({"stages": [{"device": "cpu", "layers": ["a"]}], "comparison": {}})
    old = {
        "format": "torchspan.plan/1",
        "stages": [{"device": "cpu", "layers": ["a"]}],
        "microbatches": 1,
        "schedule": "gpipe",
        "recompute": "never",
        "batch_size": 8,
        "predicted_step_time": None,
        "peak_memory": {},
        "strategy": "torchspan",
        "notes": [],
    }
    loaded = Plan.from_dict(old)
    assert (loaded.shard, loaded.offload, loaded.comparison) == (False, None, [])
    assert set(loaded.to_dict()) == set(old)  # written back as it was


def test_nothing_fits_one_process_plans_offload_on_its_gpu() -> None:
    with torch.device("meta"):
        model = nn.Sequential(
            *[nn.Linear(1024, 1024) for _ in range(8)]
        )  # 32 MiB of parameters, 128 MiB with Adam
    x = torch.randn(64, 1024)
    plan = torchspan.plan(model, x, devices="a100-40gb", memory={"cuda:0": "30MiB"})
    assert plan.shard and plan.offload == "cpu" and plan.world_size == 1 and plan.stage_ranks == [[0]]
    assert all(s.total_bytes <= 30 * 2**20 for s in plan.stages)
    assert "nothing fits one process" in plan.notes[0] and "process group of one" in plan.notes[0]
    with pytest.raises(torchspan.PlanError, match="no placement"):
        torchspan.plan(model, x, devices="a100-40gb", memory={"cuda:0": "30MiB"}, host_memory="64MiB")
    fits = torchspan.plan(model, x, devices="a100-40gb")  # fits one process: a one-process plan, as before
    assert (
        not fits.shard
        and fits.world_size == 1
        and "comparison" not in fits.to_dict()
        and "shard" not in fits.to_dict()
    )


def test_a_meta_transformers_model_plans_for_a_cluster() -> None:
    """transformers' Llama calls ``.item()`` on a mask unless it is tracing (FakeTensor): on meta tensors
    alone its forward fails; the profiler runs a meta model's forward under FakeTensorMode, as the sizing pass
    does."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        use_cache=False,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (8, 16))
    plan = torchspan.plan(model, {"input_ids": ids}, devices="h100-80gb*2", nodes=2)
    assert plan.world_size == 4 and [r["strategy"] for r in plan.comparison] == list(STRATEGIES)
    assert all(p.is_meta for p in model.parameters())

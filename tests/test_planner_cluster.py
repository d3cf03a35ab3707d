"""Cluster plans (issue 13 item 4): links catalog, comm formulas, the data x pipeline search, Plan fields,
CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from planner_synth import device, layer

import torchspan
from torchspan.cli import main
from torchspan.hardware import catalog, links
from torchspan.hardware.links import Link
from torchspan.planner import Plan, StagePlan
from torchspan.planner.cluster import (
    ClusterCandidate,
    cluster_search,
    evaluate_cluster,
    even_cut,
    stage_reductions,
    world_splits,
)
from torchspan.planner.comm import (
    BUCKET_BYTES,
    allreduce_time,
    buckets,
    finish_time,
    p2p_time,
    ring_bytes,
    slowest,
)
from torchspan.planner.cost import CostModel
from torchspan.planner.topology import Cluster, layouts, replica_profile
from torchspan.profiler.costs import Profile

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "models.py"
MiB = 2**20


def _link(bw: float = 1e9, lat: float = 1e-5, eff: float = 1.0) -> Link:
    return Link("test", "test link", bw, lat, eff, "test figures")


def _profile(
    per_node: int, capacity: int | None, params: int, out: float, batch: int = 64, layers: int = 8
) -> Profile:
    """``layers`` equal layers on ``per_node`` equal GPUs; time is all per-sample (1e-4 s fwd, 2e-4 s bwd)."""
    devs = [device("cuda", "gpu", capacity, bandwidth=16e9, index=k) for k in range(per_node)]
    lays = [
        layer(f"l{k}", params=params, act=64.0, out=out, speeds=[1.0] * per_node, fixed=0.0)
        for k in range(layers)
    ]
    return Profile(layers=lays, devices=devs, batch_size=batch, input_bytes=out, optimizer="adam")


# ---------------------------------------------------------------- comm formulas
def test_allreduce_ring_bound_exact() -> None:
    link = _link(bw=1e9, lat=1e-5)
    # 2 (n-1)/n * S / bw + 2 (n-1) * latency = 1.5e-3 + 6e-5
    assert allreduce_time(1e6, 4, link) == pytest.approx(1.56e-3, rel=1e-12)
    assert allreduce_time(1e6, 2, link) == pytest.approx(1e-3 + 2e-5, rel=1e-12)
    assert allreduce_time(1e6, 1, link) == 0.0
    assert allreduce_time(0, 8, link) == 0.0
    assert ring_bytes(8.0, 2) == 8.0 and ring_bytes(8.0, 4) == 12.0
    # efficiency scales the bandwidth term only
    assert allreduce_time(1e6, 2, _link(eff=0.5)) == pytest.approx(2e-3 + 2e-5, rel=1e-12)


def test_p2p_and_slowest() -> None:
    assert p2p_time(1e6, _link(bw=1e9, lat=1e-5)) == pytest.approx(1.01e-3, rel=1e-12)
    assert p2p_time(0, _link()) == 0.0
    fast, slow = _link(bw=1e10), _link(bw=1e8)
    assert slowest([fast, slow]) is slow
    with pytest.raises(ValueError, match="nbytes=-1"):
        p2p_time(-1, fast)
    with pytest.raises(ValueError, match="n=0"):
        allreduce_time(10, 0, fast)


# ---------------------------------------------------------------- links catalog
def test_links_catalog_figures_and_nvlink_generations() -> None:
    for key in (
        "nvlink3",
        "nvlink4",
        "pcie4",
        "pcie5",
        "ib-200g",
        "ib-400g",
        "eth-25g",
        "eth-100g",
        "loopback",
    ):
        link = links.lookup(key)
        assert link.source and link.bandwidth > 0 and link.latency >= 0
    assert links.lookup("ib-400g").bandwidth == 50e9  # 400 Gb/s per direction
    assert links.lookup("eth-25g").bandwidth == 3.125e9
    assert links.lookup("nvlink", catalog.lookup("h100-80gb")).key == "nvlink4"
    assert links.lookup("nvlink", catalog.lookup("a100-40gb")).key == "nvlink3"
    assert links.lookup("gloo-cpu").key == "loopback"
    with pytest.raises(ValueError, match="pcie4"):
        links.lookup("nvlink", catalog.lookup("l4"))
    with pytest.raises(ValueError, match="ib-400g"):
        links.lookup("token-ring")
    assert links.default_intra(catalog.lookup("l4")).key == "pcie4"
    assert links.default_intra(catalog.lookup("h100-80gb")).key == "nvlink4"


# ---------------------------------------------------------------- equations and Plan fields
def test_world_equation_errors() -> None:
    with pytest.raises(ValueError, match=r"data_parallel=3 does not divide the world size.*16"):
        world_splits(16, 17, 64, data_parallel=3)
    assert world_splits(16, 17, 64) == [(16, 1), (8, 2), (4, 4), (2, 8), (1, 16)]
    assert world_splits(16, 4, 8) == [(8, 2), (4, 4)]  # dp <= batch, pp <= layers
    stages = [StagePlan("cuda:0", ["a"]), StagePlan("cuda:1", ["b"])]
    with pytest.raises(ValueError, match=r"2 \* 2 = 4 must equal nodes \* devices_per_node = 1 \* 3 = 3"):
        Plan(stages, data_parallel=2, nodes=1, devices_per_node=3, stage_ranks=[[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="every rank 0..3 exactly once"):
        Plan(stages, data_parallel=2, nodes=2, devices_per_node=2, stage_ranks=[[0, 1], [1, 3]])
    with pytest.raises(ValueError, match="needs stage_ranks"):
        Plan(stages, data_parallel=2)


def test_plan_json_round_trip_with_and_without_cluster_fields(tmp_path: Path) -> None:
    stages = [StagePlan("cuda:0", ["a"]), StagePlan("cuda:1", ["b"])]
    cluster = Plan(
        stages,
        microbatches=2,
        data_parallel=2,
        nodes=2,
        devices_per_node=2,
        stage_ranks=[[0, 1], [2, 3]],
        interconnect="ib-400g",
        intra_link="nvlink4",
        predicted_times={"compute": 1e-3, "allreduce": 2e-4, "p2p": 0.0},
    )
    assert Plan.from_json(cluster.to_json()) == cluster
    assert cluster.world_size == 4 and cluster.rank_role(2) == (1, 0) and cluster.rank_role(1) == (0, 1)
    single = Plan(stages, microbatches=2)
    assert "data_parallel" not in single.to_dict() and "stage_ranks" not in single.to_dict()
    # a plan file written before the cluster fields existed still loads
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
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = Plan.load(path)
    assert loaded.data_parallel == 1 and loaded.stage_ranks == [] and loaded.world_size == 1
    assert set(loaded.to_dict()) == set(old)  # written back with the same top-level fields


# ---------------------------------------------------------------- the search
def test_layouts_and_mesh() -> None:
    assert layouts(2, 2) == [("pipelines-in-node", [[0, 2], [1, 3]]), ("replicas-in-node", [[0, 1], [2, 3]])]
    assert layouts(1, 4) == [("pipelines-in-node", [[0], [1], [2], [3]])]
    prof = _profile(2, None, 1000, 10.0)
    mesh = Cluster.describe(prof.devices, 2, intra="nvlink4", interconnect="eth-25g")
    assert mesh.world == 4 and mesh.link([0, 1]).key == "nvlink4" and mesh.link([1, 2]).key == "eth-25g"
    mixed = [device("cuda", "gpu", None, index=0), device("cuda", "other", None, index=1)]
    with pytest.raises(ValueError, match="one kind of device per node"):
        Cluster.describe(mixed, 2)
    with pytest.raises(ValueError, match="nodes=0"):
        Cluster.describe(prof.devices, 0)


def test_evaluate_cluster_exact_for_data_parallel() -> None:
    """dp 2 x pp 1: step = the cost model's step + the ring all-reduce of all gradients."""
    prof = _profile(1, None, params=4000, out=10.0, batch=8, layers=2)
    mesh = Cluster.describe(prof.devices, 2, intra="nvlink4", interconnect="ib-400g")
    cm = CostModel(replica_profile(prof, 1, 4), 1, "1f1b", "never")
    ev = cm.evaluate(even_cut(cm, 1).stages)
    cand = evaluate_cluster(cm, ev, mesh, [[0, 1]], "pipelines-in-node")
    ib = links.lookup("ib-400g")
    host = 16e9
    assert cand.compute == pytest.approx(
        ev.step_time + 4 * 10.0 / host, rel=1e-12
    )  # + the input from the host
    assert cand.allreduce == pytest.approx(8000 / ib.effective_bandwidth + 2 * ib.latency, rel=1e-12)
    assert cand.p2p == 0.0
    assert cand.step == pytest.approx(cand.compute + cand.allreduce, rel=1e-12)


def test_picks_data_parallel_when_the_model_fits_and_the_link_is_fast() -> None:
    prof = _profile(4, None, params=1000, out=10.0)
    plan = cluster_search(prof, Cluster.describe(prof.devices, 2, intra="nvlink4", interconnect="ib-400g"))
    assert plan.data_parallel == 8 and len(plan.stages) == 1 and plan.world_size == 8
    assert sorted(r for row in plan.stage_ranks for r in row) == list(range(8))
    t = plan.predicted_times
    assert plan.predicted_step_time == pytest.approx(
        t["compute"] + t["allreduce"] + t["p2p"] + t["ties"], rel=1e-12
    )
    assert t["allreduce"] > 0


def test_picks_a_pipeline_when_the_model_does_not_fit_one_device() -> None:
    """32 MB of states, 12 MB per device: replicas do not fit; over a slow interconnect (sharding's
    all-gathers cross it every step) a 4-stage pipeline is the fastest that fits without tensor parallelism
    (tp 2 x dp 2 is predicted 3% faster: test_planner_tp), and with one replica fixed it is the plan."""
    state = 4 * 1_000_000  # params + grads + adam state per layer
    prof = _profile(2, capacity=3 * state, params=1_000_000, out=10.0)  # 8 layers: 32 MB, 12 MB per device
    plan = cluster_search(
        prof, Cluster.describe(prof.devices, 2, intra="nvlink4", interconnect="eth-25g"), tp=1
    )
    assert len(plan.stages) == 4 and plan.data_parallel == 1 and not plan.shard
    assert all(s.total_bytes <= 3 * state for s in plan.stages)
    rows = {r["strategy"]: r for r in plan.comparison}
    assert not rows["replicas"]["fits"] and rows["pipeline"]["chosen"]
    fixed = cluster_search(
        prof, Cluster.describe(prof.devices, 2, intra="nvlink4", interconnect="ib-400g"), data_parallel=1
    )
    assert len(fixed.stages) == 4 and fixed.data_parallel == 1
    with pytest.raises(torchspan.PlanError, match="no strategy fits"):
        cluster_search(
            _profile(1, capacity=state // 2, params=1_000_000, out=10.0),
            Cluster.describe(_profile(1, capacity=state // 2, params=1_000_000, out=10.0).devices, 2),
        )


def test_slow_interconnect_keeps_each_stages_replicas_on_one_node() -> None:
    """Big gradients, small activations, 25 Gb/s between nodes: all-reduce inside a node, hand over across."""
    state = 4 * 1_000_000
    prof = _profile(2, capacity=5 * state, params=1_000_000, out=10.0)  # needs 2 stages
    plan = cluster_search(
        prof, Cluster.describe(prof.devices, 2, intra="nvlink4", interconnect="eth-25g"), data_parallel=2
    )
    assert plan.data_parallel == 2 and len(plan.stages) == 2
    for row in plan.stage_ranks:
        assert len({r // 2 for r in row}) == 1  # one node per stage
    assert any("replicas-in-node" in n for n in plan.notes if n.startswith("chosen"))


def test_one_node_without_cluster_options_is_the_old_plan() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    x = torch.randn(16, 64)
    a = torchspan.plan(model, x, devices="a100-40gb*2")
    b = torchspan.plan(model, x, devices="a100-40gb*2", nodes=1)
    assert a.to_dict() == b.to_dict() and "stage_ranks" not in a.to_dict()


# ---------------------------------------------------------------- all-reduce overlapping backward
def test_buckets_and_finish_time_exact() -> None:
    assert (
        BUCKET_BYTES == 25 * MiB
    )  # DataParallelReplica(bucket_cap_mb=25.0): every bucket, the first one too
    assert buckets([4e6, 30e6, 4e6], BUCKET_BYTES) == [(1, 34e6), (2, 4e6)]  # closes once it reaches the cap
    assert buckets([1.0, 0.0, 1.0], 1.0) == [(0, 1.0), (2, 1.0)]  # 0 bytes join the open bucket
    assert buckets([0.0, 0.0], 1.0) == [(1, 0.0)] and buckets([], 1.0) == []
    # each all-reduce starts when ready and when the one before it ended
    assert finish_time([-3e-3, 0.0], [2e-3, 1e-3]) == pytest.approx(1e-3, rel=1e-12)
    assert finish_time([-3e-3, -2.5e-3], [2e-3, 1e-3]) == pytest.approx(
        0.0, abs=1e-15
    )  # queued behind the first
    assert finish_time([], []) == float("-inf")
    with pytest.raises(ValueError, match="cap=0"):
        buckets([1.0], 0)


def _dp_candidate(backward: bool, bucket: float, link: str = "eth-25g") -> tuple[ClusterCandidate, Link]:
    """dp 2 x pp 1 of 4 layers of 1 MB of gradients, 4 samples per replica; ``backward=False``: free
    backward."""
    prof = _profile(1, None, params=1_000_000, out=10.0, batch=8, layers=4)
    if not backward:
        for lay in prof.layers:
            lay.backward_per_sample = [0.0]
    mesh = Cluster.describe(prof.devices, 2, intra="nvlink4", interconnect=link)
    cm = CostModel(replica_profile(prof, 1, 4), 1, "1f1b", "never")
    return evaluate_cluster(
        cm, even_cut(cm, 1), mesh, [[0, 1]], "pipelines-in-node", bucket_bytes=bucket
    ), links.lookup(link)


def test_data_parallel_buckets_hide_behind_a_long_backward() -> None:
    """Buckets of 2 layers: the first (layers 3, 2) is all-reduced while layers 1, 0 run backward (1.6 ms)."""
    cand, eth = _dp_candidate(backward=True, bucket=2e6)
    one = allreduce_time(2e6, 2, eth)  # 0.71 ms: fits under the 1.6 ms left of backward
    assert one < 1.6e-3
    (red,) = cand.reductions
    assert red.buckets == 2 and red.link == "eth-25g"
    assert red.seconds == pytest.approx(2 * one, rel=1e-12)
    assert cand.allreduce_total == pytest.approx(2 * one, rel=1e-12)
    assert cand.allreduce == pytest.approx(one, rel=1e-12)  # only the last bucket is exposed
    assert cand.step == pytest.approx(cand.compute + one, rel=1e-12)
    # one bucket (the whole 4 MB, the runtime's 25 MiB cap): nothing to overlap, the whole all-reduce is
    # exposed
    whole, _ = _dp_candidate(backward=True, bucket=BUCKET_BYTES)
    assert whole.allreduce == pytest.approx(allreduce_time(4e6, 2, eth), rel=1e-12) == whole.allreduce_total


def test_data_parallel_all_reduce_exposed_when_backward_is_tiny() -> None:
    cand, eth = _dp_candidate(backward=False, bucket=2e6)
    assert cand.allreduce == pytest.approx(2 * allreduce_time(2e6, 2, eth), rel=1e-12) == cand.allreduce_total
    # a bucket larger than the backward can hide: exposed is what sticks out, at least the last bucket
    slow, eth = _dp_candidate(backward=True, bucket=1e6, link="eth-25g")
    parts = [allreduce_time(1e6, 2, eth)] * 4
    assert slow.allreduce >= parts[-1]
    assert slow.allreduce == pytest.approx(finish_time([-2.4e-3, -1.6e-3, -0.8e-3, 0.0], parts), rel=1e-9)


@pytest.mark.parametrize("recompute", ["never", "always"])
def test_pipeline_later_stages_hide_their_reduction_behind_earlier_backward(recompute: str) -> None:
    """dp 2 x pp 2: stage 1 ends its last backward Bw_0 (+ F_0 recomputed) + one hand-over before stage 0."""
    prof = _profile(2, None, params=4_000_000, out=1e5, batch=8, layers=4)
    mesh = Cluster.describe(prof.devices, 2, intra="pcie4", interconnect="eth-25g")
    cm = CostModel(replica_profile(prof, 2, 4), 2, "1f1b", recompute)
    ev = even_cut(cm, 2)
    ranks = [[0, 1], [2, 3]]  # each stage's replicas on one node (pcie4); hand-overs cross nodes
    cand = evaluate_cluster(cm, ev, mesh, ranks, "replicas-in-node")
    pcie, eth = links.lookup("pcie4"), links.lookup("eth-25g")
    ar = allreduce_time(8e6, 2, pcie)
    lead = ev.backward[0] + (ev.forward[0] if recompute == "always" else 0.0) + p2p_time(2 * 1e5, eth)
    r0, r1 = cand.reductions
    assert r0.buckets == r1.buckets == 1 and r0.seconds == pytest.approx(ar, rel=1e-12)
    assert r0.end == pytest.approx(ar, rel=1e-12)  # stage 0 finishes last: all of its reduction is exposed
    assert r1.end == pytest.approx(ar - lead, rel=1e-9) and r1.end < r0.end
    assert cand.allreduce == pytest.approx(ar, rel=1e-12) == cand.allreduce_total
    again = stage_reductions(cm, ev, mesh, ranks, [p2p_time(2 * 1e5, eth)])
    assert list(cand.reductions) == again


def test_overlap_makes_data_parallel_the_choice() -> None:
    """800 MB of gradients: all-reduced after backward (one bucket) a 2-stage pipeline wins; in 25 MiB
    buckets during backward, data parallel does."""
    prof = _profile(2, None, params=100_000_000, out=1e4, batch=64)
    mesh = Cluster.describe(prof.devices, 1, intra="nvlink4")
    after = cluster_search(prof, mesh, bucket_bytes=float("inf"))
    assert (
        after.shard or after.data_parallel == 1
    )  # not replicas: sharding or a 2-stage pipeline overlaps its traffic
    rows = {r["strategy"]: r for r in after.comparison}
    assert rows["replicas"]["fits"] and rows["replicas"]["predicted_step_time"] > after.predicted_step_time
    plan = cluster_search(prof, mesh)
    assert plan.data_parallel == 2 and len(plan.stages) == 1
    t = plan.predicted_times
    assert 0 < t["allreduce"] < t["allreduce_total"]
    assert plan.predicted_step_time == pytest.approx(
        t["compute"] + t["allreduce"] + t["p2p"] + t["ties"], rel=1e-12
    )
    assert any("8 bucket(s)" in n for n in plan.notes) and any("exposed" in n for n in plan.notes)
    assert "allreduce_total" in str(plan)  # the printed step split: exposed and total


# ---------------------------------------------------------------- CLI
def test_cli_prints_a_two_node_plan(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", f"{EXAMPLES}:mlp", "--input-shape", "64,1024", "--nodes", "2", "--devices", "h100-80gb*8"]
    assert main([*argv, "--interconnect", "ib-400g"]) == 0
    out = capsys.readouterr().out
    assert "cluster: 2 node(s) x 8 device(s) = 16 ranks = data parallel" in out
    assert "step split: compute" in out and "allreduce" in out and "p2p" in out
    assert "note: chosen: dp" in out and "memory per stage" in out
    assert main([*argv, "--interconnect", "eth-25g", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = Plan.from_dict(data)
    assert plan.nodes == 2 and plan.devices_per_node == 8 and plan.data_parallel * len(plan.stages) == 16
    assert plan.interconnect == "eth-25g" and plan.intra_link == "nvlink4"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--nodes", "0"], "--nodes '0' must be an integer >= 1"),
        (["--nodes", "2", "--interconnect", "carrier-pigeon"], "--interconnect 'carrier-pigeon'"),
        (["--interconnect", "ib-400g"], "add --nodes N"),
        (["--nodes", "2", "--data-parallel", "3"], "data_parallel=3 does not divide the world size"),
    ],
)
def test_cli_cluster_option_errors(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", f"{EXAMPLES}:mlp", "--input-shape", "8,1024", "--devices", "h100-80gb*2", *extra]
    assert main(argv) != 0
    assert message in capsys.readouterr().err


def test_data_parallel_plans_run_as_the_replica_runs_one_batch_per_shard() -> None:
    """A one-stage plan is run by DataParallelReplica, which refuses micro-batches and recompute: the search
    gives every data-parallel plan microbatches=1 and recompute='never', and with micro-batches fixed by the
    caller it leaves data parallel out, saying why."""
    for prof, mesh in [
        (_profile(4, None, params=1000, out=10.0), None),
        (_profile(2, None, params=100_000_000, out=1e4, batch=64), "one-node"),
    ]:
        m = Cluster.describe(
            prof.devices,
            2 if mesh is None else 1,
            intra="nvlink4",
            interconnect="ib-400g" if mesh is None else None,
        )
        plan = cluster_search(prof, m)
        assert len(plan.stages) == 1 and plan.data_parallel > 1
        assert plan.microbatches == 1 and plan.recompute == "never", (plan.microbatches, plan.recompute)
    prof = _profile(4, None, params=1000, out=10.0)
    fixed = cluster_search(
        prof, Cluster.describe(prof.devices, 2, intra="nvlink4", interconnect="ib-400g"), microbatches=4
    )
    assert len(fixed.stages) > 1
    assert any("a data-parallel replica runs its shard as one batch" in n for n in fixed.notes), fixed.notes

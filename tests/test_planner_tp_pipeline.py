"""The planner weighs tensor parallel x pipeline (issue 33 item 4): ``pp`` stages each split over ``tp`` ranks
of a node, ``dp`` replicas (``planner.tppipeline``), priced by hand on a small described node; the 70B
comparison on 4 nodes of 8 H100s has its row, chooses it and says why; ``span(model, plan)`` of such a plan in
one process names the job it needs."""

from __future__ import annotations

import pytest
from planner_synth import device, layer
from test_planner_tp import _llama, _rows, llama_70b

import torchspan
from torchspan.hardware.links import lookup
from torchspan.planner import Plan, StagePlan
from torchspan.planner.cluster import cluster_search
from torchspan.planner.physical import host_bandwidth
from torchspan.planner.strategies import STRATEGIES, TP, TPP
from torchspan.planner.topology import Cluster
from torchspan.planner.tppipeline import tp_pipeline_ranks, tp_pipeline_splits
from torchspan.profiler.costs import Profile

GB = 10**9


def _node(n: int = 4) -> list:
    return [device("cuda", "gpu", 80 * GB, bandwidth=50e9, index=k) for k in range(n)]


def test_tp_x_pp_priced_by_hand_on_a_described_node() -> None:
    """4 alike layers on one node of 4 devices, tp 2 x pp 2 (data_parallel=1, tp=2 fixed), 2 micro-batches of
    4 samples, GPipe: every number of the row worked out from the layers, the links and the formulas."""
    devs = _node()
    lays = [layer(f"l{k}", params=4000, act=3e6, out=2e5, speeds=[1.0] * 4) for k in range(4)]
    prof = Profile(layers=lays, devices=devs, batch_size=8, input_bytes=1e3, optimizer="adam")
    cluster = Cluster.describe(devs, 1, intra="nvlink4")
    plan = cluster_search(
        prof, cluster, microbatches=2, schedule="gpipe", recompute="never", data_parallel=1, tp=2
    )
    row = _rows(plan)[TPP]
    assert row["chosen"] and row["ranks"] == "tp 2 x pp 2" and row["tp"] == 2 and row["stages"] == 2
    assert (plan.tp, plan.data_parallel, len(plan.stages), plan.balance) == (2, 1, 2, [2, 2])
    assert plan.stage_ranks == [[0, 1], [2, 3]] == tp_pipeline_ranks(2, 1, 2)
    assert _rows(plan)[TP]["note"].startswith("not possible: a tensor-parallel replica runs its rows as one")

    tp, m, M = 2, 4, 2  # each micro-batch: 4 samples through 2 stages of 2 layers, each split over 2 ranks
    nv = lookup("nvlink4")
    bw = nv.bandwidth * nv.efficiency
    ar = 2 * (tp - 1) / tp * m * 2e5 / bw + 2 * (tp - 1) * nv.latency  # one all-reduce of a layer's output
    f, bwd = 1e-5 + m * 1e-4 / tp, 1e-5 + m * 2e-4 / tp  # one split layer's forward and backward, no comm
    stage = 2 * (f + bwd)  # both stages alike
    c_in = m * 1e3 / host_bandwidth(devs[0])
    compute = 2 * stage + c_in + (M - 1) * stage  # GPipe: fill and drain, then M - 1 bottlenecks
    with_ar = 2 * (stage + 2 * 4 * ar) + c_in + (M - 1) * (stage + 2 * 4 * ar)  # 4 all-reduces per layer
    hand = 2 * (nv.latency + m * 2e5 / bw)  # activation forward, its gradient back: one boundary
    p2p = hand  # on the path once (the fill); later ones hide under the bottleneck stage
    t = plan.predicted_times
    assert t["compute"] == pytest.approx(compute, rel=1e-9)
    assert t["tp_allreduce"] == pytest.approx(with_ar - compute, rel=1e-9)
    assert t["tp_allreduce"] == pytest.approx((2 + M - 1) * 8 * ar, rel=1e-9)  # bubble included
    assert t["p2p"] == pytest.approx(p2p, rel=1e-9)
    assert t["collectives"] == 0.0  # one replica: no gradient all-reduce
    assert plan.predicted_step_time == pytest.approx(compute + (with_ar - compute) + p2p, rel=1e-12)

    # memory: a rank holds its 2 layers' states / tp; GPipe keeps both micro-batches' activations, a split
    # layer saving 4 outputs whole and 1/tp of the rest
    first = plan.stages[0]
    assert (first.param_bytes, first.grad_bytes, first.optimizer_bytes) == (2 * 2000, 2 * 2000, 2 * 4000)
    whole = 4 * 2e5
    assert first.activation_bytes == pytest.approx(M * m * 2 * (whole + (3e6 - whole) / tp), rel=1e-9)
    notes = "\n".join(plan.notes)
    assert "span(model, tp=2, balance=[2, 2])" in notes and "mesh pp x dp_replicate x tp" in notes
    assert "4 per block and micro-batch" in notes and "bubble included" in notes


def test_splits_keep_tp_in_a_node_and_fill_the_world() -> None:
    assert tp_pipeline_splits(32, 8, 83, 8) == [
        (2, 2, 8),
        (2, 4, 4),
        (2, 8, 2),
        (2, 16, 1),
        (4, 2, 4),
        (4, 4, 2),
        (4, 8, 1),
        (8, 2, 2),
        (8, 4, 1),
    ]
    assert tp_pipeline_splits(8, 4, 3, 1) == [(4, 2, 1)]  # dp <= a batch of 1, pp <= 3 layers
    assert tp_pipeline_splits(16, 8, 10, 64, tp=8, data_parallel=1) == [(8, 2, 1)]
    assert tp_pipeline_splits(4, 1, 10, 8) == []


def test_70b_on_four_nodes_weighs_and_chooses_tp_8_x_pp_4() -> None:
    """Llama-2-70B, 8 x 2048 tokens on 4 nodes of 8 H100s: tp 8 within each node, 4 stages across the nodes,
    8 micro-batches: no FSDP2 traffic over InfiniBand, a bubble of 3 / 11, 35 GiB per rank. Predicted
    faster than tp 8 x dp 4 (sharded over the nodes) by more than the 2% margin, and said so."""
    prof = llama_70b(8)
    plan = cluster_search(prof, Cluster.describe(prof.devices, 4, interconnect="ib-400g"))
    rows = _rows(plan)
    assert [r["strategy"] for r in plan.comparison] == list(STRATEGIES) and STRATEGIES[-1] == TPP
    row, other = rows[TPP], rows[TP]
    assert row["chosen"] and row["ranks"] == "tp 8 x pp 4" and other["fits"]
    assert row["predicted_step_time"] < 0.98 * other["predicted_step_time"]
    assert (plan.tp, plan.data_parallel, len(plan.stages), plan.world_size, plan.shard) == (
        8,
        1,
        4,
        32,
        False,
    )
    assert plan.stage_ranks == tp_pipeline_ranks(4, 1, 8) and plan.microbatches == 8
    assert sum(plan.balance) == len(prof.layers) and plan.rank_role(13) == (1, 0)
    t = plan.predicted_times
    assert plan.predicted_step_time == pytest.approx(
        t["compute"] + t["tp_allreduce"] + t["p2p"] + t["collectives"] + t["ties"], rel=1e-12
    )
    assert 0 < t["tp_allreduce"] < 0.4 * t["compute"] and row["peak_memory"] < 40 * 2**30
    notes = "\n".join(plan.notes)
    assert (
        "strategy: tensor parallel x pipeline (tp 8 x pp 4) is the fastest of the 5 strategies that fit; "
        "tp 8 divides each block's compute" in notes
    )
    assert "next: tensor parallel x sharded" in notes
    assert f"span(model, tp=8, balance={plan.balance})" in notes
    text = str(plan)
    assert "tensor parallel x pipeline *  tp 8 x pp 4" in text
    loaded = Plan.from_json(plan.to_json())
    assert loaded == plan and loaded.tp == 8 and len(loaded.stages) == 4


def test_span_of_a_tp_x_pp_plan_in_one_process_names_the_job() -> None:
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    two = Plan(
        [StagePlan("cpu", ["0"]), StagePlan("cpu", ["1"])],
        data_parallel=1,
        nodes=1,
        devices_per_node=4,
        stage_ranks=[[0, 1], [2, 3]],
        tp=2,
    )
    with pytest.raises(ValueError, match=r"pp 2 x dp 1 x tp 2 \(4 processes\); WORLD_SIZE is 1: run span"):
        torchspan.span(model, two)
    with pytest.raises(ValueError, match=r"span\(model, plan, tp=4\): plan.tp=2 with 2 stages"):
        torchspan.span(model, two, tp=4)
    apart = Plan(
        [StagePlan("cpu", ["0"]), StagePlan("cpu", ["1"])],
        data_parallel=1,
        nodes=1,
        devices_per_node=4,
        stage_ranks=[[0, 2], [1, 3]],
        tp=2,
    )
    with pytest.raises(ValueError, match=r"runs the mesh pp x dp_replicate x tp, tp innermost"):
        torchspan.span(model, apart)


def test_a_world_no_dp_x_pp_split_fills_is_planned_by_tensor_parallel() -> None:
    """32 ranks, a batch of 2, 10 layers: no dp x pp split exists (pp <= 10 needs dp >= 4 > 2), and the
    search used to stop there; tp 8 x pp 4 fills the world. Without tensor parallel (``tp=1``) the error
    still names why no split exists."""
    prof = _llama(8192, 28672, 64, 8, 6, 2)
    cluster = Cluster.describe(prof.devices, 4, interconnect="ib-400g")
    plan = cluster_search(prof, cluster)
    rows = _rows(plan)
    assert (plan.tp, plan.data_parallel, len(plan.stages), plan.world_size) == (8, 1, 4, 32)
    assert rows[TPP]["chosen"] and "32 stages for 10 layers" in rows["pipeline"]["note"]
    with pytest.raises(ValueError, match=r"no data x pipeline split of 32 ranks fits: .*batch \(2\)"):
        cluster_search(prof, cluster, tp=1)

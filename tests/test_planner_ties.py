"""The planner charges a tied parameter split across stages as the runtime pays it (``planner.ties``):
per-micro-batch copies in one process (``CostModel``), a per-step all-reduce in its own group across
ranks (``cluster``); keeping a tie on one stage costs nothing, and the search weighs the two."""

from __future__ import annotations

import pytest
from planner_synth import brute_force, device, layer

from torchspan.hardware.links import Link
from torchspan.planner.cluster import evaluate_cluster
from torchspan.planner.comm import allreduce_time
from torchspan.planner.cost import CostModel
from torchspan.planner.optimize import search
from torchspan.planner.stages import Stage
from torchspan.planner.ties import TieCost
from torchspan.planner.topology import Cluster
from torchspan.profiler.costs import Profile

BW = 1e9  # host link of each GPU, bytes/s
TIE = TieCost("embed.weight", (0, 3), 1_000_000)  # 1 ms each way at BW


def _profile(layers: int = 4, batch: int = 8, params: int = 2_000_000) -> Profile:
    devs = [device("cuda", "gpu", None, bandwidth=BW, index=k) for k in range(2)]
    lays = [
        layer(f"l{k}", params=params, act=0.0, out=0.0, speeds=[1.0, 1.0], fixed=0.0) for k in range(layers)
    ]
    return Profile(layers=lays, devices=devs, batch_size=batch, input_bytes=0.0, optimizer="sgd")


def test_split_tie_charges_a_copy_each_way_per_microbatch_on_the_remote_stage() -> None:
    prof = _profile()
    stages = [Stage(0, 0, 2), Stage(1, 2, 4)]
    for recompute, lat_copies, steady_copies in (("never", 2, 2), ("except_last", 2, 3), ("always", 3, 3)):
        plain = CostModel(prof, 4, "gpipe", recompute).evaluate(stages)
        tied = CostModel(prof, 4, "gpipe", recompute, ties=[TIE]).evaluate(stages)
        t = TIE.nbytes / BW
        assert tied.ties == pytest.approx((0.0, steady_copies * t), rel=1e-12)
        assert tied.latency_sum == pytest.approx(plain.latency_sum + lat_copies * t, rel=1e-12)
        # equal stages: the remote one becomes the bottleneck by its copies
        assert tied.bottleneck == pytest.approx(plain.bottleneck + steady_copies * t, rel=1e-12)
        assert tied.step_time == pytest.approx(
            plain.step_time + lat_copies * t + 3 * steady_copies * t, rel=1e-12
        )


def test_plan_states_the_charge_per_step() -> None:
    prof = _profile()
    cm = CostModel(prof, 4, "gpipe", "never", ties=[TIE])
    ev = cm.evaluate([Stage(0, 0, 2), Stage(1, 2, 4)])
    plan = cm.to_plan(ev, "test")
    (tie,) = plan.ties
    charged = 4 * 2 * TIE.nbytes / BW  # 4 micro-batches, 2 ms each on the bottleneck stage
    assert (
        tie["stages"] == [0, 1]
        and tie["layers"] == ["l0", "l3"]
        and tie["seconds"] == pytest.approx(charged, rel=1e-9)
    )
    assert "tie: embed.weight (976.56 KiB) shared by l0 (stage 0), l3 (stage 1): split, copied" in str(plan)
    assert "+8.000 ms per step" in str(plan)
    assert any("+8.000 ms per step" in n and n.startswith("tied parameter embed.weight") for n in plan.notes)


def test_tie_on_one_stage_or_one_device_costs_nothing() -> None:
    prof = _profile()
    cm = CostModel(prof, 4, "gpipe", "never", ties=[TIE])
    plain = CostModel(prof, 4, "gpipe", "never")
    for stages in ([Stage(0, 0, 4)], [Stage(0, 0, 2), Stage(0, 2, 4)]):
        ev = cm.evaluate(stages)
        assert ev.step_time == plain.evaluate(stages).step_time and not any(ev.ties)
    plan = cm.to_plan(cm.evaluate([Stage(0, 0, 4)]), "test")
    assert plan.ties == [{"name": "embed.weight", "layers": ["l0", "l3"], "stages": [0], "bytes": TIE.nbytes}]
    assert "split" not in str(plan)
    # a tie inside one stage of a two-stage cut
    inner = TieCost("w", (0, 1), TIE.nbytes)
    stages = [Stage(0, 0, 2), Stage(1, 2, 4)]
    assert (
        CostModel(prof, 4, "gpipe", "never", ties=[inner]).evaluate(stages).step_time
        == plain.evaluate(stages).step_time
    )


def test_charging_the_tie_changes_the_cut() -> None:
    prof = _profile(layers=4, params=1000)
    tie = TieCost("w", (1, 2), 4_000_000)  # 4 ms each way: more than the imbalance of cutting elsewhere
    blind = search(prof, microbatches=2, schedule="gpipe", recompute="never")
    assert [len(s.layers) for s in blind.stages] == [2, 2]  # balanced: between l1 and l2, splitting the tie
    charged = search(prof, microbatches=2, schedule="gpipe", recompute="never", ties=[tie])
    assert charged.stage_of("l1") == charged.stage_of("l2")
    assert [t["stages"] for t in charged.ties] == [
        [charged.stage_of("l1")]
    ] and "seconds" not in charged.ties[0]
    cm = CostModel(prof, 2, "gpipe", "never", ties=[tie])
    split = cm.evaluate(cm.stages_for(blind)).step_time
    assert charged.predicted_step_time < split
    best = brute_force(cm)  # every placement, ties charged
    assert best is not None and charged.predicted_step_time == pytest.approx(best.step_time, rel=1e-9)


def test_a_cheap_tie_stays_split_and_is_charged() -> None:
    prof = _profile(layers=4, params=1000)
    tie = TieCost("w", (1, 2), 1000)  # 1 us each way
    plan = search(prof, microbatches=2, schedule="gpipe", recompute="never", ties=[tie])
    assert [len(s.layers) for s in plan.stages] == [2, 2]
    (entry,) = plan.ties
    assert entry["stages"] == [0, 1] and entry["seconds"] == pytest.approx(2 * 2 * 1000 / BW, rel=1e-9)


def _mesh(per_node: int) -> Cluster:
    link = Link("test", "test link", BW, 1e-5, 1.0, "test figures")
    return Cluster(1, per_node, device("cuda", "gpu", None, bandwidth=BW), link, link)


def test_cluster_charges_the_tie_groups_allreduce() -> None:
    prof = _profile()
    cm = CostModel(prof, 2, "gpipe", "never")
    ev = cm.evaluate([Stage(0, 0, 2), Stage(1, 2, 4)])
    mesh = _mesh(2)
    plain = evaluate_cluster(cm, ev, mesh, [[0], [1]], "pipelines-in-node")
    tied = evaluate_cluster(cm, ev, mesh, [[0], [1]], "pipelines-in-node", ties=[TIE])
    seconds = 2 * (2 - 1) / 2 * TIE.nbytes / BW + 2 * 1e-5  # ring over the 2 ranks
    ((tie, ranks, red),) = tied.tie_reductions
    assert tie is TIE and ranks == 2 and red.seconds == pytest.approx(seconds, rel=1e-12)
    # it starts once stage 0 (the home, the last to finish backward) joins: exposed in full
    assert red.end == pytest.approx(seconds, rel=1e-12) and tied.ties == pytest.approx(seconds, rel=1e-12)
    assert tied.step == pytest.approx(plain.step + seconds, rel=1e-12)
    assert tied.step == pytest.approx(tied.compute + tied.p2p + tied.allreduce + tied.ties, rel=1e-12)


def test_cluster_tie_leaves_the_home_stage_allreduce_and_spans_every_replica() -> None:
    prof = _profile()
    cm = CostModel(prof, 2, "gpipe", "never")
    ev = cm.evaluate([Stage(0, 0, 2), Stage(1, 2, 4)])
    mesh = _mesh(4)
    ranks = [[0, 1], [2, 3]]
    plain = evaluate_cluster(cm, ev, mesh, ranks, "replicas-in-node")
    tied = evaluate_cluster(cm, ev, mesh, ranks, "replicas-in-node", ties=[TIE])
    link = mesh.intra
    assert plain.reductions[0].seconds == pytest.approx(allreduce_time(4e6, 2, link), rel=1e-12)
    assert tied.reductions[0].seconds == pytest.approx(allreduce_time(3e6, 2, link), rel=1e-12)
    assert tied.reductions[1].seconds == plain.reductions[1].seconds
    ((_, n, red),) = tied.tie_reductions
    assert n == 4 and red.seconds == pytest.approx(allreduce_time(1e6, 4, link), rel=1e-12)
    assert tied.ties == pytest.approx(max(tied.allreduce, red.end) - tied.allreduce, rel=1e-12)
    # a tie inside one stage is reduced with that stage: nothing changes
    inner = evaluate_cluster(cm, ev, mesh, ranks, "replicas-in-node", ties=[TieCost("w", (0, 1), 10**6)])
    assert inner.step == plain.step and inner.tie_reductions == () and inner.ties == 0.0


def test_cluster_plan_splits_its_step_with_ties() -> None:
    from torchspan.planner.cluster import cluster_search

    plan = cluster_search(
        _profile(), _mesh(2), data_parallel=1, microbatches=2, schedule="gpipe", recompute="never", ties=[TIE]
    )
    t = plan.predicted_times
    assert plan.predicted_step_time == pytest.approx(
        t["compute"] + t["allreduce"] + t["p2p"] + t["ties"], rel=1e-12
    )
    (entry,) = plan.ties
    assert (
        entry["stages"] == [0, 1]
        and entry["seconds"] == pytest.approx(1e-3 + 2e-5, rel=1e-12)
        and t["ties"] > 0
    )
    assert "all-reduced every step over 2 ranks" in str(plan) and "ties 1.02 ms" in str(plan)

"""The planner prices tensor parallelism (issue 33 item 4): ``tensor parallel x sharded`` in the cluster
comparison, its time and memory by ``planner.tensorparallel``'s formulas (checked by hand), chosen where it is
predicted fastest and fits (a 70B-shaped Llama on 4 nodes of 8 H100s; wide layers only it fits), not where
replicas or pipelines win or it does not fit, ``Plan.tp`` (JSON), ``--tp`` and ``span(model, plan)`` in one
process naming the launched job it needs."""

from __future__ import annotations

import dataclasses
import json
import math
from functools import cache
from pathlib import Path

import pytest
import torch
from planner_synth import device, layer
from torch import nn

import torchspan
from torchspan.cli import main
from torchspan.hardware import devices
from torchspan.hardware.links import lookup
from torchspan.planner import Plan, StagePlan
from torchspan.planner.cluster import cluster_search
from torchspan.planner.physical import host_bandwidth
from torchspan.planner.strategies import STRATEGIES, TP
from torchspan.planner.tensorparallel import WHOLE_OUTPUTS, split_layers, tp_degrees
from torchspan.planner.topology import Cluster
from torchspan.profiler.costs import Profile

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "models.py"
GB = 10**9


@cache
def _llama(hidden: int, mlp: int, heads: int, kv: int, blocks: int, batch: int, seq: int = 2048) -> Profile:
    """A FLOP-estimated profile (bfloat16, Adam) of a Llama of these shapes on one node of 8 described H100s:
    a 2-block model built on meta and profiled, its second block repeated up to ``blocks`` (all alike)."""
    transformers = pytest.importorskip("transformers")
    from torchspan.profiler.measure import profile

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        use_cache=False,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 32000, (batch, seq))
    prof = profile(model, {"input_ids": ids}, devices("h100-80gb*8"), optimizer="adam", dtype=torch.bfloat16)
    at = [lay.name for lay in prof.layers].index("model.layers.0")
    first, other = prof.layers[at], prof.layers[at + 1]
    body = [first] + [dataclasses.replace(other, name=f"model.layers.{k}") for k in range(1, blocks)]
    return dataclasses.replace(prof, layers=prof.layers[:at] + body + prof.layers[at + 2 :])


def llama_70b(batch: int) -> Profile:
    """Llama-2-70B's shapes: 80 blocks, hidden 8192, MLP 28672, 64 heads, 8 KV heads; ``batch`` x 2048
    tokens."""
    return _llama(8192, 28672, 64, 8, 80, batch)


def _rows(plan: Plan) -> dict[str, dict]:
    return {r["strategy"]: r for r in plan.comparison}


# ---------------------------------------------------------------- where tensor parallelism wins
def test_70b_on_four_nodes_tp_8_is_chosen_and_its_row_follows_from_the_formulas() -> None:
    prof = llama_70b(8)
    cluster = Cluster.describe(prof.devices, 4, interconnect="ib-400g")
    # 4 replicas fixed: tp 8 x pp 4 (one replica) is faster (tests/test_planner_tp_pipeline.py)
    plan = cluster_search(prof, cluster, data_parallel=4)
    rows = _rows(plan)
    assert [r["strategy"] for r in plan.comparison] == list(STRATEGIES) and TP in STRATEGIES
    row = rows[TP]
    # 8 samples on 32 ranks: no replicas, no sharding; a pipeline of one sample per replica idles its stages
    assert "not possible" in rows["sharded"]["note"] and rows["hybrid"]["fits"]
    assert row["chosen"] and row["fits"] and row["ranks"] == "tp 8 x dp 4" and row["tp"] == 8
    assert (plan.tp, plan.data_parallel, plan.world_size, plan.shard, len(plan.stages)) == (8, 4, 32, True, 1)
    assert plan.stage_ranks == [list(range(32))] and plan.rank_role(13) == (0, 1)  # replica 1: ranks 8-15
    assert row["predicted_step_time"] < 0.5 * rows["hybrid"]["predicted_step_time"]

    # by hand: each of the 4 replicas runs b = 2 samples; tp 8 splits the 80 blocks
    b, tp, dp = 2, 8, 4
    lays = prof.layers
    split = split_layers(prof)
    assert sum(split) == 80 and not any(
        s for lay, s in zip(lays, split) if not lay.name.startswith("model.layers.")
    )
    nvlink, ib = lookup("nvlink4"), lookup("ib-400g")
    assert cluster.intra.key == "nvlink4"

    def ar(nbytes: float) -> float:  # ring all-reduce over the tp ranks of a node
        return (
            2 * (tp - 1) / tp * nbytes / (nvlink.bandwidth * nvlink.efficiency)
            + 2 * (tp - 1) * nvlink.latency
        )

    out = [lay.output_fixed_bytes + b * lay.output_bytes for lay in lays]
    tp_comm = sum(4 * ar(o) for o, s in zip(out, split) if s)
    compute = b * prof.input_bytes / host_bandwidth(prof.devices[0]) + sum(
        lay.forward_fixed[0]
        + lay.backward_fixed[0]
        + b * (lay.forward_per_sample[0] + lay.backward_per_sample[0]) / (tp if s else 1)
        for lay, s in zip(lays, split)
    )
    t = plan.predicted_times
    assert t["tp_allreduce"] == pytest.approx(tp_comm, rel=1e-9)
    assert t["compute"] == pytest.approx(compute, rel=1e-9)
    local = [math.ceil(lay.param_bytes / tp) if s else lay.param_bytes for lay, s in zip(lays, split)]
    gathers = sum(
        2 * ((dp - 1) / dp * p / (ib.bandwidth * ib.efficiency) + (dp - 1) * ib.latency) for p in local if p
    )
    assert t["allgather_total"] == pytest.approx(
        gathers, rel=1e-9
    )  # FSDP2 over dp_shard, across nodes, twice a step
    assert 0 < t["collectives"] < t["allgather_total"] + t["reduce_scatter_total"]
    assert plan.predicted_step_time == pytest.approx(
        t["compute"] + t["tp_allreduce"] + t["collectives"], rel=1e-12
    )
    assert row["predicted_step_time"] == plan.predicted_step_time
    # 4 all-reduces per block of its output (2 x 2048 x 8192 bfloat16 = 64 MiB) over NVLink, about 1.6 ms each
    assert out[[lay.name for lay in lays].index("model.layers.5")] == 2 * 2048 * 8192 * 2
    assert 0.1 < tp_comm < 0.15

    # memory: states / (tp * dp), the gathered units and unsharded gradients of the 1/tp shards, 2 samples'
    # activations
    def per_rank(kind: str) -> list[int]:
        return [
            math.ceil(getattr(lay, kind) / tp) if s else getattr(lay, kind) for lay, s in zip(lays, split)
        ]

    grads = per_rank("grad_bytes")
    states = sum(math.ceil(sum(per_rank(k)) / dp) for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
    near = [0, *local, 0]
    gathered = max(2 * near[k] + max(near[k - 1], near[k + 1]) for k in range(1, len(near) - 1))
    acts = 0.0
    for lay, s in zip(lays, split):
        whole = min(lay.activation_bytes, WHOLE_OUTPUTS * lay.output_bytes) if s else lay.activation_bytes
        acts += lay.activation_fixed_bytes + b * (whole + (lay.activation_bytes - whole) / (tp if s else 1))
    acts += out[-1]  # the loss's saved input: the logits, whole on every rank
    work = b * prof.input_bytes + 2 * max(out)
    buffers = sum(lay.buffer_bytes for lay in lays)
    hand = states + gathered + max(grads) + buffers + acts + work
    assert row["peak_memory"] == pytest.approx(hand, abs=8)
    assert 45 * 2**30 < row["peak_memory"] < 60 * 2**30  # 53 GiB: 17.5 GB of states, 37 GB of activations

    notes = "\n".join(plan.notes)
    assert (
        "tensor parallel x sharded (tp 8 x dp 4) is the fastest of the 4 strategies that fit; tp 8 divides"
        in notes
    )
    assert "span(model, tp=8, shard=True)" in notes and "not overlapped with compute" in notes
    assert "whole on every rank of a replica: model.embed_tokens, model.norm, lm_head" in notes
    text = str(plan)
    assert "tensor parallel x sharded *  tp 8 x dp 4" in text and "x tensor parallel 8;" in text
    loaded = Plan.from_json(plan.to_json())
    assert loaded == plan and loaded.tp == 8 and plan.to_dict()["tp"] == 8


def test_only_tensor_parallelism_fits_layers_too_wide_to_gather() -> None:
    """Two layers of 32 GB of parameters (128 GB with gradients and Adam) on one node of 8 80-GB devices: a
    sharded replica gathers a whole layer (and prefetches the next), a pipeline stage holds one whole; tp 8
    holds 1/8 of each (and tp 4 x pp 2 a quarter of one)."""
    devs = [device("cuda", "gpu", 80 * GB, bandwidth=50e9, index=k, memory_bandwidth=3e12) for k in range(8)]
    lays = [layer(f"l{k}", params=32 * GB, act=1e6, out=1e5, speeds=[1.0] * 8) for k in range(2)]
    prof = Profile(layers=lays, devices=devs, batch_size=8, input_bytes=1e5, optimizer="adam")
    plan = cluster_search(prof, Cluster.describe(devs, 1, intra="nvlink4"), host_memory=GB)
    rows = _rows(plan)
    assert [name for name, r in rows.items() if r["fits"]] == [TP, "tensor parallel x pipeline"]
    assert rows[TP]["chosen"]  # tp 4 x pp 2 holds as much per rank and idles in its bubble
    assert "needs" in rows["sharded"]["note"] and "needs" in rows["pipeline x sharded"]["note"]
    assert (plan.tp, plan.data_parallel, plan.shard, plan.world_size) == (8, 1, False, 8)
    assert (
        rows[TP]["ranks"] == "tp 8" and plan.predicted_times["collectives"] == 0.0
    )  # one replica: nothing to sync
    assert rows[TP]["peak_memory"] < 80 * GB < rows["pipeline x sharded"]["peak_memory"]
    assert "span(model, tp=8)" in "\n".join(plan.notes)


# ---------------------------------------------------------------- where it loses
def test_a_small_model_on_one_node_keeps_its_replicas() -> None:
    """A 1B Llama fits every device whole: replicas run the same compute as tp 2 x dp 4 without its
    all-reduces."""
    prof = _llama(2048, 5632, 16, 16, 22, 32)
    plan = cluster_search(prof, Cluster.describe(prof.devices, 1))
    rows = _rows(plan)
    assert rows["replicas"]["chosen"] and plan.tp == 1 and "tp" not in plan.to_dict()
    assert rows[TP]["fits"] and rows[TP]["predicted_step_time"] > 1.1 * plan.predicted_step_time
    assert rows[TP]["note"].startswith("fits, +")


def test_70b_with_a_large_batch_does_not_fit_tensor_parallel() -> None:
    """64 samples on 32 ranks: each tp rank of 16 replicas holds 4 samples' activations (recompute is not
    offered with a replica); pipelines of tensor-parallel stages (tp 4 x pp 4 x dp 2) fit and are the plan,
    ahead of a hybrid of 2 replicas x 16 stages."""
    prof = llama_70b(64)
    plan = cluster_search(prof, Cluster.describe(prof.devices, 4, interconnect="ib-400g"))
    rows = _rows(plan)
    assert not rows[TP]["fits"] and rows[TP]["note"].startswith("does not fit: needs")
    assert rows[TP]["predicted_step_time"] < plan.predicted_step_time  # faster, but over budget: said so
    assert "faster but over budget: " in next(n for n in plan.notes if n.startswith("strategy:"))
    assert rows["tensor parallel x pipeline"]["chosen"] and rows["hybrid"]["fits"]
    assert (plan.tp, plan.data_parallel, len(plan.stages)) == (4, 2, 4)


def test_a_cpu_cluster_and_a_fixed_degree() -> None:
    devs = [device("cpu", "cpu", None)]
    prof = Profile(
        [layer(f"l{k}", params=1000, act=10.0, out=10.0, speeds=[1.0]) for k in range(4)],
        devs,
        8,
        10.0,
        "adam",
    )
    plan = cluster_search(prof, Cluster.describe(devs, 2, interconnect="eth-25g"))
    assert _rows(plan)[TP]["note"] == "not possible: no tp in 2, 4, 8 divides the 1 device(s) per node"
    assert (
        tp_degrees(8) == [2, 4, 8]
        and tp_degrees(6) == [2]
        and tp_degrees(8, 4) == [4]
        and tp_degrees(8, 1) == []
    )
    with pytest.raises(ValueError, match="tp=3 does not divide the 8 device"):
        tp_degrees(8, 3)
    with pytest.raises(ValueError, match="tp=0 must be 'auto' or an int"):
        tp_degrees(8, 0)


# ---------------------------------------------------------------- Plan.tp, span, CLI
def test_plan_tp_field_validates_and_span_names_the_way_to_run_it() -> None:
    stages = [StagePlan("cpu", ["0"])]
    plan = Plan(
        stages, data_parallel=2, nodes=1, devices_per_node=4, stage_ranks=[[0, 1, 2, 3]], shard=True, tp=2
    )
    assert plan.world_size == 4 and plan.rank_role(3) == (0, 1)
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match=r"data_parallel \* stages \* tp = 2 \* 1 \* 2 = 4 must equal"):
        Plan(stages, data_parallel=2, nodes=1, devices_per_node=8, stage_ranks=[list(range(4))], tp=2)
    with pytest.raises(ValueError, match=r"of 4 ranks \(tp 2 per replica\)"):
        Plan(stages, data_parallel=2, nodes=1, devices_per_node=4, stage_ranks=[[0, 1]], tp=2)
    with pytest.raises(ValueError, match="tp=0"):
        Plan(stages, tp=0)
    with pytest.raises(ValueError, match="needs stage_ranks"):
        Plan(stages, tp=2)
    with pytest.raises(
        ValueError, match=r"WORLD_SIZE is 1: run span\(model, plan\) in a launched job of 4 processes"
    ):
        torchspan.span(nn.Sequential(nn.Linear(4, 4)), plan)


def test_cli_tp_option(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", f"{EXAMPLES}:mlp", "--input-shape", "64,1024", "--devices", "h100-80gb*4", "--json"]
    assert main([*argv, "--tp", "2"]) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["comparison"]}
    assert (
        rows[TP]["ranks"] == "tp 2 x dp 2" and rows[TP]["predicted_step_time"] > 0
    )  # one node planned as a cluster
    assert main([*argv, "--nodes", "2", "--tp", "1"]) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["comparison"]}
    assert rows[TP]["note"] == "not possible: tp=1 was fixed"
    assert main([*argv, "--tp", "3"]) != 0
    assert "tp=3 does not divide the 4 device(s) per node" in capsys.readouterr().err
    assert main([*argv, "--tp", "x"]) == 2
    assert "--tp 'x' must be 'auto' or an integer >= 1" in capsys.readouterr().err

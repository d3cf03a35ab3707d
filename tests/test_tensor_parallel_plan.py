"""``span(model, plan)`` runs the planner's tensor parallel x sharded plan (issue 33 item 4's last part).

The plans are the planner's own choices for a Llama-2-70B-shaped decoder of 2 blocks (built on meta, bfloat16,
FLOP estimates on described H100s): ``tp 2 x dp 2`` on one node of 4 (a batch of 2 x 2048 tokens), and ``tp 8
x dp 4`` on 4 nodes of 8 (a batch of 8). Their layers are named as any ``LlamaForCausalLM`` of 2 blocks names
them, so a tiny tied GQA Llama (float64, 8 heads, 4 KV heads) runs them on 2 and 4 gloo ranks: the 4-rank plan
exactly on 4 ranks, the others shrunk (``tp = gcd(plan.tp, WORLD_SIZE)``, sharded replicas over the rest, a
warning saying so). Every layout's full gradients are one device's on the whole batch. A plan that cannot run
is refused, naming why, before any work.
"""

from __future__ import annotations

import copy
import math
import warnings
from functools import cache

import pytest
import torch
from ranks_spawn import join_job, spawn
from test_tensor_parallel import _batch, _same_grads
from torch import nn

import torchspan
from torchspan.planner import Plan, StagePlan
from torchspan.runtime.ranks import free_port

transformers = pytest.importorskip("transformers", reason="the Llama case needs the hf extra")

TOL = dict(rtol=1e-5, atol=1e-8)  # the model's own loss is float32


def _config(**shape) -> object:
    return transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        use_cache=False,
        **shape,
    )


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_config()).double()


@cache
def _plans() -> dict[str, str]:
    """The planner's choices for a 70B-shaped 2-block Llama (JSON): ``{"4 ranks": ..., "32 ranks": ...}``."""
    shape = dict(
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
    )
    config = transformers.LlamaConfig(num_hidden_layers=2, tie_word_embeddings=True, use_cache=False, **shape)
    with torch.device("meta"):
        wide = transformers.LlamaForCausalLM(config)
    out = {}
    for name, batch, devices, nodes in (
        ("4 ranks", 2, "h100-80gb*4", None),
        ("32 ranks", 8, "h100-80gb*8", 4),
    ):
        ids = torch.randint(0, 32000, (batch, 2048))
        plan = torchspan.plan(
            wide, {"input_ids": ids}, devices=devices, nodes=nodes, intra_link="nvlink", dtype=torch.bfloat16
        )
        out[name] = plan.to_json()
    return out


def _run(rank: int, world: int, text: str) -> None:
    """One plan through ``train_step`` on this rank's rows; the full gradients one device's; the warning iff
    shrunk."""
    plan = Plan.from_json(text)
    model = _tiny()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spanned = torchspan.span(model, plan)
    shrunk = world < plan.world_size
    tp = math.gcd(plan.tp, world) if shrunk else plan.tp
    said = [str(w.message) for w in caught if "runs shrunk" in str(w.message)]
    assert len(said) == int(shrunk), said
    assert all(
        w.filename == __file__ for w in caught if "runs shrunk" in str(w.message)
    )  # at the span() call
    if shrunk:
        assert f"tp {tp} x dp_shard {world // tp}" in said[0] and f"for {plan.world_size} ranks" in said[0]
    replica, replicas = spanned.data_parallel
    assert (replica, replicas) == (rank // tp, world // tp), (spanned.data_parallel, tp)
    names = spanned.mesh.mesh_dim_names
    assert names == (("dp_shard", "tp") if replicas > 1 else ("tp",)) and spanned.mesh["tp"].size() == tp
    local = spanned.module.model.layers[0].mlp.up_proj.weight.to_local()
    assert local.shape == (64 // tp // replicas, 32), (
        local.shape
    )  # split over tp, then FSDP2's rows over dp_shard
    batch = _batch()
    loss = spanned.train_step(torchspan.shard_batch(batch, replica, replicas))
    want = reference(**batch).loss
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach().double(), rtol=1e-6, atol=1e-8)
    _same_grads(spanned, reference, f"plan tp {plan.tp} x dp {plan.data_parallel} on {world} ranks", TOL)


def _worker(rank: int, world: int, port: int, plans: dict[str, str]) -> None:
    join_job(rank, world, port)
    for text in plans.values():
        _run(rank, world, text)


def test_the_planner_chose_tensor_parallel_for_both_plans() -> None:
    plans = {k: Plan.from_json(v) for k, v in _plans().items()}
    got = {k: (p.tp, p.data_parallel, p.world_size, p.shard, len(p.stages)) for k, p in plans.items()}
    assert got == {"4 ranks": (2, 2, 4, True, 1), "32 ranks": (8, 4, 32, True, 1)}
    modules = dict(_tiny().named_modules())  # the tiny Llama has every layer the plans name
    assert all(name in modules for p in plans.values() for name in p.layers), plans["4 ranks"].layers


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_span_runs_the_planners_tensor_parallel_plan(world: int) -> None:
    spawn(_worker, world, free_port(), _plans(), deadline=300)


def test_a_plan_that_cannot_run_is_refused_before_any_work() -> None:
    """One process, several stages, layers the model lacks, another tp: each refused naming the fix."""
    text = _plans()["4 ranks"]
    plan = Plan.from_json(text)
    with pytest.raises(
        ValueError, match=r"WORLD_SIZE is 1: run span\(model, plan\) in a launched job of 4 processes"
    ):
        torchspan.span(_tiny(), plan)
    with pytest.raises(ValueError, match=r"span\(model, plan, tp=4\): plan.tp=2: .*drop tp="):
        torchspan.span(_tiny(), plan, tp=4)
    two = Plan(
        [StagePlan("cpu", ["0"]), StagePlan("cpu", ["1"])],
        data_parallel=1,
        nodes=1,
        devices_per_node=4,
        stage_ranks=[[0, 1], [2, 3]],
        tp=2,
    )
    with pytest.raises(
        ValueError, match=r"plan.tp=2 with 2 stages: .*WORLD_SIZE is 1: run span\(model, plan\)"
    ):
        torchspan.span(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), two)  # tp x pp: ranks.tpstages
    other = Plan(
        [StagePlan("cpu", ["blocks.0"])],
        data_parallel=1,
        nodes=1,
        devices_per_node=2,
        stage_ranks=[[0, 1]],
        tp=2,
    )
    with pytest.raises(ValueError, match=r"of layers \['blocks.0'\] that Sequential does not have: re-plan"):
        torchspan.span(nn.Sequential(nn.Linear(4, 4)), other)


# -------------------------------------------------------- tensor parallel x pipeline (planner.tppipeline)
@cache
def _staged_plans() -> dict[str, str]:
    """The planner's tensor parallel x pipeline choices for the 70B-shaped 2-block Llama (tp 2 and the
    replicas fixed): ``tp 2 x pp 2`` on one node of 4, ``tp 2 x pp 2 x dp 2`` on one node of 8 (2 x 2048
    tokens)."""
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        tie_word_embeddings=True,
        use_cache=False,
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
    )
    with torch.device("meta"):
        wide = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 32000, (2, 2048))
    out = {}
    for name, devices, dp in (("4 ranks", "h100-80gb*4", 1), ("8 ranks", "h100-80gb*8", 2)):
        plan = torchspan.plan(
            wide,
            {"input_ids": ids},
            devices=devices,
            intra_link="nvlink",
            dtype=torch.bfloat16,
            data_parallel=dp,
            tp=2,
        )
        out[name] = plan.to_json()
    return out


def test_the_planner_chose_tensor_parallel_pipelines() -> None:
    plans = {k: Plan.from_json(v) for k, v in _staged_plans().items()}
    got = {k: (p.tp, p.data_parallel, len(p.stages), p.world_size, p.shard) for k, p in plans.items()}
    assert got == {"4 ranks": (2, 1, 2, 4, False), "8 ranks": (2, 2, 2, 8, False)}
    for p in plans.values():
        chosen = next(r for r in p.comparison if r["chosen"])
        assert chosen["strategy"] == "tensor parallel x pipeline", chosen
    modules = dict(_tiny().named_modules())
    assert all(name in modules for p in plans.values() for name in p.layers), plans["4 ranks"].layers


def _run_staged(rank: int, world: int, text: str) -> None:
    """A tensor parallel x pipeline plan through ``train_step``: pp 2 x tp 2 on 4 ranks (the 8-rank plan
    shrunk, with its warning); the loss and every held parameter's full gradient one device's."""
    plan = Plan.from_json(text)
    model = _tiny()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spanned = torchspan.span(model, plan)
    said = [str(w.message) for w in caught if "runs shrunk" in str(w.message)]
    shrunk = world < plan.world_size
    assert len(said) == int(shrunk), said
    if shrunk:
        assert "as pp 2 x dp 1 x tp 2" in said[0] and all(
            w.filename == __file__ for w in caught if "runs shrunk" in str(w.message)
        )
    mesh = spanned.mesh
    assert mesh.mesh_dim_names == ("pp", "tp") and tuple(mesh.shape) == (2, 2), (
        mesh
    )  # dp_replicate 1: kept out
    assert spanned.data_parallel == (0, 1), spanned.data_parallel
    batch = _batch()
    loss = spanned.train_step(batch)
    want = reference(**batch).loss
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach().double(), rtol=1e-6, atol=1e-8)
    ref = dict(reference.named_parameters())
    held = [(n, p) for n, p in spanned.module.named_parameters() if p.device.type != "meta"]
    assert any(type(p).__name__ == "DTensor" for _, p in held), "no layer split over tp"
    for name, p in held:
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(got, ref[name].grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def _staged_worker(rank: int, world: int, port: int, plans: dict[str, str]) -> None:
    join_job(rank, world, port)
    for text in plans.values():
        _run_staged(rank, world, text)


@pytest.mark.slow
def test_span_runs_the_planners_tensor_parallel_pipeline_on_4_ranks() -> None:
    spawn(_staged_worker, 4, free_port(), _staged_plans(), deadline=300)

"""``span(model, tp=2)``: every layer split over 2 gloo ranks by DTensor, gradients one device's.

Each rank runs the same batch; the full gradient of every parameter (``.grad.full_tensor()`` where it is
split) must equal one device's on that batch, for a tied Llama-style decoder with grouped-query attention (its
own ``base_model_tp_plan``) through ``train_step`` with micro-batches and through the plain
``loss.backward()``, and an MLP by a ``tp_plan`` the user passes; clipping by the whole model's norm (also
with sharded replicas on 4 ranks: 2-D shards beside 1-D ones); ``state_dict()`` full tensors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from ranks_spawn import join_job, spawn
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port

transformers = pytest.importorskip("transformers", reason="the Llama case needs the hf extra")

TOL = dict(rtol=1e-9, atol=1e-11)  # float64: the same sums, split over ranks


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _same_grads(spanned, reference, label: str, tol=TOL) -> None:
    ref = dict(reference.named_parameters())
    for name, p in spanned.module.named_parameters():
        assert p.grad is not None, f"{label}: {name} has no gradient"
        torch.testing.assert_close(
            _full(p.grad), ref[name].grad, **tol, msg=lambda m: f"{label}: {name}: {m}"
        )


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).double()


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 40, (5, 7), generator=g)
    mask = torch.ones(5, 7, dtype=torch.long)
    mask[0, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _worker(rank: int, world: int, port: int) -> None:
    join_job(rank, world, port)
    batch = _batch()
    # the model's own loss through train_step, 2 micro-batches
    model = _llama()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, tp=2, microbatches=2)
    assert spanned.mesh is not None and spanned.mesh.mesh_dim_names == ("tp",)
    assert type(spanned.module.model.layers[0].self_attn.q_proj.weight).__name__ == "DTensor"
    loss = spanned.train_step(batch)
    want = reference(**batch).loss
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach().double(), rtol=1e-6, atol=1e-8)
    _same_grads(
        spanned, reference, "Llama tp=2, train_step", dict(rtol=1e-5, atol=1e-8)
    )  # its loss in float32
    norm = spanned.clip_grad_norm_(0.1)
    torch.testing.assert_close(
        norm.double(), torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1), rtol=1e-5, atol=1e-8
    )
    state = spanned.state_dict()
    assert all(type(v) is torch.Tensor for v in state.values()) and state[
        "model.layers.0.mlp.up_proj.weight"
    ].shape == (64, 32)
    # the plain loop on the model's own loss
    model = _llama()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, tp=2)
    spanned(**batch).loss.backward()
    reference(**batch).loss.backward()
    _same_grads(spanned, reference, "Llama tp=2, plain loop", dict(rtol=1e-5, atol=1e-8))
    # an MLP by the user's plan
    torch.manual_seed(1)
    mlp = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    reference = copy.deepcopy(mlp)
    spanned = torchspan.span(mlp, tp=2, tp_plan={"0": "colwise", "2": "rowwise"})
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.tensor([0, 2, 1, 1, 0])
    F.cross_entropy(spanned(x), y).backward()
    F.cross_entropy(reference(x), y).backward()
    _same_grads(spanned, reference, "MLP tp=2 by tp_plan")
    _refusals()


def _refusals() -> None:
    with pytest.raises(ValueError, match="has no tensor-parallel plan of its own"):
        torchspan.span(nn.Sequential(nn.Linear(4, 4)), tp=2)
    with pytest.raises(ValueError, match=r"dp_shard\(1\) \* tp\(4\) != WORLD_SIZE\(2\)"):
        torchspan.span(nn.Sequential(nn.Linear(4, 4)), tp=4, tp_plan={"0": "colwise"})
    with pytest.raises(
        ValueError, match=r"WORLD_SIZE\(2\): a pipeline of tensor-parallel stages takes pp x tp"
    ):
        torchspan.span(_llama(), tp=2, balance=[4, 4])
    with pytest.raises(ValueError, match=r"tp_plan\['1'\] names no module"):
        torchspan.span(nn.Sequential(nn.Linear(4, 4)), tp=2, tp_plan={"1": "colwise"})
    with pytest.raises(ValueError, match="is not one of 'colwise'"):
        torchspan.span(nn.Sequential(nn.Linear(4, 4)), tp=2, tp_plan={"0": "columns"})


@pytest.mark.slow
def test_tensor_parallel_gradients_are_one_devices() -> None:
    spawn(_worker, 2, free_port())


def _worker_2d(rank: int, world: int, port: int) -> None:
    """tp(2) x dp_shard(2): each layer split over a pair of ranks, FSDP2 over the pairs; uneven rows 3 + 2."""
    join_job(rank, world, port)
    batch = _batch()
    model = _llama()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, tp=2, shard=True)
    assert spanned.mode == "sharded" and spanned.mesh.mesh_dim_names == ("dp_shard", "tp")
    replica, replicas = spanned.data_parallel
    assert (replica, replicas) == (rank // 2, 2)  # tp innermost: ranks 0, 1 split the layers of replica 0
    loss = spanned.train_step(torchspan.shard_batch(batch, replica, replicas))
    want = reference(**batch).loss
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach().double(), rtol=1e-6, atol=1e-8)
    _same_grads(spanned, reference, "Llama tp=2 x dp_shard=2, train_step", dict(rtol=1e-5, atol=1e-8))
    # the whole model's norm: 2-D DTensor shards beside the tied embedding's 1-D ones (FSDP2 over dp_shard
    # alone)
    norm = spanned.clip_grad_norm_(0.1)
    torch.testing.assert_close(
        norm.double(), torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1), rtol=1e-5, atol=1e-8
    )
    _same_grads(spanned, reference, "Llama tp=2 x dp_shard=2, clipped", dict(rtol=1e-5, atol=1e-8))
    state = spanned.state_dict()
    torch.testing.assert_close(
        state["model.layers.1.self_attn.o_proj.weight"],
        reference.state_dict()["model.layers.1.self_attn.o_proj.weight"],
    )
    model = _llama()  # the plain loop
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, tp=2, shard=True)
    spanned(**torchspan.shard_batch(batch, replica, replicas)).loss.backward()
    reference(**batch).loss.backward()
    _same_grads(spanned, reference, "Llama tp=2 x dp_shard=2, plain loop", dict(rtol=1e-5, atol=1e-8))


@pytest.mark.slow
def test_tensor_parallel_with_sharded_replicas_is_one_devices() -> None:
    spawn(_worker_2d, 4, free_port(), deadline=300)

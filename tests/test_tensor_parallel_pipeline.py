"""3-D parallelism: ``span(model, tp=2, balance=[...])`` on 4 gloo ranks, a pipeline of 2 tensor-parallel
stages.

Rank ``(stage, tp)``: stage ``s``'s layers split over its 2 ``tp`` ranks (DTensor), the activations crossing
stages point to point between matching ``tp`` ranks. Through ``train_step`` with uneven micro-batches, each
rank's gradients (``.full_tensor()`` where split) must equal one device's on the whole batch, for an MLP of
blocks and a decoder whose embedding is tied to its head across the first and last stage; ``clip_grad_norm_``
must return one device's norm of the whole model and scale as it does. What is not built is refused, naming
the argument.
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

TOL = {"rtol": 1e-9, "atol": 1e-11}
PLAN = {"*.up": "colwise", "*.down": "rowwise"}


class Block(nn.Module):
    def __init__(self, d: int = 8, h: int = 16) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), Block(), Block()).double()


def _decoder() -> nn.Sequential:
    torch.manual_seed(1)
    emb, head = nn.Embedding(20, 8), nn.Linear(8, 20, bias=False)
    head.weight = emb.weight  # tied across the first and the last stage
    return nn.Sequential(emb, Block(), Block(), head).double()


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _check(spanned, reference, x, y, loss_fn, label: str, whole=None) -> None:
    loss = spanned.train_step(x, y, loss_fn)
    x, y = whole if whole is not None else (x, y)  # a replica trains its shard; one device the whole batch
    expected = loss_fn(reference(x), y)
    expected.backward()
    torch.testing.assert_close(
        loss.double(), expected.detach(), rtol=1e-6, atol=1e-7
    )  # the loss rides as float32
    ref = dict(reference.named_parameters())
    held = [
        (n, p) for n, p in spanned.module.named_parameters() if p.device.type != "meta" and p.requires_grad
    ]
    assert held and any(type(p).__name__ == "DTensor" for _, p in held), f"{label}: no layer split over tp"
    for name, p in held:
        assert p.grad is not None, f"{label}: {name} has no gradient"
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(
            got, ref[name].grad, **TOL, msg=lambda m, name=name: f"{label}: {name}: {m}"
        )
    norm = spanned.clip_grad_norm_(0.05)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    torch.testing.assert_close(norm.double(), ref_norm, **TOL, msg=lambda m: f"{label}: clip norm: {m}")
    for name, p in held:
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(
            got, ref[name].grad, **TOL, msg=lambda m, name=name: f"{label}: clipped {name}: {m}"
        )


def _worker(rank: int, world: int, port: int, folder: str) -> None:
    join_job(rank, world, port)
    g = torch.Generator().manual_seed(5)
    x, y = (
        torch.randn(5, 3, 8, generator=g, dtype=torch.float64),
        torch.randn(5, 3, 8, generator=g, dtype=torch.float64),
    )
    model = _mlp()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, tp=2, balance=[2, 2], microbatches=2, tp_plan=PLAN)  # 3 + 2 rows
    assert spanned.mesh.mesh_dim_names == ("pp", "tp") and "tp(2)" in spanned.mode_reason, spanned.mode_reason
    _check(spanned, reference, x, y, F.mse_loss, "MLP pp2 x tp2")
    ids = torch.randint(0, 20, (5, 4), generator=g)
    model = _decoder()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, tp=2, balance=[2, 2], microbatches=3, tp_plan=PLAN, schedule="1f1b")
    _check(spanned, reference, ids, ids, _ce, "tied decoder pp2 x tp2")
    model = _decoder()  # zero-bubble (backward split into input and weight gradients) with recompute
    split = torchspan.span(
        model, tp=2, balance=[2, 2], microbatches=3, tp_plan=PLAN, schedule="zero-bubble", recompute="always"
    )
    _check(split, copy.deepcopy(_decoder()), ids, ids, _ce, "tied decoder pp2 x tp2, zero-bubble, recompute")
    with torch.no_grad():  # evaluation: the last stage's outputs on every rank
        torch.testing.assert_close(spanned(ids), reference(ids), **TOL)
    torch.optim.SGD(spanned.parameters(), lr=0.5).step()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    torchspan.save_checkpoint(
        f"{folder}/ckpt.pt", {"model": spanned.state_dict(), "step": 1}
    )  # one state per rank
    torch.manual_seed(rank + 11)  # another start on every rank: the load must bring the trained weights
    other = nn.Sequential(nn.Embedding(20, 8), Block(), Block(), nn.Linear(8, 20, bias=False)).double()
    other[3].weight = other[0].weight
    resumed = torchspan.span(other, tp=2, balance=[2, 2], microbatches=3, tp_plan=PLAN)
    resumed.load_state_dict(torchspan.load_checkpoint(f"{folder}/ckpt.pt")["model"])
    trained, ref = dict(spanned.module.named_parameters()), dict(reference.named_parameters())
    loaded = [(n, p) for n, p in resumed.module.named_parameters() if p.device.type != "meta"]
    assert any(type(p).__name__ == "DTensor" for _, p in loaded)
    for name, p in loaded:
        got = p.full_tensor() if hasattr(p, "full_tensor") else p
        want = trained[name].full_tensor() if hasattr(trained[name], "full_tensor") else trained[name]
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, name=name: f"resumed {name}: {m}")
        torch.testing.assert_close(
            got, ref[name], **TOL, msg=lambda m, name=name: f"resumed {name} vs one device: {m}"
        )
    _llama_case()
    _refusals()


def _llama_case(label: str = "Llama pp2 x tp2") -> None:
    """A tied GQA Llama (transformers, its own base_model_tp_plan and loss) through its own forward, 2 stages;
    with replicas each trains its shard of the batch."""
    transformers = pytest.importorskip("transformers")
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
    model = transformers.LlamaForCausalLM(config).double()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 40, (5, 7), generator=g)
    mask = torch.ones(5, 7, dtype=torch.long)
    mask[0, -3:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    spanned = torchspan.span(
        model, tp=2, devices=["cpu", "cpu"], microbatches=2
    )  # 3 + 2 rows (2 + 1 per replica)
    replica, replicas = spanned.data_parallel
    loss = spanned.train_step(torchspan.shard_batch(batch, replica, replicas))
    expected = reference(**batch).loss
    expected.backward()
    near = {"rtol": 1e-5, "atol": 1e-8}  # the model's own loss is float32
    torch.testing.assert_close(loss.double(), expected.detach().double(), **near)
    ref = dict(reference.named_parameters())
    held = [
        (n, p) for n, p in spanned.module.named_parameters() if p.device.type != "meta" and p.requires_grad
    ]
    assert any(type(p).__name__ == "DTensor" for _, p in held), f"{label}: no layer split over tp"
    for name, p in held:
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(
            got, ref[name].grad, **near, msg=lambda m, name=name: f"{label}: {name}: {m}"
        )
    norm = spanned.clip_grad_norm_(0.05)
    torch.testing.assert_close(
        norm.double(), torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05).double(), **near
    )


def _refusals() -> None:
    with pytest.raises(ValueError, match="sequence_parallel"):
        torchspan.span(_mlp(), tp=2, balance=[2, 2], tp_plan={**PLAN, "0": "sequence_parallel"})
    with pytest.raises(ValueError, match="shard="):
        torchspan.span(_mlp(), tp=2, balance=[2, 2], tp_plan=PLAN, shard=True)
    with pytest.raises(ValueError, match="one stage per rank"):
        torchspan.span(_mlp(), tp=2, balance=[1, 1, 1, 1], tp_plan=PLAN)
    with pytest.raises(ValueError, match="weights="):
        torchspan.span(_mlp(), tp=2, balance=[2, 2], tp_plan=PLAN, weights="init")


def test_pipeline_of_tensor_parallel_stages_is_one_devices(tmp_path) -> None:
    spawn(_worker, 4, free_port(), str(tmp_path), deadline=300.0)


def _worker_3d(rank: int, world: int, port: int) -> None:
    join_job(rank, world, port)
    g = torch.Generator().manual_seed(7)
    x, y = (
        torch.randn(6, 3, 8, generator=g, dtype=torch.float64),
        torch.randn(6, 3, 8, generator=g, dtype=torch.float64),
    )
    ids = torch.randint(0, 20, (6, 4), generator=g)
    for make, inputs, targets, loss_fn, label in [
        (_mlp, x, y, F.mse_loss, "MLP"),
        (_decoder, ids, ids, _ce, "tied decoder"),
    ]:
        model = make()
        reference = copy.deepcopy(model)
        spanned = torchspan.span(
            model, tp=2, balance=[2, 2], microbatches=2, tp_plan=PLAN
        )  # 2 + 1 rows per replica
        assert spanned.mesh.mesh_dim_names == ("pp", "dp_replicate", "tp")
        replica, replicas = spanned.data_parallel
        assert replicas == 2 and replica == (rank // 2) % 2, (rank, spanned.data_parallel)
        mine = torchspan.shard_batch((inputs, targets), replica, replicas)
        _check(spanned, reference, *mine, loss_fn, f"{label} pp2 x dp2 x tp2", whole=(inputs, targets))
    _llama_case("Llama pp2 x dp2 x tp2")


def test_pipeline_of_tensor_parallel_stages_with_replicas_is_one_devices() -> None:
    spawn(_worker_3d, 8, free_port(), deadline=400.0)

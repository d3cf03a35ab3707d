"""Sequence parallel (issue 33 item 1): a ``tp_plan`` naming ``"sequence_parallel"`` norms, 2 gloo ranks, one
device's gradients.

The norms run on sequence shards (each rank's ``LayerNorm`` / ``LlamaRMSNorm`` sees ``DTensor`` ``Shard(1)``
of 4 or 3 of 7 tokens, checked by a hook), the row-wise projections reduce-scatter into them and the
column-wise ones gather from them (``runtime.ranks.sequenceparallel``). ``.grad`` as full tensors equals one
device's on the same batch for an MLP with ``LayerNorm``s (``train_step`` with 2 micro-batches, and the plain
loop) and a tied Llama-style decoder with grouped-query attention whose own plan gains sequence-parallel norms
(its own loss through ``train_step`` and the plain loop, clipping by the whole model's norm), also sharded by
FSDP2 over 2 replicas (4 ranks).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from ranks_spawn import join_job, spawn
from test_tensor_parallel import _batch, _llama, _same_grads
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port
from torchspan.runtime.ranks.sequenceparallel import sequence_blocks

transformers = pytest.importorskip("transformers", reason="the Llama case needs the hf extra")

MLP_PLAN = {
    "0": "colwise",
    "2": "rowwise",
    "3": "sequence_parallel",
    "4": "colwise",
    "6": "rowwise",
    "7": "sequence_parallel",
}
LLAMA_SP = {
    "model.layers.*.input_layernorm": "sequence_parallel",
    "model.layers.*.post_attention_layernorm": "sequence_parallel",
    "model.norm": "sequence_parallel",
}


def _mlp() -> nn.Module:
    torch.manual_seed(2)
    layers = [
        nn.Linear(8, 16),
        nn.GELU(),
        nn.Linear(16, 8),
        nn.LayerNorm(8),
        nn.Linear(8, 16),
        nn.Tanh(),
        nn.Linear(16, 8),
    ]
    model = nn.Sequential(*layers, nn.LayerNorm(8), nn.Linear(8, 5)).double()
    with torch.no_grad():  # norms away from their ones/zeros init, so their gradients and weights both matter
        for norm in (model[3], model[7]):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    return model


def _watch_shards(modules: list[nn.Module], seen: list[tuple]) -> None:
    """Record each norm's input layout and local length (the sequence shard it normalizes)."""

    def hook(module: nn.Module, args: tuple) -> None:
        x = args[0]
        seen.append(
            (
                type(x).__name__,
                tuple(getattr(x, "placements", ())),
                x.to_local().shape[1] if hasattr(x, "to_local") else None,
            )
        )

    for m in modules:
        m.register_forward_pre_hook(hook)


def _check_sharded(seen: list[tuple], rank: int, label: str) -> None:
    from torch.distributed.tensor import Shard

    assert seen, f"{label}: no norm ran"
    assert all(s == ("DTensor", (Shard(1),), 4 - rank) for s in seen), (
        f"{label}: {seen[:4]}"
    )  # 7 tokens: 4 + 3


def _mlp_case(rank: int) -> None:
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(6, 7, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (6, 7), generator=g)

    def loss_fn(out, target):
        return F.cross_entropy(out.reshape(-1, 5), target.reshape(-1))

    for loop in ("train_step", "plain"):
        model = _mlp()
        reference = copy.deepcopy(model)
        spanned = torchspan.span(
            model, tp=2, tp_plan=MLP_PLAN, microbatches=2 if loop == "train_step" else None
        )
        seen: list[tuple] = []
        _watch_shards([spanned.module[3], spanned.module[7]], seen)
        if loop == "train_step":
            loss = spanned.train_step(x, y, loss_fn)
        else:
            out = spanned(x)
            assert type(out) is torch.Tensor and out.shape == (6, 7, 5)  # the model's output whole
            loss = loss_fn(out, y)
            loss.backward()
        want = loss_fn(reference(x), y)
        want.backward()
        torch.testing.assert_close(
            loss.double(), want.detach(), rtol=1e-6, atol=1e-8
        )  # train_step's loss: float32
        _check_sharded(seen, rank, f"MLP {loop}")
        _same_grads(spanned, reference, f"MLP + LayerNorm, sequence parallel, {loop}")


def _llama_case(rank: int) -> None:
    batch = _batch()
    own = {f"model.{k}": v for k, v in _llama().config.base_model_tp_plan.items()}
    for loop in ("train_step", "plain"):
        model = _llama()
        reference = copy.deepcopy(model)
        spanned = torchspan.span(
            model, tp=2, tp_plan={**own, **LLAMA_SP}, microbatches=2 if loop == "train_step" else None
        )
        layers = spanned.module.model.layers
        assert type(layers[0].input_layernorm.weight).__name__ == "DTensor"  # replicated by SequenceParallel
        seen: list[tuple] = []
        _watch_shards(
            [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)], seen
        )
        if loop == "train_step":
            loss = spanned.train_step(batch)
        else:
            out = spanned(**batch)
            assert type(out.logits) is torch.Tensor and out.logits.shape == (5, 7, 40)
            loss = out.loss
            loss.backward()
        want = reference(**batch).loss
        want.backward()
        torch.testing.assert_close(loss.double(), want.detach().double(), rtol=1e-6, atol=1e-8)
        _check_sharded(seen, rank, f"Llama {loop}")
        _same_grads(spanned, reference, f"Llama, sequence-parallel norms, {loop}", dict(rtol=1e-5, atol=1e-8))
        if loop == "train_step":
            norm = spanned.clip_grad_norm_(0.1)
            want_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
            torch.testing.assert_close(norm.double(), want_norm, rtol=1e-5, atol=1e-8)
            _same_grads(spanned, reference, "Llama, sequence parallel, clipped", dict(rtol=1e-5, atol=1e-8))


def _worker(rank: int, world: int, port: int) -> None:
    join_job(rank, world, port)
    _mlp_case(rank)
    _llama_case(rank)


@pytest.mark.slow
def test_sequence_parallel_norms_have_one_devices_gradients() -> None:
    spawn(_worker, 2, free_port(), deadline=300)


def _worker_2d(rank: int, world: int, port: int) -> None:
    """tp(2) x dp_shard(2): the sequence-parallel Llama sharded by FSDP2 over the tp pairs, rows 3 + 2;
    clipped."""
    join_job(rank, world, port)
    batch = _batch()
    own = {f"model.{k}": v for k, v in _llama().config.base_model_tp_plan.items()}
    model = _llama()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, tp=2, shard=True, tp_plan={**own, **LLAMA_SP})
    replica, replicas = spanned.data_parallel
    seen: list[tuple] = []
    _watch_shards([layer.input_layernorm for layer in spanned.module.model.layers], seen)
    loss = spanned.train_step(torchspan.shard_batch(batch, replica, replicas))
    want = reference(**batch).loss
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach().double(), rtol=1e-6, atol=1e-8)
    _check_sharded(seen, rank % 2, "Llama tp=2 x dp_shard=2")
    _same_grads(spanned, reference, "Llama tp=2 x dp_shard=2, sequence parallel", dict(rtol=1e-5, atol=1e-8))
    norm = spanned.clip_grad_norm_(0.1)
    torch.testing.assert_close(
        norm.double(), torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1), rtol=1e-5, atol=1e-8
    )
    _same_grads(
        spanned, reference, "Llama tp=2 x dp_shard=2, sequence parallel, clipped", dict(rtol=1e-5, atol=1e-8)
    )


@pytest.mark.slow
def test_sequence_parallel_with_sharded_replicas_has_one_devices_gradients() -> None:
    spawn(_worker_2d, 4, free_port(), deadline=300)


def test_the_stream_splits_at_the_deepest_parent_of_the_norms() -> None:
    names = [
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm",
        "model.norm",
    ]
    assert sequence_blocks(names) == ["model.layers.0", "model.layers.1"]
    assert sequence_blocks(["3", "7"]) == [""]  # an nn.Sequential: the model's own input
    assert sequence_blocks(["model.norm"]) == ["model"]

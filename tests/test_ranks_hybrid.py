"""Hybrid data x pipeline parallel on 4 gloo ranks: 2 stages x 2 replicas, single-device gradients.

Mesh: rank = replica * 2 + stage, so ranks 0, 1 are replica 0's pipeline and ranks 2, 3 replica
1's; the ranks of one replica pass the same shard (7 rows split 4 + 3 over the replicas). Every
rank checks the parameters it holds against one device on the whole batch: the normalizers
(samples, class weights with ignored targets) are all-reduced, the stage gradients summed per
data-parallel group, the tied embedding/head weight in its own group.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_ranks_pipeline import LOSS_TOL, TiedLM, _check, _join, _leave, _seq, _spawn
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port, shard_batch


def _hybrid_worker(rank: int, world: int, port: int) -> None:
    _join(rank, world, port)
    replica, stage = divmod(rank, 2)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64)
    y = torch.randn(7, 4, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 3, 3, 1, 2, 3, 0])
    weights = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64)
    cases = [
        (nn.MSELoss(), y, "gpipe"),
        (nn.MSELoss(reduction="sum"), y, "1f1b"),
        (nn.CrossEntropyLoss(weight=weights, ignore_index=1), labels, "1f1b"),
    ]
    for loss_fn, target, schedule in cases:
        label = f"hybrid {schedule} {loss_fn}"
        torch.manual_seed(100 + rank)  # replicas start different: span must broadcast replica 0's stage
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6), nn.Linear(6, 4)).double()
        spanned = torchspan.span(model, balance=[2, 2], microbatches=2, schedule=schedule)
        reference = _seq()
        reference.load_state_dict(_gathered_state(spanned))
        xs, ts = shard_batch((x, target), replica, 2)
        got = spanned.train_step(xs, ts, loss_fn)
        want = loss_fn(reference(x), target)
        want.backward()
        torch.testing.assert_close(
            got.double(), want.detach(), **LOSS_TOL, msg=lambda m: f"{label}: loss on rank {rank}: {m}"
        )
        _check(spanned, reference, label, rank)

    # optimizer steps: both replicas of each stage stay identical and equal to one device's training
    model = _seq()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, balance=[2, 2], microbatches=2, schedule="1f1b")
    opt = torch.optim.Adam(spanned.parameters(), lr=0.05)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
    for n in (7, 6, 5):
        opt.zero_grad()
        spanned.train_step(*shard_batch((x[:n], y[:n]), replica, 2), nn.MSELoss())
        opt.step()
        ref_opt.zero_grad()
        nn.MSELoss()(reference(x[:n]), y[:n]).backward()
        ref_opt.step()
    ref = dict(reference.named_parameters())
    for name, p in spanned.module.named_parameters():
        if p.device.type != "meta":
            torch.testing.assert_close(
                p.detach(),
                ref[name].detach(),
                rtol=1e-9,
                atol=1e-11,
                msg=lambda m: f"rank {rank}: {name}: {m}",
            )

    # tied embedding/head across the stages of both replicas: one group of all four ranks
    ids = torch.randint(0, 11, (7, 3), generator=g)
    tokens = torch.randint(0, 11, (7, 3), generator=g)
    model = TiedLM()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, balance=[2, 1], microbatches=2, schedule="gpipe")
    loss_fn = nn.CrossEntropyLoss()
    ids_s, tok_s = shard_batch((ids, tokens), replica, 2)
    spanned.train_step(ids_s, tok_s, lambda out, t: loss_fn(out, t.flatten()), loss_reduction="mean")
    loss_fn(reference(ids), tokens.flatten()).backward()
    _check(spanned, reference, "hybrid tied", rank)
    assert stage == 0 or spanned.module.mid.weight.device.type == "meta"
    _leave()


def _gathered_state(spanned: torchspan.Spanned) -> dict[str, torch.Tensor]:
    """Replica 0's parameters of every stage, gathered on every rank (the reference starts from them)."""
    mine = {k: v for k, v in spanned.module.state_dict().items() if v.device.type != "meta"}
    every: list[dict[str, torch.Tensor] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    out: dict[str, torch.Tensor] = {}
    for part in every:
        assert part is not None
        for k, v in part.items():
            if k in out:
                assert torch.equal(out[k], v), f"replicas differ at {k} after span's broadcast"
            out[k] = v
    return out


@pytest.mark.slow
def test_two_by_two_hybrid_matches_one_device() -> None:
    _spawn(_hybrid_worker, 4, free_port(), deadline=150.0)

"""``spanned.clip_grad_norm_`` clips as ``torch.nn.utils.clip_grad_norm_`` does on one device with the whole
model.

Parity is the proof: after ``train_step`` + clip + ``optimizer.step()`` the weights (float64) and the
returned total norm equal one device's on the whole batch, for local stages, a launched data-parallel
job over uneven shards, a pipeline across 2 gloo ranks (stage functions and the model's own forward,
a tied embedding/head across the ranks) and a 2 x 2 hybrid; every norm type torch takes, and
``error_if_nonfinite`` as torch. On a pipeline rank the plain torch call would clip each stage by
its own norm: it raises, naming ``spanned.clip_grad_norm_``, before it scales anything (that rank's
gradients refuse torch's total norm; nothing in torch is replaced: ``test_no_patching``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_ranks_pipeline import TiedLM, _join, _leave, _seq, _spawn
from torch import nn
from torch.nn.utils import (
    clip_grad_norm_ as imported_clip,
)  # torch's own function: refused however it was imported

import torchspan
from torchspan.runtime.ranks import free_port, shard_batch

NORMS = (2.0, 1.0, math.inf, 3.0, 0.5)
TOL = dict(rtol=1e-12, atol=0.0)
WEIGHT_TOL = dict(rtol=1e-10, atol=1e-12)


class Blocks(nn.Module):
    """Blocks in a ModuleList run by the model's own forward, a parameter of the model's own, and a tied
    head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(13, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4))
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.head = nn.Linear(6, 13, bias=False)
        self.head.weight = self.embed.weight
        self.double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.gain
        for block in self.blocks:
            h = block(h) + h
        return self.head(h).flatten(0, 1)


def _ce(out: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, tokens.flatten())


def _train_clip_step(
    spanned,
    reference,
    opt,
    ref_opt,
    inputs,
    target,
    loss_fn,
    max_norm,
    norm_type,
    ref_inputs=None,
    ref_target=None,
    **kw,
):
    """One step of the loop users write on both; returns (spanned's norm, one device's norm)."""
    opt.zero_grad()
    ref_opt.zero_grad()
    spanned.train_step(inputs, target, loss_fn, **kw)
    got = spanned.clip_grad_norm_(max_norm, norm_type)
    loss_fn(
        reference(inputs if ref_inputs is None else ref_inputs), target if ref_target is None else ref_target
    ).backward()
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
    opt.step()
    ref_opt.step()
    return got, want


def _same_weights(spanned, reference, label: str) -> None:
    ref = dict(reference.named_parameters())
    for name, p in spanned.module.named_parameters():
        if p.device.type != "meta":
            torch.testing.assert_close(
                p.detach().cpu(), ref[name].detach(), **WEIGHT_TOL, msg=lambda m: f"{label}: {name}: {m}"
            )


# ---------------------------------------------------------------------- one process
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize(
    "make,inputs_of,devices",
    [
        (_seq, "x", ["cpu", "cpu"]),  # stage functions (sequential)
        (Blocks, "ids", ["cpu", "cpu"]),  # the model's own forward, tied head on the other stage
    ],
)
def test_local_stages_clip_as_one_device(make, inputs_of: str, devices: list[str], norm_type: float) -> None:
    g = torch.Generator().manual_seed(3)
    data = {
        "x": (
            torch.randn(7, 5, generator=g, dtype=torch.float64),
            torch.randn(7, 4, generator=g, dtype=torch.float64),
        ),
        "ids": (torch.randint(0, 13, (7, 3), generator=g), torch.randint(0, 13, (7, 3), generator=g)),
    }
    x, y = data[inputs_of]
    loss_fn = nn.MSELoss() if inputs_of == "x" else _ce
    model = make()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, devices=devices, microbatches=3)
    opt, ref_opt = (
        torch.optim.SGD(spanned.parameters(), lr=0.5),
        torch.optim.SGD(reference.parameters(), lr=0.5),
    )
    kw = {} if inputs_of == "x" else {"loss_reduction": "mean"}
    for step in range(3):
        got, want = _train_clip_step(spanned, reference, opt, ref_opt, x, y, loss_fn, 0.05, norm_type, **kw)
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"step {step}: norm: {m}")
        assert want > 0.05, "the test must clip"
    _same_weights(spanned, reference, f"{spanned.mode} norm {norm_type}")


def test_local_error_if_nonfinite_and_empty_as_torch() -> None:
    model = _seq()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, devices=["cpu", "cpu"], microbatches=2)
    assert (
        spanned.clip_grad_norm_(1.0).item()
        == 0.0
        == torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item()
    )
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    spanned.train_step(x, y, nn.MSELoss())
    nn.MSELoss()(reference(x), y).backward()
    for net in (spanned.module, reference):
        net[2].weight.grad[0, 0] = math.inf
    before = model[0].weight.grad.clone()
    with pytest.raises(RuntimeError) as mine:
        spanned.clip_grad_norm_(1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError) as theirs:
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0, error_if_nonfinite=True)
    assert str(mine.value) == str(theirs.value)
    assert torch.equal(model[0].weight.grad, before), "a refused clip scaled nothing"
    got, want = (
        spanned.clip_grad_norm_(1.0, math.inf),
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0, math.inf),
    )
    assert got.item() == want.item() == math.inf
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0, equal_nan=True)


def test_plain_torch_clip_stays_right_and_allowed_in_one_process() -> None:
    model = Blocks()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, devices=["cpu", "cpu"], microbatches=2)
    ids, tokens = torch.randint(0, 13, (6, 3)), torch.randint(0, 13, (6, 3))
    spanned.train_step(ids, tokens, _ce, loss_reduction="mean")
    _ce(reference(ids), tokens).backward()
    got = torch.nn.utils.clip_grad_norm_(
        spanned.parameters(), 0.01
    )  # one Parameter per tie: torch is right here
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


# ---------------------------------------------------------------------- 2 gloo ranks
def _pipeline_part(rank: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Stage functions across the ranks: every norm type, clipping active, three optimizer steps."""
    for norm_type in (2.0, math.inf, 1.0):
        model = _seq()
        reference = copy.deepcopy(model)
        spanned = torchspan.span(model, balance=[2, 2], microbatches=3, schedule="1f1b")
        opt, ref_opt = (
            torch.optim.SGD(spanned.parameters(), lr=0.5),
            torch.optim.SGD(reference.parameters(), lr=0.5),
        )
        for step in range(3):
            got, want = _train_clip_step(
                spanned, reference, opt, ref_opt, x, y, nn.MSELoss(), 0.05, norm_type
            )
            torch.testing.assert_close(
                got, want, **TOL, msg=lambda m: f"rank {rank} norm {norm_type} step {step}: {m}"
            )
            assert want > 0.05
        _same_weights(spanned, reference, f"rank {rank} pipeline norm {norm_type}")

    # the plain torch call sees one stage: refused before it scales anything, however it was imported
    spanned.zero_grad()
    spanned.train_step(x, y, nn.MSELoss())
    before = [p.grad.clone() for p in spanned.parameters() if p.grad is not None]
    grads = lambda: [p.grad for p in spanned.parameters() if p.grad is not None]  # noqa: E731
    refused = (
        lambda: torch.nn.utils.clip_grad_norm_(spanned.parameters(), 0.05),
        lambda: imported_clip(spanned.parameters(), 0.05),
        lambda: torch.nn.utils.clip_grad_norm_(spanned.parameters(), 0.05, foreach=True),
        lambda: torch.nn.utils.clip_grad_norm_(
            [*nn.Linear(2, 2).parameters(), *spanned.parameters()], 0.05
        ),  # not first
    )
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: one stage's norm, the same mistake
        refused += (lambda: torch.nn.utils.get_total_norm(grads()),)
    for clip in refused:
        with pytest.raises(
            RuntimeError,
            match=rf"on rank {rank} .* stage {rank} of a 2-stage .*spanned\.clip_grad_norm_\(max_norm, "
            r"norm_type\)",
        ):
            clip()
    after = [p.grad for p in spanned.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), (
        f"rank {rank}: a refused clip scaled gradients"
    )
    torch.nn.utils.clip_grad_value_(spanned.parameters(), 0.01)  # elementwise: right on a stage, not refused
    torch.nn.utils.clip_grad_norm_(nn.Linear(2, 2).parameters(), 1.0)  # other parameters: not refused

    # error_if_nonfinite: the same error on every rank (the total is), nothing clipped
    if rank == 0:
        spanned.module[0].weight.grad[0, 0] = math.nan
    with pytest.raises(RuntimeError, match="non-finite"):
        spanned.clip_grad_norm_(1.0, error_if_nonfinite=True)


def _tied_part(rank: int, ids: torch.Tensor, tokens: torch.Tensor, make, balance) -> None:
    """A weight tied across the two ranks counts once in the norm; both copies are clipped alike."""
    model = make()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, balance=balance, microbatches=3)
    opt, ref_opt = (
        torch.optim.SGD(spanned.parameters(), lr=0.5),
        torch.optim.SGD(reference.parameters(), lr=0.5),
    )
    for step in range(2):
        got, want = _train_clip_step(
            spanned, reference, opt, ref_opt, ids, tokens, _ce, 0.05, 2.0, loss_reduction="mean"
        )
        torch.testing.assert_close(
            got, want, **TOL, msg=lambda m: f"rank {rank} {spanned.mode} step {step}: {m}"
        )
    _same_weights(spanned, reference, f"rank {rank} tied {spanned.mode}")
    weight = spanned.module.embed.weight
    assert weight.device.type != "meta"  # both ranks hold the tie
    copies = [torch.empty_like(weight) for _ in range(2)]
    torch.distributed.all_gather(copies, weight.detach())
    assert torch.equal(copies[0], copies[1]), "the tied weight's copies drifted apart"


def _data_parallel_part(rank: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Every replica holds the summed gradient: both clips are right; uneven shards (5 + 2 rows)."""
    rows = slice(0, 5) if rank == 0 else slice(5, 7)
    for use_torch in (False, True):
        model = _seq()
        reference = copy.deepcopy(model)
        spanned = torchspan.span(model)
        assert spanned.mode == "data-parallel"
        opt, ref_opt = (
            torch.optim.SGD(spanned.parameters(), lr=0.5),
            torch.optim.SGD(reference.parameters(), lr=0.5),
        )
        for step in range(2):
            opt.zero_grad()
            ref_opt.zero_grad()
            spanned.train_step(x[rows], y[rows], nn.MSELoss())
            clip = (
                (lambda c: torch.nn.utils.clip_grad_norm_(spanned.parameters(), c))
                if use_torch
                else spanned.clip_grad_norm_
            )
            got = clip(0.05)
            nn.MSELoss()(reference(x), y).backward()
            want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            torch.testing.assert_close(
                got, want, **TOL, msg=lambda m: f"rank {rank} data parallel step {step}: {m}"
            )
            opt.step()
            ref_opt.step()
        _same_weights(spanned, reference, f"rank {rank} data parallel (torch's clip: {use_torch})")


def _clip_worker(rank: int, world: int, port: int) -> None:
    _join(rank, world, port)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64)
    y = torch.randn(7, 4, generator=g, dtype=torch.float64)
    ids, tokens = torch.randint(0, 11, (7, 3), generator=g), torch.randint(0, 11, (7, 3), generator=g)
    _pipeline_part(rank, x, y)
    _tied_part(rank, ids, tokens, TiedLM, [2, 1])  # fx stage functions
    _data_parallel_part(rank, x, y)
    _tied_part(rank, ids, tokens, Blocks, [3, 3])  # the model's own forward on every rank
    _leave()


@pytest.mark.slow
def test_clip_across_two_ranks_matches_one_device() -> None:
    _spawn(_clip_worker, 2, free_port(), deadline=240.0)


def _hybrid_worker(rank: int, world: int, port: int) -> None:
    _join(rank, world, port)
    replica = rank // 2
    g = torch.Generator().manual_seed(8)
    ids, tokens = torch.randint(0, 11, (7, 3), generator=g), torch.randint(0, 11, (7, 3), generator=g)
    model = TiedLM()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, balance=[2, 1], microbatches=2)
    opt, ref_opt = (
        torch.optim.SGD(spanned.parameters(), lr=0.5),
        torch.optim.SGD(reference.parameters(), lr=0.5),
    )
    ids_s, tok_s = shard_batch((ids, tokens), replica, 2)  # 4 + 3 rows
    for step in range(2):
        got, want = _train_clip_step(
            spanned,
            reference,
            opt,
            ref_opt,
            ids_s,
            tok_s,
            _ce,
            0.05,
            2.0,
            ref_inputs=ids,
            ref_target=tokens,
            loss_reduction="mean",
        )
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank} hybrid step {step}: {m}")
    _same_weights(spanned, reference, f"rank {rank} hybrid")
    _leave()


@pytest.mark.slow
def test_clip_in_a_two_by_two_hybrid_matches_one_device() -> None:
    _spawn(_hybrid_worker, 4, free_port(), deadline=240.0)

"""The own-forward rank pipeline's forward messages: one slot per (micro-batch, message), headers predicted
from the step before, receives posted early when the stage before runs its forwards first.

A user's wrapper whose forward sends one value across the cut, or two (a skip connection switched on by a
keyword argument), trains exactly on 2 gloo ranks while the number and the shapes of its messages change
from step to step: a slot an earlier step used and this one does not is closed on both sides (``close`` /
``drain``), so a receive posted early for it never waits and never takes another step's message. The
transport itself refuses a slot the sender closed where the receiver waits for a value (``Diverged``). A
layer whose forward was patched on the instance keeps its patch after a step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_ranks_hooks import _join, _leave
from test_ranks_pipeline import TOL, _check, _spawn
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port, p2p
from torchspan.runtime.ranks.forwardstate import Shortcut
from torchspan.runtime.ranks.mesh import Mesh


class Mix(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.tanh(self.lin(h))
        return out if extra is None else out + extra


class Skips(nn.Module):
    """``depth`` blocks in a ModuleList; with ``skip`` the first block's output also feeds the last block."""

    def __init__(self, width: int = 6, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Mix(width) for _ in range(depth)]).double()

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        h0 = self.blocks[0](x)
        h = h0
        for block in self.blocks[1:-1]:
            h = block(h)
        return self.blocks[-1](h, h0 if skip else None)


def _double(block: Mix) -> None:
    def doubled(h: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        return 2 * Mix.forward(block, h, extra)

    block.forward = doubled


def _kind(tag: int) -> str:
    """The message kind a tag of ``p2p.tag`` belongs to."""
    return next(kind for kind, k in p2p.TAGS.items() if tag % len(p2p.TAGS) == k)


def _counting() -> tuple[list[int], object]:
    """``dist.irecv`` counting the early receives of forward values (the tags of each step's loss in
    ``_LOSS_TAGS``)."""
    posted: list[int] = []
    irecv = p2p.dist.irecv

    def counted(*args: object, **kwargs: object) -> object:
        kind = _kind(int(kwargs["tag"]))  # type: ignore[call-overload]
        if kind == "own-loss":
            _LOSS_TAGS.append(int(kwargs["tag"]))  # type: ignore[call-overload]
        else:
            posted.append(1)
        return irecv(*args, **kwargs)

    return posted, counted


_LOSS_TAGS: list[int] = []


def _worker(rank: int, world: int, port: int) -> None:
    _join(rank, world, port)
    posted, counted = _counting()
    irecv = p2p.dist.irecv
    for schedule in ("merged-weights", "1f1b"):
        model = Skips()
        reference = copy.deepcopy(model)
        for m in (
            model,
            reference,
        ):  # a forward patched on the instance (as hooks libraries do) stays the model's
            _double(m.blocks[3])
        spanned = torchspan.span(model, balance=[2, 2], microbatches=3, schedule=schedule)
        transport = spanned._executor._transport
        # (skip, rows): two messages per micro-batch, the same again, one (the second slot closed), two again
        # (its header sent anew), then other micro-batch sizes (every header changes)
        steps = [(True, 5), (True, 5), (False, 5), (True, 5), (True, 7)]
        early_counts = []
        for step, (skip, rows) in enumerate(steps):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(rows, 6, generator=g).double(), torch.randn(rows, 6, generator=g).double()
            for p in [*spanned.module.parameters(), *reference.parameters()]:
                p.grad = None
            posted.clear()
            p2p.dist.irecv = counted
            try:
                loss = spanned.train_step({"x": x, "skip": skip}, y, nn.MSELoss())
            finally:
                p2p.dist.irecv = irecv
            early_counts.append(len(posted))
            expected = nn.MSELoss()(reference(x, skip=skip), y)
            expected.backward()
            label = f"{schedule} step {step} (skip={skip}, {rows} rows)"
            torch.testing.assert_close(
                loss.double(), expected.detach(), rtol=1e-6, atol=1e-7, msg=lambda m: f"{label}: {m}"
            )
            _check(spanned, reference, label, rank)
            assert not transport._early, f"{label}: receives left posted"
            assert model.blocks[3].__dict__.get("forward") is not None, (
                f"{label}: the patched forward was dropped"
            )
            with torch.no_grad():  # a no-grad forward between steps keeps its own slots ("own-eval")
                torch.testing.assert_close(
                    spanned(x[:4], skip=not skip), reference(x[:4], skip=not skip), **TOL
                )
        if schedule == "merged-weights" and rank == 1:  # 3 micro-batches x the slots the step before used
            assert early_counts == [0, 6, 6, 3, 6], early_counts
        else:  # stage 0 receives no forward values; under 1F1B nothing is posted ahead
            assert early_counts == [0, 0, 0, 0, 0], (schedule, rank, early_counts)
        # stage 0 posts the receive of each step's loss early, on a tag of its own for every step
        assert len(_LOSS_TAGS) == (len(steps) if rank == 0 else 0) == len(set(_LOSS_TAGS)), (
            schedule,
            rank,
            _LOSS_TAGS,
        )
        _LOSS_TAGS.clear()
        _eval_mode_step(spanned, model, reference, rank, schedule)
        _loss_received_early(spanned, reference, rank, schedule)
    _closed_slot_is_refused(rank)
    _leave()


def _loss_received_early(spanned: torchspan.Spanned, reference: nn.Module, rank: int, schedule: str) -> None:
    """Stage 0 posts the receive of the step's loss at its first backward, before it takes the last stage's
    gradients: the loss, sent after the last backward, lands while stage 0 still computes (a receive posted
    after the send waits a round trip of gloo's threads at the end of the step)."""
    seen: list[tuple[str, str]] = []
    irecv, recv = p2p.dist.irecv, p2p.dist.recv

    def logged(op: str, fn: object) -> object:
        def call(*args: object, **kwargs: object) -> object:
            seen.append((op, _kind(int(kwargs["tag"]))))  # type: ignore[call-overload]
            return fn(*args, **kwargs)  # type: ignore[operator]

        return call

    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(6, 6, generator=g).double(), torch.randn(6, 6, generator=g).double()
    for p in [*spanned.module.parameters(), *reference.parameters()]:
        p.grad = None
    p2p.dist.irecv, p2p.dist.recv = logged("irecv", irecv), logged("recv", recv)
    try:
        loss = spanned.train_step({"x": x, "skip": True}, y, nn.MSELoss())
    finally:
        p2p.dist.irecv, p2p.dist.recv = irecv, recv
    expected = nn.MSELoss()(reference(x, skip=True), y)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-6, atol=1e-7)
    _check(spanned, reference, f"{schedule}, the loss received early", rank)
    if rank == 0:
        gradients = [i for i, (op, kind) in enumerate(seen) if op == "recv" and kind == "own-bwd"]
        assert seen.count(("irecv", "own-loss")) == 1 and gradients, seen
        assert seen.index(("irecv", "own-loss")) < gradients[-1], seen
    else:
        assert not any(kind == "own-loss" for _, kind in seen), seen


def _eval_mode_step(
    spanned: torchspan.Spanned, model: nn.Module, reference: nn.Module, rank: int, schedule: str
) -> None:
    """On a known path the last stage replays stage 0's blocks by their shortcuts (``forwardstate.Shortcut``);
    in eval mode (another training flag) the first micro-batch takes the long way again, and every step stays
    exact."""
    taken: list[bool] = []
    take = Shortcut.take

    def counted(self: Shortcut, *args: object) -> object:
        out = take(self, *args)
        taken.append(out is not None)
        return out

    g = torch.Generator().manual_seed(99)
    x, y = torch.randn(6, 6, generator=g).double(), torch.randn(6, 6, generator=g).double()
    hits = []
    for mode in ("train", "train", "eval", "eval"):
        for m in (model, reference):
            m.train(mode == "train")
            for p in m.parameters():
                p.grad = None
        taken.clear()
        Shortcut.take = counted  # type: ignore[method-assign]
        try:
            spanned.train_step({"x": x, "skip": False}, y, nn.MSELoss())
        finally:
            Shortcut.take = take  # type: ignore[method-assign]
        hits.append(sum(taken))
        nn.MSELoss()(reference(x), y).backward()
        _check(spanned, reference, f"{schedule}, {mode} mode", rank)
    for m in (model, reference):
        m.train()
    if (
        rank == 1
    ):  # blocks 0 and 1 of 3 micro-batches: all by shortcut once warm, but the first eval micro-batch's
        assert hits[1:] == [6, 4, 6], hits
    else:  # stage 0 sends at its first call of stage 1's blocks, and the last one takes None: no shortcut
        assert hits == [0, 0, 0, 0], hits


def _three_stages(rank: int, world: int, port: int) -> None:
    """Three ranks: with ``skip`` stage 0's value crosses two cuts to stage 2, which posts the receives of
    both earlier stages (both run their forwards first under merged-weights) and stays exact as the path
    changes."""
    _join(rank, world, port)
    posted, counted = _counting()
    irecv = p2p.dist.irecv
    model = Skips(depth=6)
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, balance=[2, 2, 2], microbatches=3, schedule="merged-weights")
    early_counts = []
    for step, skip in enumerate((True, True, False, True)):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(5, 6, generator=g).double(), torch.randn(5, 6, generator=g).double()
        for p in [*spanned.module.parameters(), *reference.parameters()]:
            p.grad = None
        posted.clear()
        p2p.dist.irecv = counted
        try:
            spanned.train_step({"x": x, "skip": skip}, y, nn.MSELoss())
        finally:
            p2p.dist.irecv = irecv
        early_counts.append(len(posted))
        nn.MSELoss()(reference(x, skip=skip), y).backward()
        _check(spanned, reference, f"3 stages, step {step} (skip={skip})", rank)
    # stage 1 takes one value per micro-batch from stage 0; stage 2 one from stage 1, and with skip one from
    # stage 0
    want = {0: [0, 0, 0, 0], 1: [0, 3, 3, 3], 2: [0, 6, 6, 3]}[rank]
    assert early_counts == want, (rank, early_counts)
    _leave()


def test_a_value_crossing_two_cuts_is_received_early_on_three_ranks() -> None:
    _spawn(_three_stages, 3, free_port(), deadline=180.0)


def _closed_slot_is_refused(rank: int) -> None:
    """Rank 0 sends slot (mb 0, message 0), then closes it in the next step: rank 1 waiting for a value there
    gets ``Diverged`` (not a hang, not another step's bytes)."""
    transport = p2p.RankTransport(Mesh(stages=2, replicas=1), rank, torch.device("cpu"))
    if rank == 0:
        transport.send([torch.ones(3)], None, 0, 1, "own-fwd", 0, 0)
        transport.finish(True)
        transport.close(1, "own-fwd", 0, 0)
        transport.finish(True)
        assert not transport._sent
    else:
        values, _ = transport.receive(0, 1, "own-fwd", 0, 0)
        torch.testing.assert_close(values[0], torch.ones(3))
        with pytest.raises(p2p.Diverged, match="which sent none"):
            transport.receive(0, 1, "own-fwd", 0, 0)
        assert not transport._received
        transport.finish(False)


def test_own_forward_messages_change_in_number_and_shape_between_steps_and_are_received_early() -> None:
    _spawn(_worker, 2, free_port(), deadline=180.0)


def test_tags_keep_kinds_micro_batches_and_messages_apart() -> None:
    tags = {p2p.tag(kind, mb, seq) for kind in p2p.TAGS for mb in range(5) for seq in range(3)}
    assert len(tags) == len(p2p.TAGS) * 5 * 3
    assert not tags & {p2p.tag(kind) for kind in p2p.TAGS}  # the raw messages' tags
    with pytest.raises(ValueError, match="at most 4096 micro-batches"):
        p2p.tag("own-fwd", 4096)
    # one loss tag per training step, distinct for 4096 * 87000 steps, every one an int32
    steps = [0, 1, 4095, 4096, 4097, 10**6, 4096 * 87_000 - 1]
    loss_tags = [p2p.tag("own-loss", *p2p.step_slot(s)) for s in steps]
    assert len(set(loss_tags)) == len(steps) and max(loss_tags) < 2**31
    assert p2p.step_slot(4096 * 87_000) == p2p.step_slot(0)

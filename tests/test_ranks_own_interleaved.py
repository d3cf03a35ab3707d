"""Interleaved 1F1B for the model's own forward with several stages per rank, across 2 gloo ranks.

GPT-2 and a GQA Llama (tied embedding and head: stages 0 and 3, on ranks 0 and 1) with 4 stages on 2 ranks
and ``schedule="interleaved-1f1b"``: each rank runs its actions in Megatron's order (micro-batch 1 through
rank 0's chunk 0 before micro-batch 0 reaches its chunk 1), each micro-batch's forward paused between a
rank's chunks. Every rank's gradients and the loss equal one device's (float64) at every step, 7 rows in 4
uneven micro-batches; a step with shapes no earlier step had runs in the common 1F1B order (it records the
forward's routes with every rank), the next one with those shapes interleaved, as the timeline shows; one
whose forward takes a new path (a padding mask first seen) is refused on every rank at once. In process: the
hand-off of the micro-batches' threads (order, a failure raised in the main thread, a stopped step
unwinding), and interleaved 1F1B in one process (the threads taking Megatron's turns per worker).
"""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace

import pytest
import torch
from test_ranks_cuts import _gpt2, _inputs, _join, _leave, shifted_mean, step_like_one_device
from test_ranks_own_looped import _llama
from test_ranks_pipeline import TOL, _spawn

import torchspan
from torchspan import schedule as sched
from torchspan.runtime.ranks import free_port
from torchspan.runtime.ranks.owninterleaved import Turns, interleaved_plan
from torchspan.runtime.ranks.ownlooped import check_looped, common_plan
from torchspan.runtime.ranks.routes import DivergedError

transformers = pytest.importorskip("transformers")

_LENGTHS = (6, 6, 5, 5)  # a new sequence length records in the common order, the next step interleaves


def _order(spanned: torchspan.Spanned) -> list[tuple[int, int, str]]:
    return [(e.stage, e.microbatch, e.kind) for e in spanned.timeline() if e.kind in ("forward", "backward")]


def _steps(
    make, balance: list[int], label: str, rank: int, m: int = 4, rows: int = 7, lengths=_LENGTHS
) -> None:
    model = make()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, balance=balance, microbatches=m, schedule="interleaved-1f1b")
    for step, length in enumerate(lengths):
        inputs, labels = _inputs(20 + step, rows, length, False)  # uneven: 7 rows in 4 micro-batches
        step_like_one_device(spanned, reference, inputs, labels, f"{label} step {step}", rank)
        interleaved = step > 0 and length == lengths[step - 1]
        plan = interleaved_plan(m, 4, 2) if interleaved else common_plan("interleaved-1f1b", m, 2)
        order = _order(spanned)
        assert order == [(a.stage, a.microbatch, a.kind) for a in plan[rank]], (label, step, order)
        if interleaved and rank == 0:  # micro-batch 1's chunk 0 before micro-batch 0's chunk 1 (stage 2)
            assert order.index((0, 1, "forward")) < order.index((2, 0, "forward")), order
    with torch.no_grad():
        inputs, _ = _inputs(30, 5, 6, False)
        torch.testing.assert_close(spanned(**inputs).logits, reference(**inputs).logits, **TOL)


def _new_path_refused() -> None:
    """An attention mask with padding after steps without: its forward takes a path no step recorded, in an
    interleaved step; every rank raises at once (none waits for another)."""
    spanned = torchspan.span(_gpt2(), balance=[2, 2, 2, 2], microbatches=2, schedule="interleaved-1f1b")
    ids = torch.randint(3, 40, (4, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 6, dtype=torch.long)
    for _ in range(2):  # the first records in the common order, the second interleaves
        spanned.train_step({"input_ids": ids, "attention_mask": mask}, ids, shifted_mean)
    mask[3, -2:] = 0
    with pytest.raises(DivergedError, match="took a path at layer .* pass schedule='1f1b'"):
        spanned.train_step({"input_ids": ids, "attention_mask": mask}, ids, shifted_mean)


def _worker(rank: int, world: int, port: int) -> None:
    _join(rank, world, port)
    _steps(_gpt2, [2, 2, 2, 2], "gpt2 interleaved", rank)
    # 2 micro-batches: rank 0 runs all its forwards first (the receives of rank 1 posted at its first one)
    _steps(_gpt2, [2, 2, 2, 2], "gpt2 interleaved, 2 micro-batches", rank, m=2, rows=5, lengths=(6, 6))
    _steps(_llama, [1, 2, 2, 2], "llama interleaved", rank)  # the rotary embedding on rank 1, read by rank 0
    _new_path_refused()
    with pytest.raises(ValueError, match=r"microbatches=3 is not a multiple of 2"):
        torchspan.span(_gpt2(), balance=[2, 2, 2, 2], microbatches=3, schedule="interleaved-1f1b")
    _leave()


@pytest.mark.slow
def test_interleaved_own_forward_four_stages_on_two_ranks_match_one_device() -> None:
    _spawn(_worker, 2, free_port(), deadline=400.0)


def test_plan_is_megatrons_order_per_rank_and_checked() -> None:
    plan = interleaved_plan(4, 4, 2)
    forwards = [(a.stage, a.microbatch) for a in plan[0] if a.kind == "forward"]
    assert forwards[:4] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert sorted({a.stage for a in plan[1]}) == [1, 3] and len(plan[1]) == 16
    check_looped(4, 2, "interleaved-1f1b", None, False, 4)
    with pytest.raises(ValueError, match="microbatches=3 is not a multiple of 2; pass microbatches=2 or 4"):
        check_looped(4, 2, "interleaved-1f1b", None, False, 3)


def _record(log: list[str], fail_at: str | None = None):
    """A micro-batch's 'forward': layers a (chunk 0) and b (chunk 1), logged as they run."""

    def job(turn) -> None:
        st = SimpleNamespace(sent=[], inbound=[])
        try:
            for name in ("a", "b"):
                turn.reach(st, name)
                if name == fail_at:
                    raise KeyError(f"{name}{turn.mb}")
                log.append(f"{name}{turn.mb}")
        finally:
            log.append(f"end{turn.mb}")

    return job


def test_turns_hand_off_between_micro_batches_in_the_schedules_order() -> None:
    log: list[str] = []
    turns, job = Turns({"a": 0, "b": 1}), _record(log)
    for mb, chunk in ((0, 0), (1, 0), (0, 1), (1, 1)):
        turns.forward(mb, chunk, job)
    assert log == ["a0", "a1", "b0", "end0", "b1", "end1"]
    turns.close()
    # a failure in a micro-batch's thread is raised by the action that ran it; a stopped step unwinds the
    # paused forwards and ends every thread
    log.clear()
    turns, job = Turns({"a": 0, "b": 1}), _record(log, fail_at="b")
    turns.forward(0, 0, job)
    turns.forward(1, 0, job)
    with pytest.raises(KeyError, match="b0"):
        turns.forward(0, 1, job)
    turns.close()
    assert log == ["a0", "a1", "end0", "end1"]
    assert not [t for t in threading.enumerate() if t.name.startswith("torchspan-own-microbatch")]


def test_interleaved_own_forward_in_one_process_is_exact_in_megatrons_order() -> None:
    """In one process the micro-batches' threads take Megatron's turns per worker: 4 stages on one CPU worker,
    micro-batch 1's forward between micro-batch 0's backward stages, gradients equal one device's."""
    model = _gpt2()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(
        model, devices=["cpu"] * 4, balance=[2, 2, 2, 2], microbatches=4, schedule="interleaved-1f1b"
    )
    assert spanned.mode == "own-forward"
    inputs, labels = _inputs(21, 7, 6, False)
    step_like_one_device(spanned, reference, inputs, labels, "one process", 0)
    order = sorted(
        (e for e in spanned.timeline() if e.kind in ("forward", "backward")), key=lambda e: e.start
    )
    plan = sched.merged_order(sched.build("interleaved-1f1b", 4, 4, 1), [0, 1, 2, 3])
    assert [(e.stage, e.microbatch, e.kind) for e in order] == [(a.stage, a.microbatch, a.kind) for a in plan]

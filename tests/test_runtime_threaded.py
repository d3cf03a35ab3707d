"""The threaded executor: the model's own forward, one thread per micro-batch, turns per stage.

Exact gradients against one device (uneven micro-batches: 7 samples in 3), the schedule's order
on every stage (forward and, on CPU, backward), overlap in the timeline, errors from any thread
re-raised without hanging, and the turn-taking pieces on their own.
"""

from __future__ import annotations

import copy
import threading
import warnings
from typing import Any

import pytest
import torch
from test_runtime_parity import assert_catches_wrong_grads
from torch import nn

import torchspan
from torchspan import schedule as sched
from torchspan.parity import grad_differences
from torchspan.runtime.executor import Settings
from torchspan.runtime.local.threaded import OwnForwardExecutor
from torchspan.runtime.local.turns import Flow, OrderError, Turns, orders
from torchspan.runtime.local.worker import Aborted, Mailbox
from torchspan.runtime.memory import ActivationMeter
from torchspan.runtime.record import Recorder

CPU4 = ["cpu"] * 4


class Chain(nn.Module):
    """Not fx-traceable (data-dependent branch); four top-level layers; fails on request."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)
        self.d = nn.Linear(16, 2)
        self.fail_on: float | None = None  # an input value that makes layer c raise (forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if h.abs().sum() > 1e9:  # never: only there to defeat torch.fx
            h = h * 0
        h = torch.tanh(self.b(h))
        if self.fail_on is not None and bool((x == self.fail_on).any()):
            raise RuntimeError("layer c refuses this micro-batch")
        return self.d(torch.tanh(self.c(h)))


def _chain() -> Chain:
    torch.manual_seed(0)
    return Chain()


def _same_grads(model: nn.Module, ref: nn.Module) -> None:
    assert not [n for n, p in model.named_parameters() if p.grad is None], "parameters without a gradient"
    bad = [d for d in grad_differences(model, ref, atol=1e-6, rtol=1e-5) if not d.within]
    assert not bad, "\n".join(f"{d.name}: {d.max_abs:.3e}" for d in bad)


def _stage_orders(events: list[Any], stages: int) -> list[list[tuple[str, int]]]:
    return [
        [(e.kind, e.microbatch) for e in sorted(events, key=lambda e: e.start) if e.stage == s]
        for s in range(stages)
    ]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("recompute", ["never", "except_last", "always"])
def test_parity_and_the_schedule_order_on_every_stage(schedule: str, recompute: str) -> None:
    model = _chain()
    x, y = torch.randn(7, 5), torch.randn(7, 2)
    ref = copy.deepcopy(model)
    nn.functional.mse_loss(ref(x), y).backward()
    spanned = torchspan.span(model, devices=CPU4, microbatches=3, schedule=schedule, recompute=recompute)
    assert spanned.mode == "own-forward" and spanned.stages == [("cpu", [n]) for n in "abcd"]
    loss = spanned.train_step(x, y, nn.functional.mse_loss)
    torch.testing.assert_close(loss, nn.functional.mse_loss(ref(x), y).detach())
    _same_grads(model, ref)
    # one forward and one backward block per (stage, micro-batch), in the schedule's order on each stage
    want = [[(a.kind, a.microbatch) for a in stage] for stage in sched.build(schedule, 3, 4)]
    assert _stage_orders(spanned.timeline(), 4) == want


def test_workers_per_stage_overlap_and_keep_exact_gradients() -> None:
    model = _chain()
    x, y = torch.randn(7, 5), torch.randn(7, 2)
    ref = copy.deepcopy(model)
    nn.functional.mse_loss(ref(x), y).backward()
    spanned = torchspan.span(model, devices=CPU4, microbatches=3, schedule="1f1b", workers="stage")
    spanned.train_step(x, y, nn.functional.mse_loss)
    _same_grads(model, ref)
    assert _stage_orders(spanned.timeline(), 4) == [
        [(a.kind, a.microbatch) for a in st] for st in sched.one_f_one_b(3, 4)
    ]


def test_gpt2_blocks_tied_embedding_exact_and_micro_batch_1_enters_before_0_reaches_the_end() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=4,
        n_embd=32,
        n_head=2,
        vocab_size=50,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 50, (7, 8), generator=torch.Generator().manual_seed(1))

    def lm_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits.reshape(-1, 50), labels.reshape(-1))

    ref_loss = lm_loss(ref(input_ids=ids), ids)
    ref_loss.backward()
    spanned = torchspan.span(model, devices=CPU4, microbatches=3, schedule="1f1b")
    assert spanned.mode == "own-forward"
    loss = spanned.train_step({"input_ids": ids}, ids, lm_loss)
    torch.testing.assert_close(loss, ref_loss.detach())
    assert (
        model.lm_head.weight is model.transformer.wte.weight
    )  # still one tied parameter, its gradient from both uses
    _same_grads(model, ref)
    stages = [g for _, g in spanned.stages]
    assert stages[1][0].startswith("transformer.h.") and stages[-1][-1] == "lm_head"
    fwd = {(e.stage, e.microbatch): e for e in spanned.timeline() if e.kind == "forward"}
    assert len(fwd) == 4 * 3
    assert (
        fwd[(0, 1)].start < fwd[(3, 0)].start
    )  # micro-batch 1 runs stage 0 before micro-batch 0 reaches the last stage
    assert all(p > 0 for p in [r["activations"] for r in spanned.memory()])  # the meter saw every stage


def test_forward_call_outputs_match_and_backward_through_them_is_exact() -> None:
    model = _chain()
    x = torch.randn(7, 5)
    ref = copy.deepcopy(model)
    want = ref(x)
    want.sum().backward()
    spanned = torchspan.span(model, devices=CPU4, microbatches=3)
    out = spanned(x)
    torch.testing.assert_close(out, want.detach())
    assert _stage_orders(spanned.timeline(), 4) == [[("forward", i) for i in range(3)]] * 4
    out.sum().backward()  # the turn hooks are forward-only here: nothing waits in this backward
    _same_grads(model, ref)


def test_unordered_backward_path_as_on_gpus_stays_exact() -> None:
    """Where autograd runs backward on device threads only the start of each backward takes turns."""
    model = _chain()
    x, y = torch.randn(7, 5), torch.randn(7, 2)
    ref = copy.deepcopy(model)
    nn.functional.mse_loss(ref(x), y).backward()
    spanned = torchspan.span(model, devices=CPU4, microbatches=3, schedule="gpipe")
    spanned._executor.ordered_backward = False  # what a GPU stage sets
    spanned.train_step(x, y, nn.functional.mse_loss)
    _same_grads(model, ref)
    events = spanned.timeline()
    starts = sorted((e.start, e.microbatch) for e in events if e.kind == "backward" and e.stage == 3)
    last_forward = max(e.end for e in events if e.kind == "forward" and e.stage == 3)
    assert [mb for _, mb in starts] == [0, 1, 2] and starts[0][
        0
    ] >= last_forward  # gpipe: backwards after all forwards


def test_bf16_autocast_per_stage_inside_each_thread() -> None:
    model = _chain()
    x, y = torch.randn(8, 5), torch.randn(8, 2)
    ref, ref32 = copy.deepcopy(model), copy.deepcopy(model)
    for xm, ym in zip(x.tensor_split(2), y.tensor_split(2)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (nn.functional.mse_loss(ref(xm), ym) * 0.5).backward()
    nn.functional.mse_loss(ref32(x), y).backward()
    spanned = torchspan.span(model, devices=CPU4, microbatches=2, precision="bf16")
    spanned.train_step(x, y, nn.functional.mse_loss)
    # exact: each thread autocasts the same micro-batch's ops as one device does (measured: max |diff| 0 over
    # 20 seeds; atol=1e-2, rtol=2e-2 before, which passed with a.bias's gradient zeroed, or a.*, b.*,
    # c.weight's times 0.8)

    def exact() -> None:
        bad = [d for d in grad_differences(model, ref, atol=0.0, rtol=0.0) if not d.within]
        assert not bad, "\n".join(f"{d.name}: {d.max_abs:.3e}" for d in bad)

    assert_catches_wrong_grads(model, exact)
    assert not all(
        d.within for d in grad_differences(model, ref32, atol=1e-5, rtol=1e-4)
    )  # autocast ran in the threads


def test_an_error_in_one_micro_batch_is_raised_here_with_where_and_never_hangs() -> None:
    model = _chain()
    x, y = torch.randn(7, 5), torch.randn(7, 2)
    x[5, 0] = 123.0  # in micro-batch 2 (rows 5-6)
    model.fail_on = 123.0
    spanned = torchspan.span(model, devices=CPU4, microbatches=3, schedule="1f1b")
    with pytest.raises(RuntimeError, match="layer c refuses") as info:
        spanned.train_step(x, y, nn.functional.mse_loss)
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "micro-batch 2" in notes and "forward" in notes
    assert threading.active_count() < 5  # every micro-batch thread has stopped
    model.fail_on = None
    spanned.train_step(x, y, nn.functional.mse_loss)  # the next step runs normally


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("backward of stage 1 failed")


def test_an_error_in_backward_releases_the_other_threads() -> None:
    model = _chain()
    original = model.b.forward
    model.b.forward = lambda h: _FailBackward.apply(original(h))  # type: ignore[method-assign]
    spanned = torchspan.span(model, devices=CPU4, microbatches=3, schedule="gpipe")
    with pytest.raises(ValueError, match="backward of stage 1 failed"):
        spanned.train_step(torch.randn(7, 5), torch.randn(7, 2), nn.functional.mse_loss)


def test_stages_against_execution_order_are_refused_by_name() -> None:
    model = _chain()
    st = Settings(2, "gpipe", "never", "32")
    ex = OwnForwardExecutor(
        model,
        [torch.device("cpu")] * 2,
        [["c", "d"], ["a", "b"]],
        st,
        Recorder(),
        ActivationMeter(2),
        balance_given=False,
    )
    work = ex.prepare((torch.randn(4, 5),), {})
    ex.place(work)
    with pytest.raises(OrderError, match="layer 'c' of stage 0 after stage 1"):
        ex.forward(work)


def test_span_keeps_hook_placement_where_threads_cannot_and_says_why() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one = torchspan.span(_chain(), devices=["cpu", "cpu"], microbatches=1)
        meta = torchspan.span(_chain(), devices=["meta", "cpu"], microbatches=2, recompute="always")
    assert one.mode == meta.mode == "own-forward-serial"
    text = [str(w.message) for w in caught]
    assert any("microbatches > 1" in t for t in text)
    assert any("recompute='always' with a non-CPU stage" in t for t in text)
    assert OwnForwardExecutor.unsupported([torch.device("meta"), torch.device("cpu")], 2, "never") == ""


# ---------------------------------------------------------------------- turns on their own
def test_orders_merge_stages_sharing_a_worker_by_clock() -> None:
    plan = sched.gpipe(2, 2)
    (merged,) = orders(plan, [[0, 1]])
    assert [(a.kind[0], a.stage, a.microbatch) for a in merged] == [
        ("f", 0, 0),
        ("f", 0, 1),
        ("f", 1, 0),
        ("f", 1, 1),
        ("b", 1, 0),
        ("b", 0, 0),
        ("b", 1, 1),
        ("b", 0, 1),
    ]
    start = orders(plan, [[0], [1]], backward="start")
    assert [a.kind for a in start[0]] == ["forward", "forward"] and [a.kind for a in start[1]][-2:] == [
        "backward"
    ] * 2
    with pytest.raises(ValueError, match="backward='some'"):
        orders(plan, [[0]], backward="some")


def test_a_flow_passes_through_stages_it_skips_and_an_abort_frees_waiters() -> None:
    box, rec = Mailbox(), Recorder()
    devs = [torch.device("cpu")] * 3
    turns = Turns(box, orders(sched.forward_only(2, 3), [[0], [1], [2]]))
    first = Flow(turns, "forward", 0, 3, rec, devs)
    first.go(0)
    first.go(2)  # stage 1 never runs for this micro-batch: its turn is passed on
    first.finish()
    second = Flow(turns, "forward", 1, 3, rec, devs)
    second.go(1)  # would wait forever if micro-batch 0 still held stage 1's turn
    assert [(e.stage, e.microbatch) for e in rec.events] == [(0, 0), (2, 0)]
    other = Mailbox()
    waiting = Flow(Turns(other, orders(sched.forward_only(2, 1), [[0]])), "forward", 1, 1, rec, devs[:1])
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            waiting.go(0)  # micro-batch 0 never comes: waits until the abort
        except Aborted as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    other.abort()
    t.join(timeout=10)
    assert not t.is_alive() and len(errors) == 1

"""Zero-bubble (ZB-H1): the split backward is exact, in one process and across 2 gloo ranks.

``runtime.splitgrad`` against one whole ``backward`` (bit-equal ``.grad``; the inputs' gradients too),
then ``span(..., schedule="zero-bubble")`` against one device on the whole batch (float64, uneven
micro-batches) and against 1F1B (bit-equal: the same additions in the same order).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from runtime_models import residual, residual_loss, sequential
from test_ranks_pipeline import LOSS_TOL, TiedLM, _check, _join, _leave, _seq, _spawn
from torch import nn

import torchspan
from torchspan.runtime.ranks import free_port
from torchspan.runtime.splitgrad import input_backward


@pytest.fixture(autouse=True)
def _float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


# ---------------------------------------------------------------------- the split itself
class Twice(nn.Module):
    """One Linear used twice along one path: its second use's frontier node leads to its first."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.m = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(torch.relu(self.m(self.l(x))))


class Mixed(nn.Module):
    """A parameter read by the input's path and on its own (an output term reaching no input), one unused,
    BatchNorm (input and weight gradients from one node), two inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.unused = nn.Linear(8, 8), nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8))
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.bn(self.l(x)) @ self.w + y @ self.w.t() + self.w.sum()


def _split_matches_whole(make: Callable[[], nn.Module], inputs: int, grads_before: bool) -> None:
    torch.manual_seed(0)
    whole, split = make(), None
    split = copy.deepcopy(whole)
    xs = [torch.randn(4, 8) for _ in range(inputs)]
    if grads_before:  # accumulation into existing .grad, as backward does
        for p, q in zip(whole.parameters(), split.parameters()):
            p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    a = [x.clone().requires_grad_() for x in xs]
    b = [x.clone().requires_grad_() for x in xs]
    out = whole(*a)
    g = torch.randn_like(out)
    out.backward(g)
    found, pending = input_backward([split(*b)], [g], b)
    assert pending, "nothing was left for the weight pass"
    assert all(torch.equal(f, x.grad) for f, x in zip(found, a))
    assert all(
        q.grad is None or torch.equal(q.grad, torch.ones_like(q)) for q in split.parameters()
    )  # weights untouched yet
    pending.weights()
    for (name, p), q in zip(whole.named_parameters(), split.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("grads_before", [False, True])
def test_split_backward_is_bit_equal_to_backward(grads_before: bool) -> None:
    _split_matches_whole(
        lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)),
        1,
        grads_before,
    )
    _split_matches_whole(Twice, 1, grads_before)
    _split_matches_whole(Mixed, 2, grads_before)


def test_split_of_a_loss_hooks_and_fallbacks() -> None:
    torch.manual_seed(1)
    whole = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    split = copy.deepcopy(whole)
    fired: list[str] = []
    split[0].weight.register_post_accumulate_grad_hook(lambda p: fired.append("post"))
    x = torch.randn(5, 8)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    whole(a).pow(2).sum().backward()
    found, pending = input_backward([split(b).pow(2).sum()], [None], [b])  # a scalar loss: no gradient given
    assert fired == [] and torch.equal(found[0], a.grad)
    pending.weights()
    assert fired == ["post"] and all(
        torch.equal(p.grad, q.grad) for p, q in zip(whole.parameters(), split.parameters())
    )
    # no input needing a gradient (a first stage): one whole backward now, nothing later
    for p in split.parameters():
        p.grad = None
    found, pending = input_backward([split(x).pow(2).sum()], [None], [x])
    assert (
        found == [None]
        and not pending
        and all(torch.equal(p.grad, q.grad) for p, q in zip(whole.parameters(), split.parameters()))
    )


def test_split_through_activation_checkpointing_is_exact() -> None:
    torch.manual_seed(2)
    whole = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    split = copy.deepcopy(whole)
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.utils.checkpoint.checkpoint(whole, a, use_reentrant=False).backward(g)
    found, pending = input_backward(
        [torch.utils.checkpoint.checkpoint(split, b, use_reentrant=False)], [g], [b]
    )
    pending.weights()
    assert torch.equal(found[0], a.grad) and all(
        torch.equal(p.grad, q.grad) for p, q in zip(whole.parameters(), split.parameters())
    )


# ---------------------------------------------------------------------- one process
def _train(model: nn.Module, schedule: str, **options) -> tuple[torchspan.Spanned, torch.Tensor]:
    x, y = (
        torch.randn(10, 6, generator=torch.Generator().manual_seed(3)),
        torch.randn(10, 3, generator=torch.Generator().manual_seed(4)),
    )
    spanned = torchspan.span(model, schedule=schedule, **options)
    return spanned, spanned.train_step(x, y, nn.functional.mse_loss)


@pytest.mark.parametrize("recompute", ["never", "except_last", "always"])
@pytest.mark.parametrize("devices,balance", [(["cpu", "cpu"], [3, 4]), (["cpu", "cpu", "cpu"], [2, 2, 3])])
def test_one_process_zero_bubble_is_1f1b_bit_for_bit_and_one_device(
    recompute: str, devices: list[str], balance: list[int]
) -> None:
    x, y = (
        torch.randn(10, 6, generator=torch.Generator().manual_seed(3)),
        torch.randn(10, 3, generator=torch.Generator().manual_seed(4)),
    )
    ref = sequential()
    nn.functional.mse_loss(ref(x), y).backward()
    options = dict(
        devices=devices, balance=balance, microbatches=4, recompute=recompute
    )  # 10 rows: 3, 3, 2, 2
    zb, zb_loss = _train(sequential(), "zero-bubble", **options)
    base, base_loss = _train(sequential(), "1f1b", **options)
    assert torch.equal(zb_loss, base_loss)
    for (name, p), q, r in zip(zb.module.named_parameters(), base.module.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-10, atol=1e-12)
    kinds = {e.kind for e in zb.timeline()}
    assert "backward_weight" in kinds and "backward" in kinds  # W drawn beside B


def test_one_process_zero_bubble_fx_residual_and_accumulation() -> None:
    model = residual()
    ref = copy.deepcopy(model)
    x, extra, y, mask = torch.randn(7, 6), torch.randn(7, 16), torch.randn(7, 3), torch.rand(16)
    spanned = torchspan.span(
        model, devices="cpu,cpu,cpu", balance=[1, 2, 1], microbatches=3, schedule="zero-bubble"
    )
    assert spanned.mode == "fx"
    for rows in (7, 5):  # a second step accumulates into .grad, as on one device
        spanned.train_step(
            {"x": x[:rows], "extra": extra[:rows], "mask": torchspan.runtime.NoSplit(mask), "gain": 2.0},
            y[:rows],
            residual_loss,
        )
        residual_loss(ref(x[:rows], extra[:rows], mask=mask, gain=2.0), y[:rows]).backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_one_process_zero_bubble_under_bf16_autocast_equals_1f1b() -> None:
    def make() -> nn.Module:
        return sequential().float()

    x, y = torch.randn(9, 6, dtype=torch.float32), torch.randn(9, 3, dtype=torch.float32)
    got = []
    for schedule in ("1f1b", "zero-bubble"):
        spanned = torchspan.span(
            make(),
            devices=["cpu", "cpu"],
            balance=[3, 4],
            microbatches=3,
            schedule=schedule,
            precision="bf16",
        )
        spanned.train_step(x, y, nn.functional.mse_loss)
        got.append([p.grad for p in spanned.module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*got))


def test_one_process_zero_bubble_under_fp16_and_its_scaler_equals_1f1b() -> None:
    x, y = torch.randn(8, 6, dtype=torch.float32), torch.randn(8, 3, dtype=torch.float32)
    got = []
    for schedule in ("1f1b", "zero-bubble"):
        spanned = torchspan.span(
            sequential().float(), devices=["cpu", "cpu"], microbatches=2, schedule=schedule, precision="fp16"
        )
        assert spanned.scaler is not None
        spanned.train_step(x, y, nn.functional.mse_loss)
        got.append([p.grad for p in spanned.module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*got))


# ---------------------------------------------------------------------- across ranks
def _ranks_worker(rank: int, world: int, port: int) -> None:
    _join(rank, world, port)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64)  # 7 rows in 3 micro-batches: 3 + 2 + 2
    y = torch.randn(7, 4, generator=g, dtype=torch.float64)
    for loss_fn in (nn.MSELoss(),):
        models = {s: _seq() for s in ("1f1b", "zero-bubble")}
        reference = _seq()
        spans = {s: torchspan.span(m, balance=[2, 2], microbatches=3, schedule=s) for s, m in models.items()}
        for rows in (7, 5):  # the second step accumulates
            got = {s: sp.train_step(x[:rows], y[:rows], loss_fn) for s, sp in spans.items()}
            want = loss_fn(reference(x[:rows]), y[:rows])
            want.backward()
            torch.testing.assert_close(got["zero-bubble"].double(), want.detach(), **LOSS_TOL)
            assert _check(spans["zero-bubble"], reference, f"zero-bubble {rows} rows", rank) == (
                2 if rank == 0 else 4
            )
            for (name, p), q in zip(models["zero-bubble"].named_parameters(), models["1f1b"].parameters()):
                assert (p.grad is None) == (q.grad is None) and (
                    p.grad is None or torch.equal(p.grad, q.grad)
                ), f"rank {rank}: {name}"
    tied_across_ranks(rank, g, "zero-bubble")
    _leave()


def tied_across_ranks(rank: int, g: torch.Generator, schedule: str) -> None:
    """A tied embedding/head weight across the two ranks (fx split) under ``schedule``, against one device."""
    ids = torch.randint(0, 11, (7, 3), generator=g)
    tokens = torch.randint(0, 11, (21,), generator=g)
    model = TiedLM()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, balance=[2, 1], microbatches=3, schedule=schedule)
    ce = nn.CrossEntropyLoss()
    spanned.train_step(ids, tokens.view(7, 3), lambda out, t: ce(out, t.flatten()), loss_reduction="mean")
    ce(reference(ids), tokens).backward()
    assert _check(spanned, reference, f"tied across ranks, {schedule}", rank) == (3 if rank == 0 else 1)


@pytest.mark.slow
def test_two_rank_zero_bubble_matches_one_device_and_1f1b() -> None:
    _spawn(_ranks_worker, 2, free_port(), deadline=120.0)


def _own_forward_worker(rank: int, world: int, port: int) -> None:
    from test_ranks_hooks import _llama, _train_and_compare

    _join(rank, world, port)
    _train_and_compare(
        _llama,
        "llama tied zero-bubble",
        rank,
        world,
        40,
        True,
        devices=["cpu", "cpu"],
        microbatches=3,
        schedule="zero-bubble",
    )
    grads = {}
    for schedule in ("1f1b", "zero-bubble"):
        from test_ranks_hooks import _batch, _token_ce, _tokens

        ids, labels, mask = _batch(5, 5, 7, 40)
        spanned = torchspan.span(_llama(), devices=["cpu", "cpu"], microbatches=3, schedule=schedule)
        spanned.train_step(
            {"input_ids": ids, "attention_mask": mask}, labels, _token_ce, loss_normalizer=_tokens
        )
        grads[schedule] = {n: p.grad for n, p in spanned.module.named_parameters() if not p.is_meta}
        if (
            schedule == "zero-bubble"
        ):  # stage 0 received nothing needing a gradient: its whole backward is its B
            assert ("backward_weight" in {e.kind for e in spanned.timeline()}) == (rank == 1)
    for name, gz in grads["zero-bubble"].items():
        assert torch.equal(gz, grads["1f1b"][name]), f"rank {rank}: {name}"
    _leave()


@pytest.mark.slow
def test_own_forward_llama_across_ranks_zero_bubble_matches_one_device_and_1f1b() -> None:
    pytest.importorskip("transformers")
    _spawn(_own_forward_worker, 2, free_port(), deadline=240.0)


@pytest.mark.parametrize("schedule", ["zero-bubble", "merged-weights"])
def test_own_forward_in_one_process_runs_split_schedules_as_1f1b(schedule: str) -> None:
    pytest.importorskip("transformers")
    from test_ranks_hooks import _batch, _llama, _token_ce, _tokens

    ids, labels, mask = _batch(5, 5, 7, 40)
    grads = []
    for name in ("1f1b", schedule):
        spanned = torchspan.span(_llama(), devices=["cpu", "cpu"], microbatches=3, schedule=name)
        assert spanned.mode == "own-forward"
        spanned.train_step(
            {"input_ids": ids, "attention_mask": mask}, labels, _token_ce, loss_normalizer=_tokens
        )
        grads.append([p.grad for p in spanned.module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def hybrid_runs(
    rank: int, schedule: str, llama: bool = True, after: Callable[[str, Any], None] | None = None
) -> None:
    """2 replicas x 2 stages with ``schedule`` (a joined 4-rank job): a Sequential and, with ``llama``, a tied
    Llama on uneven shards against one device on the whole batch; ``after(name, spanned)`` checks more after
    each."""
    from test_ranks_hooks import _batch, _llama, _token_ce, _tokens

    replica = rank // 2  # rank = replica * stages + stage
    g = torch.Generator().manual_seed(9)
    x, y = (
        torch.randn(7, 5, generator=g, dtype=torch.float64),
        torch.randn(7, 4, generator=g, dtype=torch.float64),
    )
    rows = slice(0, 4) if replica == 0 else slice(4, 7)  # uneven shards: 4 + 3 rows
    model, reference = _seq(), _seq()
    if after is not None:
        after("before sequential", model)  # the model, before span
    spanned = torchspan.span(model, balance=[2, 2], microbatches=2, schedule=schedule)
    loss = spanned.train_step(x[rows], y[rows], nn.MSELoss())
    want = nn.MSELoss()(reference(x), y)
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), **LOSS_TOL)
    _check(spanned, reference, f"sequential 2x2 {schedule}", rank)
    if after is not None:
        after("sequential", spanned)
    if not llama:
        return
    model = _llama()
    reference = copy.deepcopy(model)
    spanned = torchspan.span(model, devices=["cpu", "cpu"], microbatches=2, schedule=schedule)
    ids, labels, mask = _batch(5, 6, 6, 40)
    rows = slice(0, 4) if replica == 0 else slice(4, 6)
    loss = spanned.train_step(
        {"input_ids": ids[rows], "attention_mask": mask[rows]},
        labels[rows],
        _token_ce,
        loss_normalizer=_tokens,
    )
    expected = _token_ce(reference(ids, attention_mask=mask), labels)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected.detach(), **LOSS_TOL)
    _check(spanned, reference, f"llama 2x2 {schedule}", rank)
    if after is not None:
        after("llama", spanned)


def _hybrid_worker(rank: int, world: int, port: int) -> None:
    """2 replicas x 2 stages: the data-parallel reduction starts after each stage's last weight backward."""
    _join(rank, world, port)
    hybrid_runs(rank, "zero-bubble")
    _leave()


@pytest.mark.slow
def test_two_by_two_hybrid_zero_bubble_matches_one_device() -> None:
    pytest.importorskip("transformers")
    _spawn(_hybrid_worker, 4, free_port(), deadline=240.0)


# ---------------------------------------------------------------------- the planner's price
def test_cost_model_prices_the_smaller_bubble_and_the_larger_memory() -> None:
    import random

    from planner_synth import device, random_profile

    from torchspan.planner import search
    from torchspan.planner.cost import CostModel
    from torchspan.planner.stages import Stage

    gpus = [device("cuda", "gpu", None, 1e9, index=i) for i in range(2)]
    prof = random_profile(random.Random(3), 4, gpus)
    zb, base = CostModel(prof, 4, "zero-bubble", "never"), CostModel(prof, 4, "1f1b", "never")
    two = [Stage(0, 0, 2), Stage(1, 2, 4)]
    a, b = zb.evaluate(two), base.evaluate(two)
    # the first stage's trip waits for its input backward only (half its backward); the last stage's whole
    assert a.step_time == pytest.approx(b.step_time - 0.5 * b.backward[0])
    assert a.memory[0].activations == b.memory[0].activations  # stage 0: min(M, S) in flight, as 1F1B
    assert a.memory[1].activations == pytest.approx(
        2 * b.memory[1].activations, abs=1
    )  # the last stage: 2 held until their W, not 1
    one = [Stage(0, 0, 4)]
    assert zb.evaluate(one).step_time == base.evaluate(one).step_time  # one stage: no bubble to fill
    cpu = [device("cpu", "cpu", None), device("cpu", "cpu", None)]
    shared = CostModel(random_profile(random.Random(4), 4, cpu), 4, "zero-bubble", "never")
    same = CostModel(shared.profile, 4, "1f1b", "never")
    assert (
        shared.evaluate(two).step_time == same.evaluate(two).step_time
    )  # one physical device: nothing gained
    plan = search(prof, microbatches=4, schedule="zero-bubble")
    assert plan.schedule == "zero-bubble" and plan.predicted_step_time is not None

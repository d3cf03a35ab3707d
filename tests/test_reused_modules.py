"""A module called more than once in one forward trains exactly, or is refused naming it (issue 18, item 4).

Cases: one module object at two entries of an ``nn.Sequential`` (stage functions: each entry is a
layer, the entries share its parameters like tied weights); a child called twice by a model's own
forward, fx-traceable or not (also registered under two names); ALBERT-style reuse of blocks inside
a ``ModuleList`` (a block looped over twice, one block object at two indices). Every exact case is
compared with one device on the whole batch in float64; every refused case raises ``ValueError``
before any backward, naming the module, where it is called and a balance that works (and the
advice is followed). One spawn of 2 gloo ranks covers the pipeline across ranks.
"""

from __future__ import annotations

import copy
import os
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import torchspan
from torchspan.layers import find_layers, find_ties, model_layers
from torchspan.runtime.ranks import free_port, init_distributed

TOL = dict(rtol=1e-10, atol=1e-12)
LOSS_TOL = dict(rtol=1e-6, atol=1e-7)  # the returned loss is float32


def _lin(i: int = 4, o: int = 4) -> nn.Linear:
    return nn.Linear(i, o).double()


def _sequential() -> nn.Sequential:
    """``a`` at entries 0 and 4: the Sequential's forward calls it twice."""
    torch.manual_seed(0)
    a = _lin()
    return nn.Sequential(a, nn.Tanh(), _lin(), _lin(), a, _lin(4, 3))


def _sequential_stateless() -> nn.Sequential:
    """One activation object at entries 1 and 3 (a common way to write a Sequential)."""
    torch.manual_seed(6)
    act = nn.Tanh()
    return nn.Sequential(_lin(), act, _lin(), act, _lin(4, 3))


class Twice(nn.Module):
    """``block`` called twice with ``b`` in between; fx traces it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.block, self.b, self.head = _lin(), _lin(), _lin(), _lin(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.a(x))
        return self.head(self.block(torch.tanh(self.b(h))))


class TwiceUntraceable(Twice):
    """The same calls behind a data-dependent branch: fx cannot trace it (own-forward modes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.a(x))
        if float(h.detach().sum()) > -1e30:
            h = self.block(torch.tanh(self.b(h)))
        return self.head(h)


class TwoNames(Twice):
    """One module registered under two attribute names, each name called once."""

    def __init__(self) -> None:
        super().__init__()
        self.again = self.block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.again(torch.tanh(self.b(self.block(self.a(x))))))


class TwoNamesUntraceable(TwoNames):
    """Two names, one module, behind a data-dependent branch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.a(x))
        if float(h.detach().sum()) > -1e30:
            h = self.again(torch.tanh(self.b(h)))
        return self.head(h)


class TiedTwice(TwiceUntraceable):
    """The refusal's other fix: each call its own module holding the same ``nn.Parameter`` objects."""

    def __init__(self) -> None:
        super().__init__()
        self.block2 = _lin()
        self.block2.weight, self.block2.bias = self.block.weight, self.block.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.a(x))
        if float(h.detach().sum()) > -1e30:
            h = self.block2(torch.tanh(self.b(h)))
        return self.head(h)


class Albert(nn.Module):
    """Weight sharing as ALBERT: the blocks of a ModuleList looped over twice by the model's own forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed = _lin()
        self.blocks = nn.ModuleList([_lin(), _lin()])
        self.head = _lin(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for _ in range(2):
            for blk in self.blocks:
                h = torch.tanh(blk(h))
        return self.head(h)


class SharedIndex(Albert):
    """One block object at indices 0 and 2 of the ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks.append(self.blocks[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for blk in self.blocks:
            h = torch.tanh(blk(h))
        return self.head(h)


def _batch(rows: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(rows, 4, generator=g, dtype=torch.float64), torch.randn(
        rows, 3, generator=g, dtype=torch.float64
    )


def _span(model: nn.Module, **kw: Any) -> torchspan.Spanned:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # own-forward-serial says it does not pipeline
        return torchspan.span(model, **kw)


def _assert_parity(make: Any, label: str, steps: int = 1, **kw: Any) -> torchspan.Spanned:
    """``steps`` SGD steps of a span of ``make()`` against one device, gradients and weights in float64."""
    model = make()
    reference = copy.deepcopy(model)
    spanned = _span(model, **kw)
    x, y = _batch()
    opt = torch.optim.SGD(spanned.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        got = spanned.train_step(x, y, nn.MSELoss())
        want = nn.MSELoss()(reference(x), y)
        want.backward()
        torch.testing.assert_close(
            got.double(), want.detach(), **LOSS_TOL, msg=lambda m: f"{label}, step {step}: loss: {m}"
        )
        ref = dict(reference.named_parameters())
        for name, p in spanned.module.named_parameters():
            assert p.grad is not None, f"{label}: {name} has no gradient"
            torch.testing.assert_close(
                p.grad, ref[name].grad, **TOL, msg=lambda m: f"{label}, step {step}: {name}: {m}"
            )
        opt.step()
        ref_opt.step()
    ref = dict(reference.named_parameters())
    for name, p in spanned.module.named_parameters():
        torch.testing.assert_close(
            p.detach(), ref[name].detach(), **TOL, msg=lambda m: f"{label}: {name} after {steps} steps: {m}"
        )
    return spanned


def _assert_refused(make: Any, match: str, **kw: Any) -> str:
    """``span`` + ``train_step`` raise ``ValueError`` matching ``match`` before any backward (no gradient
    anywhere)."""
    model = make()
    x, y = _batch()
    with pytest.raises(ValueError, match=match) as info:
        _span(model, **kw).train_step(x, y, nn.MSELoss())
    assert all(p.grad is None for p in model.parameters()), "a refused step left gradients behind"
    return str(info.value)


# ------------------------------------------------------------------ nn.Sequential: one module at two entries


def test_sequential_lists_every_entry_as_a_layer_tied_to_the_first() -> None:
    model = _sequential()
    layers = model_layers(model)
    assert layers.names() == ["0", "1", "2", "3", "4", "5"]  # main dropped "4": 0, 1, 2, 3, 5
    assert layers.by_name("4").module is layers.by_name("0").module
    assert layers.calls == ("0", "1", "2", "3", "4", "5")
    ties = find_ties(model, layers)
    assert sorted(t.name for t in ties) == ["0.bias", "0.weight"] and all(
        t.layers == ("0", "4") for t in ties
    )
    assert torchspan.layers.execution_order(model) == ["0", "1", "2", "3", "4", "5"]


@pytest.mark.parametrize("microbatches, schedule", [(1, "gpipe"), (3, "1f1b")])
def test_sequential_entry_twice_trains_exactly(microbatches: int, schedule: str) -> None:
    common = dict(microbatches=microbatches, schedule=schedule)
    spanned = _assert_parity(_sequential, "one stage", steps=2, devices=["cpu"], **common)
    assert spanned.mode == "sequential"
    # the entries' calls on two stages of one device (the module lives there), and both in one stage
    for balance in ([2, 4], [3, 3], [5, 1]):
        _assert_parity(
            _sequential, f"balance {balance}", steps=2, devices=["cpu", "cpu"], balance=balance, **common
        )
    _assert_parity(
        _sequential, "workers per stage", devices=["cpu", "cpu"], balance=[3, 3], workers="stage", **common
    )
    _assert_parity(
        _sequential, "recompute", devices=["cpu", "cpu"], balance=[2, 4], recompute="always", **common
    )
    _assert_parity(_sequential_stateless, "an activation at two entries", devices=["cpu"], **common)
    _assert_parity(
        _sequential_stateless,
        "an activation at two entries, two stages",
        devices=["cpu", "cpu"],
        balance=[2, 3],
        **common,
    )


def test_sequential_entry_with_buffers_trains_in_one_stage_and_is_refused_across() -> None:
    def make() -> nn.Sequential:
        torch.manual_seed(3)
        norm = nn.BatchNorm1d(4).double()
        return nn.Sequential(norm, _lin(), norm, _lin(4, 3))

    model = _assert_parity(make, "BatchNorm at two entries, one stage", devices=["cpu"]).module
    ref = make()
    ref(_batch()[0])  # one device: both calls update the running statistics
    torch.testing.assert_close(model[0].running_mean, ref[0].running_mean, **TOL)
    text = _assert_refused(make, "are one module", devices=["cpu", "cpu"], balance=[2, 2])
    assert (
        "layers '0' (stage 0) and '2' (stage 1) are one module (BatchNorm1d)" in text
        and "buffer 'running_mean'" in text
    )
    assert "pass balance=[3, 1] with the same devices" in text, text
    _assert_parity(make, "the advice", devices=["cpu", "cpu"], balance=[3, 1])


def test_sequential_entries_on_two_devices_of_one_process_are_refused() -> None:
    from torchspan.runtime.placement import check_entries  # new with this fix

    model = _sequential()
    modules = torchspan.layers.top_level_modules(model)
    cpu, gpu = torch.device("cpu"), torch.device("cuda:0")  # devices as data: no GPU needed
    stage_of = {"0": 0, "1": 0, "2": 0, "3": 1, "4": 1, "5": 1}
    with pytest.raises(
        ValueError, match=r"entries '0' \(stage 0, cpu\), '4' \(stage 1, cuda:0\) are one module \(Linear\)"
    ) as info:
        check_entries(modules, stage_of, [cpu, gpu])
    assert "pass balance=[5, 1] with the same devices" in str(info.value)  # entries 0 to 4 in one stage
    check_entries(modules, stage_of, [cpu, cpu])  # one device: nothing to copy
    check_entries(
        modules, {n: 0 if n in "01234" else 1 for n in modules}, [cpu, gpu]
    )  # both entries in stage 0


# ------------------------------------------------------------------ a model's own forward calling one child
# twice


def test_fx_child_called_twice_exact_in_one_stage_refused_across_with_a_balance_that_works() -> None:
    for make in (Twice, TwoNames):
        _assert_parity(make, f"{make.__name__}, one stage", steps=2, devices=["cpu"])
        for balance in ([1, 3], [3, 1]):
            spanned = _assert_parity(
                make,
                f"{make.__name__}, {balance}",
                steps=2,
                devices=["cpu", "cpu"],
                balance=balance,
                microbatches=2,
            )
            assert spanned.mode == "fx"
        text = _assert_refused(
            make,
            "torchspan: module 'block' \\(Linear\\) is called 2 times",
            devices=["cpu", "cpu"],
            balance=[2, 2],
        )
        assert f"in one forward of {make.__name__} (after 'a', after 'b')" in text, text
        assert "pass balance=[1, 3] with the same devices" in text, text


@pytest.mark.parametrize("microbatches", [1, 3])  # 1: own-forward-serial; 3: threads take turns (own-forward)
def test_own_forward_child_called_twice_exact_in_one_stage_refused_across(microbatches: int) -> None:
    for make in (TwiceUntraceable, TwoNamesUntraceable):
        kw = dict(microbatches=microbatches)
        _assert_parity(make, "one stage", steps=2, devices=["cpu"], **kw)
        for balance in ([1, 3], [3, 1]):
            spanned = _assert_parity(
                make, f"{balance}", steps=2, devices=["cpu", "cpu"], balance=balance, **kw
            )
            assert spanned.mode.startswith("own-forward")
        text = _assert_refused(
            make,
            "torchspan: module 'block' \\(Linear\\) is called 2 times",
            devices=["cpu", "cpu"],
            balance=[2, 2],
            **kw,
        )
        assert "(after 'a', after 'b')" in text and "('block', 'b') lie in stages [0, 1]" in text, text
        assert "pass balance=[1, 3] with the same devices" in text, text
    # the other fix the refusal names: each call its own module, the parameters tied
    _assert_parity(
        TiedTwice,
        "tied copies across stages",
        steps=2,
        devices=["cpu", "cpu"],
        balance=[2, 3],
        microbatches=microbatches,
    )


# ------------------------------------------------------------------ blocks of a ModuleList reused
# (ALBERT-style)


def test_find_layers_keeps_blocks_called_twice_with_their_calls() -> None:
    layers = find_layers(Albert(), _batch()[0])
    assert layers.names() == ["embed", "blocks.0", "blocks.1", "head"]
    assert [layer.calls for layer in layers] == [1, 2, 2, 1]
    assert layers.calls == ("embed", "blocks.0", "blocks.1", "blocks.0", "blocks.1", "head")
    shared = find_layers(SharedIndex(), _batch()[0])
    assert shared.names() == ["embed", "blocks.0", "blocks.1", "head"]
    assert shared.by_name("blocks.2").name == "blocks.0" and shared.by_name("blocks.0").calls == 2

    class PieceOutside(Albert):  # a reused block whose piece also runs outside it: still refused, naming it
        def __init__(self) -> None:
            super().__init__()
            self.blocks[0] = nn.Sequential(_lin(), nn.Tanh(), _lin())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks[0][2](super().forward(x)[:, :1].expand(-1, 4))

    with pytest.raises(
        ValueError, match="'blocks.0.2' \\(part of 'blocks.0'\\) is called outside every layer"
    ):
        find_layers(PieceOutside(), _batch()[0])


@pytest.mark.parametrize("microbatches", [1, 2])
def test_blocks_reused_exact_in_one_stage_refused_across(microbatches: int) -> None:
    for make in (Albert, SharedIndex):
        _assert_parity(
            make, f"{make.__name__}, one stage", steps=2, devices=["cpu"], microbatches=microbatches
        )
        for balance in ([1, 3], [3, 1]):
            _assert_parity(
                make,
                f"{make.__name__}, {balance}",
                steps=2,
                devices=["cpu", "cpu"],
                balance=balance,
                microbatches=microbatches,
            )
        text = _assert_refused(
            make,
            "torchspan: module 'blocks.0' \\(Linear",
            devices=["cpu", "cpu"],
            balance=[2, 2],
            microbatches=microbatches,
        )
        assert (
            "after 'embed', after 'blocks.1'" in text and "pass balance=[1, 3] with the same devices" in text
        ), text
        if make is SharedIndex:
            assert "(Linear, also 'blocks.2')" in text, text
    # three stages: the closest balance that keeps blocks.0 and blocks.1 together
    text = _assert_refused(Albert, "'blocks.0'", devices=["cpu"] * 3, balance=[1, 1, 2])
    assert "pass balance=[1, 2, 1] with the same devices" in text, text
    _assert_parity(
        Albert,
        "the advice on three stages",
        devices=["cpu"] * 3,
        balance=[1, 2, 1],
        microbatches=microbatches,
    )


def test_reuse_spanning_every_block_leaves_one_cut_and_fewer_stages_when_none_fits() -> None:
    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(4)
            self.blocks = nn.ModuleList([_lin(), _lin(), _lin(4, 4)])
            self.out = _lin(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(2):
                for blk in self.blocks:
                    x = torch.tanh(blk(x))
            return self.out(self.blocks[0](x))  # blocks.0 a third time, after the last block

    text = _assert_refused(Loop, "'blocks.0'", devices=["cpu", "cpu"], balance=[2, 2])
    assert "is called 3 times" in text and "pass balance=[3, 1] with the same devices" in text, text
    _assert_parity(Loop, "the advice", devices=["cpu", "cpu"], balance=[3, 1])
    text = _assert_refused(Loop, "'blocks.0'", devices=["cpu"] * 3, balance=[1, 1, 2])
    assert "pass 2 devices and balance=[3, 1] (no balance with 3 stages can)" in text, text


# ------------------------------------------------------------------ a pipeline across 2 gloo ranks


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    init_distributed(timeout=60)


def _rank_parity(make: Any, label: str, rank: int, **kw: Any) -> torchspan.Spanned:
    """Two SGD steps across the ranks: every parameter this rank holds equals one device's, gradients and
    weights."""
    model = make()
    reference = copy.deepcopy(model)
    spanned = _span(model, **kw)
    x, y = _batch()
    opt = torch.optim.SGD(spanned.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        got = spanned.train_step(x, y, nn.MSELoss())
        want = nn.MSELoss()(reference(x), y)
        want.backward()
        torch.testing.assert_close(
            got.double(), want.detach(), **LOSS_TOL, msg=lambda m: f"{label}: rank {rank}: loss: {m}"
        )
        ref = dict(reference.named_parameters())
        for name, p in spanned.module.named_parameters():
            if p.device.type != "meta":
                assert p.grad is not None, f"{label}: rank {rank}: {name} has no gradient"
                torch.testing.assert_close(
                    p.grad, ref[name].grad, **TOL, msg=lambda m: f"{label}: rank {rank}: {name}: {m}"
                )
        opt.step()
        ref_opt.step()
    return spanned


def _ranks_worker(rank: int, world: int, port: int, out: str) -> None:
    _join(rank, world, port)
    # Sequential entries 0 and 4 (one module) on the two ranks: a tie, gradients summed, copies kept equal
    spanned = _rank_parity(
        _sequential, "Sequential entries on two ranks", rank, balance=[3, 3], microbatches=3, schedule="1f1b"
    )
    weight = spanned.module[0].weight.detach()
    copies = [torch.zeros_like(weight) for _ in range(world)]
    torch.distributed.all_gather(copies, weight)
    assert torch.equal(copies[0], copies[1]), "the shared module's copies drifted apart"
    # calls kept in one stage: exact (stage functions, the model's own forward)
    _rank_parity(Twice, "fx, both calls on rank 1", rank, balance=[1, 3], microbatches=2)
    _rank_parity(Albert, "own forward, blocks reused on rank 0", rank, balance=[3, 1], microbatches=2)
    # calls across ranks: refused on every rank before any exchange could hang
    texts = []
    for make in (Twice, Albert):
        try:
            _span(make(), balance=[2, 2], microbatches=2).train_step(*_batch(), nn.MSELoss())
            texts.append(f"{make.__name__}: no error")
        except ValueError as exc:
            texts.append(f"{make.__name__}: {exc}")
        except BaseException:
            texts.append(f"{make.__name__}: {traceback.format_exc()}")
    Path(out, f"rank{rank}.txt").write_text("\n".join(texts))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_reused_modules_across_two_ranks(tmp_path: Path) -> None:
    ctx = mp.start_processes(
        _ranks_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    start = time.monotonic()
    while not ctx.join(timeout=0.5):
        if time.monotonic() - start > 240:
            for p in ctx.processes:
                p.kill()
            pytest.fail("ranks still running after 240 s")
    for rank in range(2):
        lines = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert lines[0].startswith("Twice: torchspan: module 'block' (Linear) is called 2 times"), lines
        assert "pass balance=[1, 3] with the same devices" in lines[0], lines[0]
        assert lines[1].startswith("Albert: torchspan: module 'blocks.0' (Linear) is called 2 times"), lines
